"""The pool of threads plain ``def`` handlers run in.

Not :class:`concurrent.futures.ThreadPoolExecutor`: its threads are joined
at interpreter exit (``shutdown(wait=False)`` does not change that), so one
handler thread that never returns would keep a stopped worker's process
alive after SIGTERM. These threads are daemons: a worker that has given up
on a thread after its grace period exits without it. Work not yet started
is a plain :class:`concurrent.futures.Future` that can still be cancelled.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_Item = tuple["Future[Any]", Callable[[], Any]]


class HandlerThreads(Executor):
    """At most ``max_workers`` daemon threads, started as work arrives."""

    def __init__(self, max_workers: int, *, thread_name_prefix: str = "jobplane-handler") -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._shutdown = False

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` in one of the threads; its future."""
        future: Future[T] = Future()
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot submit to a pool that is shut down")
            self._queue.put((future, lambda: fn(*args, **kwargs)))
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._work,
                    name=f"{self._prefix}_{len(self._threads)}",
                    daemon=True,
                )
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, call = item
            if future.set_running_or_notify_cancel():
                try:
                    result = call()
                except BaseException as exc:
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del item, future, call  # not held while idle
            with self._lock:
                self._idle += 1

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called."""
        return self._shutdown

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more work; cancel what has not started (``cancel_futures``; else
        it still runs); wait for the threads only when asked (a thread given up
        on may never return)."""
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for thread in threads:
                thread.join()
