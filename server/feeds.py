"""One reader per watched job, fanned out to every watch stream of it.

Without this, each watch stream reads the job's events itself on every
wake-up, so N watchers of one job cost N queries per event. A :class:`JobFeed`
reads each job's new events once per wake-up into a bounded buffer that all of
its watchers in this process take from; a watcher further behind than the
buffer reaches reads the table itself until it has caught up.

A feed's task is the only thing that waits for the job's notifications and
re-reads on the slow timer. Feeds exist only while someone watches: the last
watcher to leave stops the feed.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeAlias

import structlog

from jobplane.errors import JobplaneError, Unavailable
from jobplane.store.jobs import StreamRead
from jobplane.store.listen import Listener, Subscription
from jobplane.tasks import cancel_and_wait
from jobplane.types import JobEvent

log = structlog.get_logger("jobplane.server")

Reader: TypeAlias = Callable[[uuid.UUID, uuid.UUID, int, int], Awaitable[StreamRead]]
FeedKey: TypeAlias = tuple[uuid.UUID, uuid.UUID]

EVENT_BATCH = 500


class JobFeed:
    """The newest events of one job, read once for all of its watchers.

    ``events`` holds seqs ``base + 1 .. head`` without gaps. ``ended`` means the
    job is terminal and ``head`` is its last event: nothing will follow.
    """

    def __init__(self, key: FeedKey, *, buffer: int) -> None:
        self.key = key
        self.events: list[JobEvent] = []
        self.base = 0
        self.ended = False
        self.error: BaseException | None = None
        self.watchers = 0
        self._buffer = buffer
        self._changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.wakeup: Subscription | None = None

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
    """The process's feeds, keyed by (tenant, job)."""

    def __init__(
        self,
        read: Reader,
        listener: Listener,
        *,
        recheck_seconds: float = 30.0,
        buffer: int = 1000,
    ) -> None:
        self._read = read
        self._listener = listener
        self._recheck_seconds = recheck_seconds
        self._buffer = buffer
        self._feeds: dict[FeedKey, JobFeed] = {}
        self._starting: dict[FeedKey, asyncio.Future[JobFeed]] = {}
        self._closing = False

    @property
    def feed_count(self) -> int:
        """Feeds running now (jobs watched in this process)."""
        return len(self._feeds)

    def open(self) -> None:
        """Accept watchers (again)."""
        self._closing = False

    def close(self) -> None:
        """End every watcher with UNAVAILABLE (they resume elsewhere)."""
        self._closing = True
        for feed in list(self._feeds.values()):
            feed.poke()

    async def stop(self) -> None:
        """Stop every feed; their watchers end as after :meth:`close`."""
        self.close()
        for feed in list(self._feeds.values()):
            await cancel_and_wait(feed.task)

    async def watch(
        self, tenant: uuid.UUID, job_id: uuid.UUID, after_seq: int
    ) -> AsyncIterator[JobEvent]:
        """The job's events after ``after_seq``, then live ones, until it ends."""
        cursor = after_seq
        feed = await self._join((tenant, job_id), after_seq)
        try:
            while True:
                if cursor < feed.base:
                    # Further behind than the buffer reaches: read the table.
                    read = await self._read(tenant, job_id, cursor, EVENT_BATCH)
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

    async def _join(self, key: FeedKey, after_seq: int) -> JobFeed:
        while True:
            feed = self._feeds.get(key)
            if feed is None or feed.error is not None:
                starting = self._starting.get(key)
                if starting is None:
                    feed = await self._start(key, after_seq)
                else:
                    # Another watcher is reading the job right now: share it.
                    try:
                        feed = await asyncio.shield(starting)
                    except asyncio.CancelledError:
                        current = asyncio.current_task()
                        if starting.cancelled() and not (current and current.cancelling()):
                            continue  # that watcher left before its read ended
                        raise
            task = feed.task
            if task is not None and task.done() and feed.error is None and not feed.ended:
                continue  # stopped for want of watchers just before we came
            feed.watchers += 1
            return feed

    async def _start(self, key: FeedKey, after_seq: int) -> JobFeed:
        starting = asyncio.get_running_loop().create_future()
        self._starting[key] = starting
        try:
            feed = JobFeed(key, buffer=self._buffer)
            with contextlib.ExitStack() as stack:
                # Subscribed before the first read: a commit after it wakes us.
                feed.wakeup = stack.enter_context(self._listener.subscribe(key[1]))
                first = await self._read(key[0], key[1], after_seq, EVENT_BATCH)
                feed.start_at(first, after_seq)
                feed.task = asyncio.create_task(
                    self._follow(feed, stack.pop_all(), more=len(first.events) == EVENT_BATCH),
                    name=f"feed-{key[1]}",
                )
            self._feeds[key] = feed
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                starting.cancel()
            else:
                starting.set_exception(exc)
                starting.exception()  # retrieved: joiners re-raise it, if any
            raise
        else:
            starting.set_result(feed)
        finally:
            del self._starting[key]
        return feed

    async def _follow(
        self, feed: JobFeed, subscription: contextlib.ExitStack, *, more: bool
    ) -> None:
        """Read the job's new events on every wake-up until it ends or nobody watches."""
        tenant, job_id = feed.key
        try:
            with subscription:
                while not feed.ended:
                    if not more:
                        assert feed.wakeup is not None
                        # The timer only covers notifications lost while the
                        # LISTEN connection was down; jitter spreads re-reads.
                        await feed.wakeup.wait(self._recheck_seconds * random.uniform(0.75, 1.25))
                    if feed.watchers == 0:
                        return
                    read = await self._read(tenant, job_id, feed.head, EVENT_BATCH)
                    feed.extend(read)
                    feed.poke()
                    more = not read.ended and len(read.events) == EVENT_BATCH
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Every watcher ends with this; the servicer maps a lost database
            # to UNAVAILABLE and clients resume.
            if not isinstance(exc, JobplaneError):
                log.warning("watch.feed_failed", job=str(job_id), error=repr(exc)[:200])
            feed.error = exc
        finally:
            if self._feeds.get(feed.key) is feed:
                del self._feeds[feed.key]
            feed.poke()

    def _leave(self, feed: JobFeed) -> None:
        feed.watchers -= 1
        if feed.watchers == 0 and feed.wakeup is not None:
            feed.wakeup.wake()  # the feed stops at once, not at its next read
