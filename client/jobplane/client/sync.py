"""The blocking client: an :class:`AsyncClient` driven on a private event loop.

The loop's thread and the bridge to it are in ``_loop``; this module holds the
client, its subscriptions, and what keeps a client working across fork().
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Generator, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import IO, Any, Self, TypeVar

import grpc

from jobplane.client._blobs import Source
from jobplane.client._loop import BEGUN_BEFORE_FORK, CutByFork, End, LoopThread, next_item
from jobplane.client._retry import RetryPolicy
from jobplane.client._sync_schedules import SyncScheduleCalls
from jobplane.client.aio import (
    DEFAULT_ADDRESS,
    DEFAULT_INLINE_BYTES,
    AsyncClient,
    connection_from_env,
    inline_bytes_from_env,
)
from jobplane.client.batch import MAX_BATCH_SIZE, JobSpec
from jobplane.client.subscription import EventSubscription, SubscribedEvent, SubscribeStart
from jobplane.client.tls import ClientTLS
from jobplane.events.envelope import Event
from jobplane.types import (
    Blob,
    BlobPage,
    ConcurrencyMode,
    DependencyFailurePolicy,
    Job,
    JobEvent,
    JobPage,
    JobState,
    WaitingCode,
)

T = TypeVar("T")

# How long fork() waits for calls other threads have in flight on a client
# before closing its channel under them.
_FORK_GRACE = 5.0


# The blocking clients of this process. gunicorn --preload, Celery's prefork
# pool and multiprocessing's fork start method fork a process that may hold
# one, and gRPC survives fork() only when no thread of the process is inside
# it: with a channel open, its poller thread always is, and the child's first
# call crashes or hangs. So each client closes its channel and stops its loop
# before fork(); parent and child each open new ones on their next call.
_clients: weakref.WeakSet[Client] = weakref.WeakSet()
# Clear from the hook before a fork to the one after it in the parent: a wait
# the fork cut short goes on only then, as a channel it opened in between
# would be open at the fork.
_not_forking = threading.Event()
_not_forking.set()
# What a child inherited still open (a call began in another thread while the
# process forked): never used nor closed there, as closing a channel shuts
# down sockets the parent still reads.
_inherited: list[tuple[AsyncClient, LoopThread]] = []


def _close_before_fork() -> None:
    _not_forking.clear()
    for client in list(_clients):
        client._close_for_fork()


def _after_fork_in_parent() -> None:
    _not_forking.set()


def _renew_after_fork() -> None:
    global _not_forking  # noqa: PLW0603 - the parent's, copied as its other threads left it
    _not_forking = threading.Event()
    _not_forking.set()
    for client in list(_clients):
        client._renew_in_child()


if hasattr(os, "register_at_fork"):  # Not on Windows, which cannot fork.
    os.register_at_fork(
        before=_close_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_renew_after_fork,
    )


class Client(SyncScheduleCalls):
    """A blocking client of one jobplane server; the twin of :class:`AsyncClient`.

    Calls run on a private event loop in a background thread, so the client is
    safe to share between threads. Use it as a context manager, or call
    :meth:`close` when done. ``tls`` is as for :class:`AsyncClient`.

    A client made before ``os.fork()`` (gunicorn ``--preload``, Celery's
    prefork pool, multiprocessing's fork start method) works in the parent
    and in the children: it closes its channel before the fork, and each
    process opens its own on its next call. A call another thread has in
    flight at the fork is given a few seconds to end before the channel is
    closed; one still running then fails with :class:`Unavailable` (retry it).
    :meth:`wait`, which may last as long as the job, does not hold up a fork:
    cut short by it, it goes on over the new channel once the fork is done,
    within its ``timeout``. A watch, subscription or page iteration open at
    the fork cannot go on (RuntimeError, in parent and child alike); start it
    again. gRPC survives a fork only when no channel is open, so other gRPC
    channels of the process must be closed too.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        api_key: str | None = None,
        *,
        timeout: float | None = 30.0,
        watch_retry: RetryPolicy | None = None,
        tls: ClientTLS | bool | None = None,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
        tracing: bool = False,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        # The calls run on the client's own loop, each in a copy of the
        # calling thread's context: the caller's current span goes along.
        self._async = AsyncClient(
            address,
            api_key,
            timeout=timeout,
            watch_retry=watch_retry,
            tls=tls,
            inline_bytes=inline_bytes,
            tracing=tracing,
            interceptors=interceptors,
        )
        self._loop = LoopThread()
        self._tracing = tracing
        self._interceptors = tuple(interceptors)
        _clients.add(self)

    def _fresh(self, old: AsyncClient) -> AsyncClient:
        """A new, unopened :class:`AsyncClient` with the settings of ``old``."""
        return AsyncClient(
            old.address,
            old.api_key,
            timeout=old.timeout,
            watch_retry=old.watch_retry,
            tls=old.tls,
            inline_bytes=old._inline_bytes,
            tracing=self._tracing,
            interceptors=self._interceptors,
        )

    def _close_for_fork(self) -> None:
        """Before fork(): close the channel and stop the loop; the next call opens new ones."""
        loop = self._loop
        if not loop.running or loop.in_loop_thread:
            return
        # A unary call of another thread would fail with the channel closed
        # under it: it is given time to end first.
        loop.settle(_FORK_GRACE)
        with contextlib.suppress(Exception):
            loop.run(self._async.close(), call=False)
        loop.stop(BEGUN_BEFORE_FORK)
        # The error a cut wait raised holds the old channel's call, and
        # gRPC's poller thread runs until the channel is freed: a child
        # forked with it running crashes. Their threads let go at once.
        loop.release(_FORK_GRACE)
        self._async, self._loop = self._fresh(self._async), LoopThread()

    def _renew_in_child(self) -> None:
        """In a forked child, leave what is still open to the parent and start over."""
        old, loop = self._async, self._loop
        if not loop.started:
            return
        loop.forked()
        _inherited.append((old, loop))
        self._async, self._loop = self._fresh(old), LoopThread(stopped=loop._stopped)

    @classmethod
    def from_env(
        cls,
        *,
        address: str | None = None,
        api_key: str | None = None,
        timeout: float | None = 30.0,
        watch_retry: RetryPolicy | None = None,
        tls: ClientTLS | bool | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Self:
        """A client configured as :meth:`AsyncClient.from_env` says."""
        address, api_key, tls = connection_from_env(address, api_key, tls, env)
        return cls(
            address,
            api_key,
            timeout=timeout,
            watch_retry=watch_retry,
            tls=tls,
            inline_bytes=inline_bytes_from_env(env),
        )

    @property
    def address(self) -> str:
        """The ``host:port`` of the server."""
        return self._async.address

    @property
    def api_key(self) -> str | None:
        """The API key sent with every call."""
        return self._async.api_key

    @property
    def tls(self) -> ClientTLS | None:
        """The channel's TLS settings; None when it speaks plaintext."""
        return self._async.tls

    @property
    def timeout(self) -> float | None:
        """Deadline in seconds of each unary call (watch streams have none)."""
        return self._async.timeout

    @property
    def watch_retry(self) -> RetryPolicy:
        """How :meth:`watch` and :meth:`subscribe` reconnect."""
        return self._async.watch_retry

    def __repr__(self) -> str:
        return f"{type(self).__name__}(address={self.address!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel, stop the loop and join its thread. Safe to call twice."""
        if self._loop.running:
            with contextlib.suppress(RuntimeError):
                self._loop.run(self._async.close())
        self._loop.stop()

    def submit(
        self,
        type: str,
        payload: dict[str, Any] | None = None,
        *,
        request_id: str | None = None,
        correlation_id: str = "",
        max_attempts: int = 0,
        labels: Mapping[str, str] | None = None,
        attempt_timeout: float | timedelta | None = None,
        schedule_time: datetime | None = None,
        schedule_delay: float | timedelta | None = None,
        concurrency_key: str = "",
        concurrency_limit: int = 0,
        concurrency_mode: ConcurrencyMode | str | None = None,
        deadline: datetime | float | timedelta | None = None,
        after: Sequence[Job | str] = (),
        after_failure: DependencyFailurePolicy | str | None = None,
    ) -> Job:
        """Create a job of ``type`` and return it; see :meth:`AsyncClient.submit`."""
        return self._loop.run(
            self._async.submit(
                type,
                payload,
                request_id=request_id,
                correlation_id=correlation_id,
                max_attempts=max_attempts,
                labels=labels,
                attempt_timeout=attempt_timeout,
                schedule_time=schedule_time,
                schedule_delay=schedule_delay,
                concurrency_key=concurrency_key,
                concurrency_limit=concurrency_limit,
                concurrency_mode=concurrency_mode,
                deadline=deadline,
                after=after,
                after_failure=after_failure,
            )
        )

    def submit_many(
        self,
        specs: Iterable[JobSpec | Mapping[str, Any]],
        *,
        batch_size: int = MAX_BATCH_SIZE,
    ) -> list[Job]:
        """Create many jobs at once, in the order of ``specs``; see
        :meth:`AsyncClient.submit_many`."""
        return self._loop.run(self._async.submit_many(specs, batch_size=batch_size))

    def get(self, name: str | Job, *, resolve_blobs: bool = True) -> Job:
        """The job as the server stores it now; see :meth:`AsyncClient.get`."""
        return self._loop.run(self._async.get(name, resolve_blobs=resolve_blobs))

    def list(
        self,
        *,
        page_size: int = 0,
        page_token: str = "",
        state: JobState | None = None,
        type: str | None = None,
        waiting_code: str | WaitingCode = "",
        parent: str | Job = "",
    ) -> JobPage:
        """One page of the caller's jobs, newest first; see :meth:`AsyncClient.list`."""
        return self._loop.run(
            self._async.list(
                page_size=page_size,
                page_token=page_token,
                state=state,
                type=type,
                waiting_code=waiting_code,
                parent=parent,
            )
        )

    def iter_jobs(
        self,
        *,
        page_size: int = 0,
        page_token: str = "",
        state: JobState | None = None,
        type: str | None = None,
        waiting_code: str | WaitingCode = "",
        parent: str | Job = "",
    ) -> Generator[Job, None, None]:
        """Every job matching the filters, fetching page after page."""
        return self._pull(
            self._async.iter_jobs(
                page_size=page_size,
                page_token=page_token,
                state=state,
                type=type,
                waiting_code=waiting_code,
                parent=parent,
            )
        )

    def cancel(self, name: str | Job, reason: str = "") -> Job:
        """Cancel a queued job, or ask a running one to stop."""
        return self._loop.run(self._async.cancel(name, reason))

    def retry(self, name: str | Job, *, from_stage: str = "") -> Job:
        """Start a new attempt of a FAILED or CANCELLED job; see :meth:`AsyncClient.retry`."""
        return self._loop.run(self._async.retry(name, from_stage=from_stage))

    def watch(self, name: str | Job, after_seq: int = 0) -> Generator[JobEvent, None, None]:
        """The job's events after ``after_seq``; see :meth:`AsyncClient.watch`.

        Stopping early (``break``, or closing the generator) ends the stream.
        """
        return self._pull(self._async.watch(name, after_seq))

    def wait(
        self, name: str | Job, timeout: float | None = None, *, resolve_blobs: bool = True
    ) -> Job:
        """Wait until the job ends and return it; :class:`TimeoutError` after ``timeout``.

        A fork in another thread does not wait for it, nor end it: the wait
        starts again over the client's new channel once the fork is done.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            loop = self._loop
            with loop.polling():
                try:
                    # A long poll, not a call a fork waits for: the job may
                    # run for hours, and every fork would stall for the grace.
                    return loop.run(
                        self._async.wait(name, left, resolve_blobs=resolve_blobs),
                        call=False,
                        resumable=True,
                    )
                except CutByFork:
                    # Let go of the error (it holds the old channel) before
                    # the fork is told this wait is out of the way.
                    pass
            # It only reads, so starting again is safe. The wait for the fork
            # is bounded: a fork is over in moments, and a wait must not hang
            # on a hook after it that never comes.
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            _not_forking.wait(_FORK_GRACE if left is None else min(left, _FORK_GRACE))

    def upload(self, source: Source, *, content_type: str | None = None) -> Blob:
        """Store a file, stream or bytes as a blob; see :meth:`AsyncClient.upload`."""
        return self._loop.run(self._async.upload(source, content_type=content_type))

    def get_blob(self, name: str) -> Blob:
        """One blob's metadata."""
        return self._loop.run(self._async.get_blob(name))

    def download(self, name: str, dest: str | os.PathLike[str] | IO[bytes]) -> Blob:
        """Write the blob to a path or writable binary stream; see :meth:`AsyncClient.download`."""
        return self._loop.run(self._async.download(name, dest))

    def read_blob(self, name: str) -> bytes:
        """The blob's bytes, in memory."""
        return self._loop.run(self._async.read_blob(name))

    def list_blobs(self, *, page_size: int = 0, page_token: str = "") -> BlobPage:
        """One page of the caller's blobs by name."""
        return self._loop.run(self._async.list_blobs(page_size=page_size, page_token=page_token))

    def iter_blobs(self, *, page_size: int = 0) -> Generator[Blob, None, None]:
        """Every blob of the caller, page by page."""
        return self._pull(self._async.iter_blobs(page_size=page_size))

    def delete_blob(self, name: str) -> None:
        """Delete a blob; :class:`~jobplane.errors.BlobInUse` while a job references it."""
        self._loop.run(self._async.delete_blob(name))

    def publish(
        self,
        event_type: str,
        payload: dict[str, Any] | None = None,
        *,
        event_id: uuid.UUID | str | None = None,
        timestamp: datetime | None = None,
        project_id: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        timeout: float | None = None,
    ) -> Event:
        """Publish a domain event and return it as stored; see :meth:`AsyncClient.publish`."""
        return self._loop.run(
            self._async.publish(
                event_type,
                payload,
                event_id=event_id,
                timestamp=timestamp,
                project_id=project_id,
                correlation_id=correlation_id,
                causation_id=causation_id,
                timeout=timeout,
            )
        )

    def subscribe(
        self,
        patterns: str | Iterable[str],
        *,
        after_cursor: str | None = None,
        start: SubscribeStart = "earliest",
    ) -> BlockingSubscription:
        """The caller's events matching ``patterns``, resuming by itself; see
        :meth:`AsyncClient.subscribe`. Close it (or use it in a ``with``) when done."""
        return BlockingSubscription(
            self._loop, self._async.subscribe(patterns, after_cursor=after_cursor, start=start)
        )

    def _pull(self, agen: AsyncGenerator[T, None]) -> Generator[T, None, None]:
        """A plain generator over ``agen``, each step run on the loop of now."""
        # The loop is taken now, not at the first step: after a fork the
        # client has a new loop, but ``agen`` is still the parent's.
        return _pulled(self._loop, agen)


def _pulled(loop: LoopThread, agen: AsyncGenerator[T, None]) -> Generator[T, None, None]:
    try:
        while True:
            item = loop.run(next_item(agen), call=False)
            if item is End.END:
                return
            yield item
    finally:
        # Closing runs the async generator's cleanup (it cancels the
        # stream) now rather than at loop shutdown.
        if loop.running and not loop.in_loop_thread:
            with contextlib.suppress(RuntimeError):
                loop.run(agen.aclose())


class BlockingSubscription:
    """An :class:`EventSubscription` for blocking code: ``for event, cursor in …``.

    It does not end by itself; :attr:`cursor` is the cursor of the last
    event it delivered. :meth:`close` (or leaving a ``with`` block) ends the
    stream.
    """

    def __init__(self, loop: LoopThread, subscription: EventSubscription) -> None:
        self._loop = loop
        self._subscription = subscription
        self._done = False

    @property
    def patterns(self) -> tuple[str, ...]:
        """The event-type patterns subscribed to."""
        return self._subscription.patterns

    @property
    def cursor(self) -> str | None:
        """The cursor of the last event delivered (else the ``after_cursor`` given)."""
        return self._subscription.cursor

    def __repr__(self) -> str:
        return f"{type(self).__name__}(patterns={list(self.patterns)!r}, cursor={self.cursor!r})"

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> SubscribedEvent:
        if self._done:
            raise StopIteration
        try:
            item = self._loop.run(next_item(self._subscription), call=False)
        except BaseException:
            self.close()
            raise
        if item is End.END:
            self._done = True
            raise StopIteration
        return item

    def close(self) -> None:
        """End the stream. Safe to call twice."""
        self._done = True
        if self._loop.running and not self._loop.in_loop_thread:
            with contextlib.suppress(RuntimeError):
                self._loop.run(self._subscription.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


__all__ = ["BlockingSubscription", "Client"]
