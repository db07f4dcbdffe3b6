"""The closed loop of a peer's callers, and how it talks to the benchmark.

The caller process says ``ready`` on stdout once it has imported and set up
its client, waits for ``go`` on stdin (the benchmark takes its CPU readings
in between, so start-up is not counted), submits, and prints one JSON line:
``first_submit`` (wall clock just before the first call), ``last_submit``
(after the last call returned) and ``cpu_s`` (its own CPU from go to then).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable


def shares(jobs: int, callers: int) -> list[int]:
    """How many of ``jobs`` each of ``callers`` submits (as even as can be)."""
    return [jobs // callers + (1 if i < jobs % callers else 0) for i in range(callers)]


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


def _go() -> float:
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no go from the benchmark")
    return _cpu()


def _report(first: float, cpu: float) -> None:
    line = {"first_submit": first, "last_submit": time.time(), "cpu_s": _cpu() - cpu}
    print(json.dumps(line), flush=True)


def threaded(submit: Callable[[], object], jobs: int, callers: int) -> None:
    """``jobs`` calls of ``submit`` from ``callers`` threads, each one at a time."""
    start = threading.Event()

    def caller(count: int) -> None:
        start.wait()
        for _ in range(count):
            submit()

    threads = [threading.Thread(target=caller, args=(n,)) for n in shares(jobs, callers)]
    for thread in threads:
        thread.start()
    cpu = _go()
    first = time.time()
    start.set()
    for thread in threads:
        thread.join()
    _report(first, cpu)


async def concurrent(submit: Callable[[], Awaitable[object]], jobs: int, callers: int) -> None:
    """``jobs`` awaits of ``submit`` from ``callers`` tasks, each one at a time."""

    async def caller(count: int) -> None:
        for _ in range(count):
            await submit()

    cpu = await asyncio.to_thread(_go)
    first = time.time()
    await asyncio.gather(*(caller(n) for n in shares(jobs, callers)))
    _report(first, cpu)


def arguments() -> tuple[int, int]:
    """``JOBS CALLERS`` from the command line."""
    jobs, callers = (int(a) for a in sys.argv[1:3])
    return jobs, callers
