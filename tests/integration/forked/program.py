"""A program that makes a blocking Client, uses it, forks, and uses it on both sides.

Argv: ADDRESS API_KEY MODE, MODE ``fork`` (os.fork, as gunicorn ``--preload``
does) or ``pool`` (a multiprocessing pool with the fork start method, as
Celery's prefork pool does). Prints one JSON object: what the parent, and the
children through their exit codes, saw. A watch begun before the fork is
refused on both sides. A child that hangs is ended by its alarm. MODE ``wait``
forks while another thread of the parent waits for a running job.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator

from jobplane.client import Client, JobState

ADDRESS, API_KEY, MODE = sys.argv[1], sys.argv[2], sys.argv[3]
CHILD_SECONDS = 45

client = Client(ADDRESS, API_KEY, timeout=20)


def echo(who: str) -> bool:
    """Submit a job through the shared client and wait for it: True if it echoed ``who``."""
    job = client.submit("demo.echo", {"who": who})
    done = client.wait(job, timeout=CHILD_SECONDS - 10)
    if done.state is JobState.SUCCEEDED and done.result == {"who": who}:
        return True
    print(f"{who}: {done.state} {done.result}", file=sys.stderr)
    return False


def refused(events: Iterator[object]) -> bool:
    """True when a watch begun before the fork refuses to go on (rather than hang)."""
    try:
        next(events)
    except RuntimeError as exc:
        return "before fork()" in str(exc)
    return False


def in_child(who: str, events: Iterator[object] | None = None) -> bool:
    signal.alarm(CHILD_SECONDS)
    try:
        return echo(who) and (events is None or refused(events))
    except BaseException:
        traceback.print_exc()
        return False


def wait_across_fork(seen: dict[str, object]) -> None:
    """Fork while another thread waits for a job that outlasts the fork."""
    job = client.submit("demo.progress", {"steps": 40, "interval_ms": 200})
    ended: list[object] = []

    def wait() -> None:
        try:
            ended.append(client.wait(job, timeout=CHILD_SECONDS - 10).state.value)
        except BaseException as exc:
            ended.append(repr(exc))

    waiter = threading.Thread(target=wait)
    waiter.start()
    # Long enough for the wait to be in its watch of the job.
    time.sleep(1.5)
    begun = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if in_child("child") else 1)
    seen["fork seconds"] = time.monotonic() - begun
    _, status = os.waitpid(pid, 0)
    seen["children"] = [os.waitstatus_to_exitcode(status) == 0]
    waiter.join(CHILD_SECONDS)
    seen["wait"] = ended


def main() -> None:
    seen: dict[str, object] = {"before": echo("parent before")}
    if MODE == "wait":
        wait_across_fork(seen)
    elif MODE == "fork":
        events = client.watch(client.submit("demo.echo", {}))
        next(events)
        pid = os.fork()
        if pid == 0:
            ok = in_child("child", events)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        seen["children"] = [os.waitstatus_to_exitcode(status) == 0]
        # The parent's own watch was closed with its channel before the fork.
        seen["watch refused"] = refused(events)
    else:
        with multiprocessing.get_context("fork").Pool(2) as pool:
            seen["children"] = pool.map(in_child, ["child 1", "child 2", "child 3"])
    seen["after"] = echo("parent after")
    client.close()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
