"""The event loop a blocking :class:`~jobplane.client.Client` runs its calls on: a daemon
thread, and the bridge that waits for a call's result in the caller's thread, keeps
Ctrl-C working, and tells what a fork() cut short apart from a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from jobplane.errors import JobplaneError, Unavailable

T = TypeVar("T")

# How long an interrupted call may take to wind down on the loop.
_CANCEL_GRACE = 5.0
# Longest uninterruptible wait for a result.
_POLL = 0.25

#: Why a call fails when a fork() closed the channel under it (a retryable
#: :class:`Unavailable`), and why a stream open at the fork cannot go on.
CUT_BY_FORK = "the call was cut short by fork(), which closed the client's channel; retry it"
BEGUN_BEFORE_FORK = (
    "a watch, subscription or page iteration begun before fork() cannot go on; start it again"
)


class End(enum.Enum):
    """The end of an async iterator, handed across the thread boundary as a value."""

    END = enum.auto()


class CutByFork(Exception):
    """A resumable call's loop was stopped by fork(): run it again on the client's new one."""


async def next_item(agen: AsyncIterator[T]) -> T | End:
    # StopAsyncIteration must not cross the thread boundary as an exception:
    # the future would report it, but it is not a failure.
    try:
        return await anext(agen)
    except StopAsyncIteration:
        return End.END


class LoopThread:
    """An event loop running in a daemon thread, started on first use."""

    def __init__(self, *, stopped: bool = False) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = stopped
        # Why calls are refused once stopped.
        self._stopped_because = "the client has been closed"
        # Set in a forked child: the thread is the parent's, gone here.
        self._forked = False
        # Calls of other threads waiting for their result (not a stream's
        # steps), which a fork lets finish before it closes the channel.
        self._calls = 0
        self._idle = threading.Condition()
        # Long polls on the loop (Client.wait): a fork cuts them short at
        # once, then waits for their threads to let go of the old channel.
        self._polls = 0
        # Set when a fork is closing the channel: a call that fails after it
        # failed for the fork.
        self._forking = False

    @property
    def started(self) -> bool:
        """True once the loop's thread has been started (stopped or not)."""
        return self._loop is not None

    @property
    def running(self) -> bool:
        """True between the first :meth:`run` and :meth:`stop`."""
        return self._loop is not None and not self._stopped

    @property
    def in_loop_thread(self) -> bool:
        """True when called from the loop's own thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._stopped:
                raise RuntimeError(self._stopped_because)
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                thread = threading.Thread(
                    target=self._main, args=(loop, ready), name="jobplane-client", daemon=True
                )
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    @staticmethod
    def _main(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            # Whatever is still pending (e.g. a watch the caller abandoned)
            # is cancelled and finalised here, not by the garbage collector.
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def run(self, coro: Coroutine[Any, Any, T], *, call: bool = True, resumable: bool = False) -> T:
        """Run ``coro`` on the loop and return its result in the calling thread.

        ``call``: a call a fork waits for (:meth:`settle`); a stream's next
        item, which may never come, is not one. ``resumable``: a long poll
        (:meth:`Client.wait`) the caller runs again when a fork cuts it
        short, told by :class:`CutByFork`; the fork does not wait for it.
        """
        if self._forked:
            # Its thread did not survive fork(): waiting for it would hang.
            coro.close()
            raise RuntimeError(BEGUN_BEFORE_FORK)
        if self.in_loop_thread:
            coro.close()
            raise RuntimeError("a blocking client call was made from its own event loop")
        try:
            loop = self._ensure()
        except RuntimeError as exc:
            coro.close()
            if resumable and self._forking:
                raise CutByFork from exc
            if call and self._forking:
                # Begun on the loop a fork was stopping: as a call it cut.
                raise Unavailable(CUT_BY_FORK) from exc
            raise
        finished = threading.Event()

        async def guarded() -> T:
            try:
                return await coro
            finally:
                finished.set()

        future = asyncio.run_coroutine_threadsafe(guarded(), loop)
        if call:
            with self._idle:
                self._calls += 1
        try:
            # Waiting in slices keeps Ctrl-C working where a lock wait cannot
            # be interrupted (Windows, or a signal taken by another thread).
            while True:
                try:
                    return future.result(timeout=_POLL)
                except TimeoutError:
                    # Also what a coroutine that timed out raises: tell the two apart.
                    if future.done():
                        return future.result()
        except Exception as exc:
            if resumable and self._forking:
                # Whatever it failed with (the channel closed under it, the
                # loop stopped), the fork caused it.
                raise CutByFork from exc
            if isinstance(exc, JobplaneError):
                raise
            if self._forking:
                # Whatever gRPC or the loop raised for a channel closed under
                # the call (channel closed, cancelled): for a call, the one
                # retryable error a caller already handles; for a stream, what
                # its next step after the fork says too.
                if call:
                    raise Unavailable(CUT_BY_FORK) from exc
                raise RuntimeError(BEGUN_BEFORE_FORK) from exc
            raise
        except BaseException:
            if not future.done():
                # Interrupted while waiting (KeyboardInterrupt): cancel the
                # call and let it unwind before the caller goes on.
                future.cancel()
                finished.wait(_CANCEL_GRACE)
            raise
        finally:
            if call:
                with self._idle:
                    self._calls -= 1
                    self._idle.notify_all()

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the calls in flight to end; those
        still running after it are cut short (:class:`Unavailable`) by the stop."""
        self._forking = True
        with self._idle:
            self._idle.wait_for(lambda: self._calls == 0, timeout)

    @contextlib.contextmanager
    def polling(self) -> Iterator[None]:
        """Count a long poll run on the loop for :meth:`release` while the block runs."""
        with self._idle:
            self._polls += 1
        try:
            yield
        finally:
            with self._idle:
                self._polls -= 1
                self._idle.notify_all()

    def release(self, timeout: float) -> None:
        """After :meth:`stop`, wait up to ``timeout`` seconds for the polls it cut short to end."""
        with self._idle:
            self._idle.wait_for(lambda: self._polls == 0, timeout)

    def forked(self) -> None:
        """Mark this loop as the parent's, in a forked child: no call may wait for it."""
        self._forked = True

    def stop(self, because: str | None = None) -> None:
        """Stop the loop and join its thread. Safe to call twice."""
        if self._forked:
            return
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._stopped_because = because or self._stopped_because
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if not self.in_loop_thread:
            thread.join()
