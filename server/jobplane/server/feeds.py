"""Watch streams fed by one batched reader per server process.

Without this, each watch stream reads the job's events itself on every
wake-up, so N watchers of a job cost N queries per event, and M jobs changing
together cost M queries. Here each watched job has a :class:`JobFeed`: a
bounded buffer of its newest events that all of its watchers in this process
take from. Notifications mark feeds due; one reader task reads every due
feed's new events in one statement (up to ``batch`` feeds at a time) and wakes
their watchers. A watcher further behind than the buffer reaches reads the
table itself until it has caught up.

A feed exists while someone watches its job and the job has not ended; a
slow timer marks every feed due, for notifications lost while the LISTEN
connection was down (the listener also marks all due when it reconnects).
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeAlias

import structlog

from jobplane.errors import JobNotFound, Unavailable
from jobplane.logs import describe_error
from jobplane.store.jobs import StreamRead
from jobplane.store.listen import Listener
from jobplane.tasks import cancel_and_wait
from jobplane.types import JobEvent

# Its own generator: a recheck's jitter never moves the process's global
# random state (an application's seeded random, or a test's).
_JITTER = random.Random()

log = structlog.get_logger("jobplane.server")

ReadMany: TypeAlias = Callable[
    [Sequence[tuple[uuid.UUID, uuid.UUID, int]], int], Awaitable[list[StreamRead | None]]
]

EVENT_BATCH = 500


class JobFeed:
    """The newest events of one job, read once for all of its watchers.

    ``events`` holds seqs ``base + 1 .. head`` without gaps. ``ended`` means the
    job is terminal and ``head`` is its last event: nothing will follow.
    """

    def __init__(self, tenant: uuid.UUID, job_id: uuid.UUID, *, buffer: int) -> None:
        self.tenant = tenant
        self.job_id = job_id
        self.key = str(job_id)
        self.events: list[JobEvent] = []
        self.base = 0
        self.ended = False
        self.error: BaseException | None = None
        self.watchers = 0
        self._buffer = buffer
        self._changed = asyncio.Event()
        # Done once the first read is in; a notification before then is
        # remembered and read after it.
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.missed = False

    @property
    def head(self) -> int:
        """The last seq the feed has read."""
        return self.base + len(self.events)

    def after(self, cursor: int) -> list[JobEvent]:
        """Buffered events with seq > ``cursor`` (``cursor`` must be >= ``base``)."""
        return self.events[max(0, cursor - self.base) :]

    def changed(self) -> asyncio.Event:
        """An event set at the next change of the feed (take it before looking)."""
        return self._changed

    def poke(self) -> None:
        """Wake every watcher of the feed (it has news, or the server is closing)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def start_at(self, read: StreamRead, after_seq: int) -> None:
        """Take the first read, made after ``after_seq``."""
        # A cursor past the job's last event (allowed) must not become the
        # base: events up to it are still to come and belong in the buffer.
        self.base = min(after_seq, read.last_seq)
        self.events = list(read.events)
        self.ended = read.ended

    def extend(self, read: StreamRead) -> None:
        """Append a read made after ``head``; trim to the buffer size."""
        self.events.extend(read.events)
        overflow = len(self.events) - self._buffer
        if overflow > 0:
            del self.events[:overflow]
            self.base += overflow
        self.ended = read.ended


class FeedHub:
    """The process's feeds and the one reader that fills them."""

    def __init__(
        self,
        read_many: ReadMany,
        listener: Listener,
        *,
        recheck_seconds: float = 30.0,
        buffer: int = 1000,
        batch: int = 500,
    ) -> None:
        self._read_many = read_many
        self._recheck_seconds = recheck_seconds
        self._buffer = buffer
        self._batch = batch
        # job id (as in notifications) -> tenant -> feed; the tenant is part
        # of every read, so a caller of another tenant never shares a feed.
        self._feeds: dict[str, dict[uuid.UUID, JobFeed]] = {}
        self._due: dict[int, JobFeed] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        listener.on_notify(self._on_notify)
        listener.on_reset(self._mark_all)

    @property
    def feed_count(self) -> int:
        """Feeds open now (jobs watched in this process)."""
        return sum(len(by_tenant) for by_tenant in self._feeds.values())

    def open(self) -> None:
        """Accept watchers (again)."""
        self._closing = False

    def close(self) -> None:
        """End every watcher with UNAVAILABLE (they resume elsewhere)."""
        self._closing = True
        for by_tenant in list(self._feeds.values()):
            for feed in list(by_tenant.values()):
                feed.poke()

    async def stop(self) -> None:
        """Close, and stop the reader."""
        self.close()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            await cancel_and_wait(task)

    async def watch(
        self, tenant: uuid.UUID, job_id: uuid.UUID, after_seq: int
    ) -> AsyncIterator[JobEvent]:
        """The job's events after ``after_seq``, then live ones, until it ends."""
        cursor = after_seq
        feed = await self._join(tenant, job_id, after_seq)
        try:
            while True:
                if cursor < feed.base:
                    # Further behind than the buffer reaches: read the table.
                    read = await self._read_one(tenant, job_id, cursor)
                    for event in read.events:
                        yield event
                        cursor = event.seq
                    if read.ended:
                        return
                    if read.events:
                        continue
                changed = feed.changed()
                if feed.error is not None:
                    raise feed.error
                batch = feed.after(cursor) if cursor >= feed.base else []
                for event in batch:
                    yield event
                    cursor = event.seq
                if batch:
                    continue
                if feed.ended and cursor >= feed.head:
                    return
                if self._closing:
                    raise Unavailable(
                        f"the server is shutting down; resume with after_seq={cursor}"
                    )
                await changed.wait()
        finally:
            self._leave(feed)

    async def _read_one(self, tenant: uuid.UUID, job_id: uuid.UUID, after_seq: int) -> StreamRead:
        read = (await self._read_many([(tenant, job_id, after_seq)], EVENT_BATCH))[0]
        if read is None:
            raise JobNotFound(f"jobs/{job_id} not found")
        return read

    async def _join(self, tenant: uuid.UUID, job_id: uuid.UUID, after_seq: int) -> JobFeed:
        key = str(job_id)
        while True:
            feed = self._feeds.get(key, {}).get(tenant)
            if feed is None:
                return await self._start(tenant, job_id, after_seq)
            if not feed.started.done():
                # Another watcher is reading the job right now: share its read.
                try:
                    await asyncio.shield(feed.started)
                except asyncio.CancelledError:
                    current = asyncio.current_task()
                    if feed.started.cancelled() and not (current and current.cancelling()):
                        continue  # that watcher left before its read ended
                    raise
            feed.watchers += 1
            return feed

    async def _start(self, tenant: uuid.UUID, job_id: uuid.UUID, after_seq: int) -> JobFeed:
        if not self._tasks:
            # Started by the first watcher's call, but serving every call: an
            # empty context, not that call's identity and log bindings.
            self._tasks = [
                asyncio.create_task(
                    self._read_loop(), name="watch-reader", context=contextvars.Context()
                ),
                asyncio.create_task(
                    self._recheck_loop(), name="watch-recheck", context=contextvars.Context()
                ),
            ]
        feed = JobFeed(tenant, job_id, buffer=self._buffer)
        # Registered before the first read: a notification from then on is
        # not lost (it is read right after).
        self._feeds.setdefault(feed.key, {})[tenant] = feed
        try:
            feed.start_at(await self._read_one(tenant, job_id, after_seq), after_seq)
        except BaseException as exc:
            self._drop(feed)
            if isinstance(exc, asyncio.CancelledError):
                feed.started.cancel()
            else:
                feed.started.set_exception(exc)
                feed.started.exception()  # retrieved: joiners re-raise it, if any
            raise
        feed.started.set_result(None)
        feed.watchers += 1
        if feed.ended:
            self._drop(feed)
        elif feed.missed or len(feed.events) == EVENT_BATCH:
            self._mark(feed)
        return feed

    def _on_notify(self, payload: str) -> None:
        for feed in self._feeds.get(payload, {}).values():
            if feed.started.done():
                self._mark(feed)
            else:
                feed.missed = True

    def _mark(self, feed: JobFeed) -> None:
        self._due[id(feed)] = feed
        self._wake.set()

    def _mark_all(self) -> None:
        for by_tenant in self._feeds.values():
            for feed in by_tenant.values():
                if feed.started.done():
                    self._mark(feed)
                else:
                    feed.missed = True

    async def _recheck_loop(self) -> None:
        while True:
            await asyncio.sleep(self._recheck_seconds * _JITTER.uniform(0.75, 1.25))
            self._mark_all()

    async def _read_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._due:
                due = list(self._due.values())[: self._batch]
                for feed in due:
                    del self._due[id(feed)]
                due = [f for f in due if self._is_open(f)]
                if not due:
                    continue
                try:
                    await self._read_due(due)
                except Exception as exc:
                    # A bug, not the database (_read_due handles that): end
                    # these streams (clients resume) rather than leave them hanging.
                    log.exception("watch.reader_failed", jobs=len(due))
                    for feed in due:
                        self._fail(feed, exc)

    async def _read_due(self, due: list[JobFeed]) -> None:
        try:
            reads = await self._read_many([(f.tenant, f.job_id, f.head) for f in due], EVENT_BATCH)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Every watcher of these jobs ends with this; the servicer maps a
            # lost database to UNAVAILABLE and clients resume.
            log.warning("watch.read_failed", jobs=len(due), error=describe_error(exc))
            for feed in due:
                self._fail(feed, exc)
            return
        for feed, read in zip(due, reads, strict=True):
            if read is None:
                self._fail(feed, JobNotFound(f"jobs/{feed.job_id} not found"))
                continue
            feed.extend(read)
            feed.poke()
            if feed.ended:
                self._drop(feed)
            elif len(read.events) == EVENT_BATCH:
                self._mark(feed)  # more to read

    def _is_open(self, feed: JobFeed) -> bool:
        return self._feeds.get(feed.key, {}).get(feed.tenant) is feed

    def _fail(self, feed: JobFeed, error: BaseException) -> None:
        feed.error = error
        self._drop(feed)
        feed.poke()

    def _drop(self, feed: JobFeed) -> None:
        """No new watchers join ``feed``; its current ones finish with it."""
        self._due.pop(id(feed), None)
        by_tenant = self._feeds.get(feed.key)
        if by_tenant is not None and by_tenant.get(feed.tenant) is feed:
            del by_tenant[feed.tenant]
            if not by_tenant:
                del self._feeds[feed.key]

    def _leave(self, feed: JobFeed) -> None:
        feed.watchers -= 1
        if feed.watchers == 0:
            self._drop(feed)
