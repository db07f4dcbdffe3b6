"""The worker's pool of handler threads: bounded, cancellable before a thread
takes the work, and never in the way of the process's exit."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from jobplane.workers.threads import HandlerThreads


def test_work_runs_in_at_most_max_workers_named_threads() -> None:
    threads = HandlerThreads(2, thread_name_prefix="t")
    try:
        names = [threads.submit(lambda: threading.current_thread().name) for _ in range(20)]
        assert {f.result(timeout=10) for f in names} <= {"t_0", "t_1"}
        with pytest.raises(ZeroDivisionError):
            threads.submit(lambda: 1 / 0).result(timeout=10)
    finally:
        threads.shutdown()
    with pytest.raises(RuntimeError) as refused:
        threads.submit(print)
    assert str(refused.value) == "cannot submit to a pool that is shut down"


def test_an_idle_thread_takes_one_piece_of_work_and_a_second_gets_a_thread() -> None:
    """Work runs at once while fewer than max_workers threads are busy: an idle
    thread is counted as taken once, so the next piece starts a thread of its own."""
    threads = HandlerThreads(2, thread_name_prefix="t")
    release = threading.Event()
    try:
        assert threads.submit(threading.current_thread).result(timeout=10).name == "t_0"
        deadline = time.monotonic() + 10
        while threads._idle != 1:  # t_0 back at the queue
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busy = threads.submit(release.wait, 10)
        # Runs beside `busy` (a second thread starts for it): it is what releases
        # `busy`, which would otherwise hold the one thread for ten seconds.
        beside = threads.submit(release.set)
        assert beside.result(timeout=5) is None
        assert busy.result(timeout=10) is True
    finally:
        release.set()
        threads.shutdown()


def test_work_not_yet_taken_by_a_thread_can_be_cancelled() -> None:
    threads = HandlerThreads(1)
    release = threading.Event()
    ran: list[str] = []
    try:
        busy = threads.submit(release.wait, 10)
        queued = threads.submit(ran.append, "queued")
        assert queued.cancel()
        later = threads.submit(ran.append, "later")
        release.set()
        assert busy.result(timeout=10) is True
        later.result(timeout=10)
        assert ran == ["later"]
    finally:
        release.set()
        threads.shutdown()


def test_shutdown_runs_what_was_submitted_unless_told_to_cancel_it() -> None:
    threads = HandlerThreads(1)
    release = threading.Event()
    busy = threads.submit(release.wait, 10)
    queued = threads.submit(lambda: "ran")
    threads.shutdown(wait=False)
    release.set()
    assert busy.result(timeout=10) is True and queued.result(timeout=10) == "ran"

    threads = HandlerThreads(1)
    release.clear()
    busy = threads.submit(release.wait, 10)
    queued = threads.submit(lambda: "ran")
    threads.shutdown(wait=False, cancel_futures=True)
    release.set()
    assert busy.result(timeout=10) is True and queued.cancelled()
    threads.shutdown()


def test_a_thread_that_never_returns_does_not_hold_the_process_at_exit() -> None:
    program = (
        "import time\n"
        "from jobplane.workers.threads import HandlerThreads\n"
        "threads = HandlerThreads(1)\n"
        "threads.submit(time.sleep, 3600)\n"
        "time.sleep(0.1)\n"
        "threads.shutdown(wait=False, cancel_futures=True)\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, timeout=60)
