"""The per-job feed that fans one reader out to every watcher of a job.

A fake event log stands in for the table (these are unit tests); the listener
is the real class, never started, notified by hand.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime

import pytest
import structlog
from structlog.testing import capture_logs

from jobplane.errors import JobNotFound, Unavailable
from jobplane.names import job_name
from jobplane.server import feeds
from jobplane.server.feeds import EVENT_BATCH, FeedHub, JobFeed
from jobplane.store.jobs import StreamRead
from jobplane.store.listen import Listener
from jobplane.types import EventType, JobEvent, JobState

TENANT = uuid.uuid4()


class Log:
    """Jobs' events in memory, read the way JobStore.read_stream reads them."""

    def __init__(self) -> None:
        self.events: dict[uuid.UUID, list[JobEvent]] = {}
        self.reads = 0
        self.jobs_read = 0
        self.fail: Exception | None = None

    def add(self, job_id: uuid.UUID, event_type: EventType = EventType.PROGRESS) -> None:
        events = self.events.setdefault(job_id, [])
        state = {
            EventType.SUCCEEDED: JobState.SUCCEEDED,
            EventType.QUEUED: JobState.QUEUED,
        }.get(event_type, JobState.RUNNING)
        events.append(
            JobEvent(
                name=job_name(job_id),
                seq=len(events) + 1,
                type=event_type,
                state=state,
                progress=0.0,
                message="",
                event_time=datetime.now(UTC),
            )
        )

    async def read(
        self, wanted: Sequence[tuple[uuid.UUID, uuid.UUID, int]], limit: int
    ) -> list[StreamRead | None]:
        self.reads += 1
        self.jobs_read += len(wanted)
        await asyncio.sleep(0)  # a real read yields to the loop
        if self.fail is not None:
            raise self.fail
        return [self._one(tenant, job_id, after, limit) for tenant, job_id, after in wanted]

    def _one(
        self, tenant: uuid.UUID, job_id: uuid.UUID, after_seq: int, limit: int
    ) -> StreamRead | None:
        if tenant != TENANT or job_id not in self.events:
            return None
        events = self.events[job_id]
        batch = [e for e in events if e.seq > after_seq][:limit]
        last_sent = batch[-1].seq if batch else after_seq
        ended = bool(events) and events[-1].terminal and last_sent >= len(events)
        return StreamRead(events=batch, ended=ended, last_seq=len(events))


def notify(listener: Listener, job_id: uuid.UUID) -> None:
    listener._on_notify(None, 0, "jobplane_events", str(job_id))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def collect(stream: AsyncIterator[JobEvent], into: list[int]) -> None:
    async for event in stream:
        into.append(event.seq)


@pytest.fixture
def log() -> Log:
    return Log()


@pytest.fixture
def listener() -> Listener:
    return Listener("postgresql://unused", "jobplane_events")


async def test_one_read_per_wakeup_for_all_watchers_of_a_job(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job, EventType.QUEUED)
    seen: list[list[int]] = [[] for _ in range(50)]
    tasks = [asyncio.create_task(collect(hub.watch(TENANT, job, 0), s)) for s in seen]
    await settle()
    assert log.reads == 1
    assert hub.feed_count == 1
    assert all(s == [1] for s in seen)

    log.add(job)
    log.add(job)
    notify(listener, job)
    await settle()
    assert log.reads == 2
    assert all(s == [1, 2, 3] for s in seen)

    # Watchers arriving later are served from the feed's buffer, without a read.
    late: list[list[int]] = [[] for _ in range(10)]
    tasks += [asyncio.create_task(collect(hub.watch(TENANT, job, 0), s)) for s in late]
    await settle()
    assert log.reads == 2
    seen += late

    log.add(job, EventType.SUCCEEDED)
    notify(listener, job)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(s == [1, 2, 3, 4] for s in seen)
    assert log.reads == 3
    assert hub.feed_count == 0


async def test_a_watcher_behind_the_buffer_reads_the_table_without_gaps(
    log: Log, listener: Listener
) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60, buffer=3)
    job = uuid.uuid4()
    for _ in range(10):
        log.add(job)
    ahead: list[int] = []
    first = asyncio.create_task(collect(hub.watch(TENANT, job, 8), ahead))
    await settle()
    behind: list[int] = []
    second = asyncio.create_task(collect(hub.watch(TENANT, job, 0), behind))
    await settle()
    for _ in range(5):
        log.add(job)
    notify(listener, job)
    await settle()
    log.add(job, EventType.SUCCEEDED)
    notify(listener, job)
    await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert ahead == list(range(9, 17))
    assert behind == list(range(1, 17))


async def test_a_cursor_past_the_last_event_waits_for_it(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    early: list[int] = []
    late: list[int] = []
    a = asyncio.create_task(collect(hub.watch(TENANT, job, 3), late))
    await settle()
    b = asyncio.create_task(collect(hub.watch(TENANT, job, 0), early))
    await settle()
    for _ in range(3):
        log.add(job)
    log.add(job, EventType.SUCCEEDED)
    notify(listener, job)
    await asyncio.wait_for(asyncio.gather(a, b), 5)
    assert late == [4, 5]
    assert early == [1, 2, 3, 4, 5]


async def test_an_ended_job_ends_the_stream_at_once(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    log.add(job, EventType.SUCCEEDED)
    got: list[int] = []
    await asyncio.wait_for(collect(hub.watch(TENANT, job, 0), got), 5)
    assert got == [1, 2]
    got.clear()
    await asyncio.wait_for(collect(hub.watch(TENANT, job, 2), got), 5)
    assert got == []
    await settle()
    assert hub.feed_count == 0


async def test_unknown_job_and_other_tenants_get_not_found(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    waiting = [asyncio.create_task(collect(hub.watch(uuid.uuid4(), job, 0), [])) for _ in range(3)]
    results = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(r, JobNotFound) for r in results)
    assert hub.feed_count == 0


async def test_a_failed_read_ends_every_watcher_and_the_next_one_starts_afresh(
    log: Log, listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A logger not yet used: one used by an earlier test in this process is
    # cached (cache_logger_on_first_use) and would write past capture_logs.
    monkeypatch.setattr(feeds, "log", structlog.get_logger("jobplane.server"))
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    tasks = [asyncio.create_task(collect(hub.watch(TENANT, job, 0), [])) for _ in range(5)]
    await settle()
    log.fail = ConnectionResetError("database went away")
    with capture_logs() as logs:
        notify(listener, job)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert all(isinstance(r, ConnectionResetError) for r in results)
    # One line for the operator: which read failed, for how many jobs, why.
    assert [entry for entry in logs if entry["event"] == "watch.read_failed"] == [
        {
            "event": "watch.read_failed",
            "log_level": "warning",
            "jobs": 1,
            "error": "ConnectionResetError: database went away",
        }
    ]
    assert hub.feed_count == 0

    log.fail = None
    log.add(job, EventType.SUCCEEDED)
    got: list[int] = []
    await asyncio.wait_for(collect(hub.watch(TENANT, job, 1), got), 5)
    assert got == [2]


async def test_the_last_watcher_leaving_stops_the_feed(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    tasks = [asyncio.create_task(collect(hub.watch(TENANT, job, 0), [])) for _ in range(3)]
    await settle()
    assert hub.feed_count == 1
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await settle()
    assert hub.feed_count == 0
    # A notification for a job nobody watches any more reads nothing.
    reads = log.reads
    notify(listener, job)
    await settle()
    assert log.reads == reads


async def test_a_new_watcher_right_after_the_last_left_gets_a_live_feed(
    log: Log, listener: Listener
) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    first = asyncio.create_task(collect(hub.watch(TENANT, job, 0), []))
    await settle()
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    got: list[int] = []
    second = asyncio.create_task(collect(hub.watch(TENANT, job, 1), got))
    await settle()
    log.add(job, EventType.SUCCEEDED)
    notify(listener, job)
    await asyncio.wait_for(second, 5)
    assert got == [2]


async def test_close_ends_watchers_with_unavailable(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    tasks = [asyncio.create_task(collect(hub.watch(TENANT, job, 0), [])) for _ in range(3)]
    await settle()
    hub.close()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert all(isinstance(r, Unavailable) for r in results)
    await hub.stop()
    assert hub.feed_count == 0


async def test_the_timer_rereads_when_a_notification_was_lost(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=0.05)
    job = uuid.uuid4()
    log.add(job)
    got: list[int] = []
    task = asyncio.create_task(collect(hub.watch(TENANT, job, 0), got))
    await settle()
    log.add(job, EventType.SUCCEEDED)  # no notification
    await asyncio.wait_for(task, 5)
    assert got == [1, 2]


@pytest.mark.parametrize("draw", [0.75, 1.25])
async def test_the_timer_waits_its_setting_within_a_quarter(
    log: Log, listener: Listener, monkeypatch: pytest.MonkeyPatch, draw: float
) -> None:
    drawn: list[tuple[float, float]] = []
    slept: list[float] = []

    def uniform(low: float, high: float) -> float:
        drawn.append((low, high))
        return draw

    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        if seconds == 0:  # a yield to the loop, not the timer
            return await real_sleep(0)
        slept.append(seconds)
        await asyncio.Event().wait()  # the timer's first wait is enough

    monkeypatch.setattr(feeds._JITTER, "uniform", uniform)
    monkeypatch.setattr(asyncio, "sleep", sleep)
    hub = FeedHub(log.read, listener, recheck_seconds=40)
    job = uuid.uuid4()
    log.add(job)
    task = asyncio.create_task(collect(hub.watch(TENANT, job, 0), []))
    await settle()
    assert (drawn, slept) == ([(0.75, 1.25)], [40 * draw])
    task.cancel()
    await hub.stop()


async def test_jobs_changing_together_are_read_in_one_statement(
    log: Log, listener: Listener
) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    jobs = [uuid.uuid4() for _ in range(20)]
    seen: dict[uuid.UUID, list[int]] = {job: [] for job in jobs}
    for job in jobs:
        log.add(job)
    tasks = [asyncio.create_task(collect(hub.watch(TENANT, job, 0), seen[job])) for job in jobs]
    await settle()
    reads = log.reads
    for job in jobs:
        log.add(job, EventType.SUCCEEDED)
        notify(listener, job)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert log.reads == reads + 1
    assert all(s == [1, 2] for s in seen.values())


async def test_a_reconnect_of_the_listener_rereads_every_feed(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    got: list[int] = []
    task = asyncio.create_task(collect(hub.watch(TENANT, job, 0), got))
    await settle()
    log.add(job, EventType.SUCCEEDED)  # its notification was lost
    listener.wake_all()  # what the listener does when it reconnects
    await asyncio.wait_for(task, 5)
    assert got == [1, 2]


async def test_a_broken_read_ends_the_streams_instead_of_hanging_them(
    log: Log, listener: Listener
) -> None:
    async def short_read(
        wanted: Sequence[tuple[uuid.UUID, uuid.UUID, int]], limit: int
    ) -> list[StreamRead | None]:
        reads = await log.read(wanted, limit)
        return reads if len(wanted) == 1 and log.reads == 1 else []  # later: one short

    hub = FeedHub(short_read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    task = asyncio.create_task(collect(hub.watch(TENANT, job, 0), []))
    await settle()
    notify(listener, job)
    with pytest.raises(ValueError, match="zip"):
        await asyncio.wait_for(task, 5)
    assert hub.feed_count == 0


async def test_another_tenant_never_joins_a_live_feed(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    owner: list[int] = []
    watching = asyncio.create_task(collect(hub.watch(TENANT, job, 0), owner))
    await settle()
    assert owner == [1] and hub.feed_count == 1

    intruder: list[int] = []
    with pytest.raises(JobNotFound):
        # Bounded: a watcher that joined the feed would wait for the job's end.
        await asyncio.wait_for(collect(hub.watch(uuid.uuid4(), job, 0), intruder), timeout=5)
    log.add(job)
    notify(listener, job)
    await settle()
    assert intruder == []
    assert owner == [1, 2]
    watching.cancel()
    await asyncio.gather(watching, return_exceptions=True)


async def test_a_feed_keeps_at_most_its_buffer_of_the_newest_events(log: Log) -> None:
    job = uuid.uuid4()
    for _ in range(5):
        log.add(job)
    feed = JobFeed(TENANT, job, buffer=4)
    read = log._one(TENANT, job, 0, 4)
    assert read is not None
    feed.extend(read)
    assert (feed.base, feed.head) == (0, 4)
    rest = log._one(TENANT, job, 4, 4)
    assert rest is not None
    feed.extend(rest)  # one over the buffer: the oldest goes
    assert (feed.base, feed.head) == (1, 5)
    assert [e.seq for e in feed.events] == [2, 3, 4, 5]
    assert [e.seq for e in feed.after(3)] == [4, 5]


async def test_a_long_history_is_read_in_bounded_batches(log: Log, listener: Listener) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60, buffer=10 * EVENT_BATCH)
    job = uuid.uuid4()
    for _ in range(2 * EVENT_BATCH + 4):
        log.add(job)
    log.add(job, EventType.SUCCEEDED)
    got: list[int] = []
    await asyncio.wait_for(collect(hub.watch(TENANT, job, 0), got), 5)
    assert got == list(range(1, 2 * EVENT_BATCH + 6))
    assert log.reads == 3


async def test_a_job_gone_while_watched_ends_its_watchers_with_not_found(
    log: Log, listener: Listener
) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    got: list[list[int]] = [[], []]
    tasks = [asyncio.create_task(collect(hub.watch(TENANT, job, 0), g)) for g in got]
    await settle()
    assert got == [[1], [1]]
    del log.events[job]  # deleted (retention) while two watchers wait
    notify(listener, job)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert [type(r) for r in results] == [JobNotFound, JobNotFound]
    assert all(str(r) == f"jobs/{job} not found" for r in results)
    assert hub.feed_count == 0


async def test_one_job_gone_does_not_hold_up_the_others_read_with_it(
    log: Log, listener: Listener
) -> None:
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    gone, *alive = [uuid.uuid4() for _ in range(3)]
    for job in (gone, *alive):
        log.add(job)
    lost = asyncio.create_task(collect(hub.watch(TENANT, gone, 0), []))
    got: list[list[int]] = [[], []]
    tasks = [
        asyncio.create_task(collect(hub.watch(TENANT, j, 0), g))
        for j, g in zip(alive, got, strict=True)
    ]
    await settle()
    del log.events[gone]
    for job in alive:
        log.add(job, EventType.SUCCEEDED)
    for job in (gone, *alive):  # one read for the three, the gone job first
        notify(listener, job)
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert got == [[1, 2], [1, 2]]
    (outcome,) = await asyncio.wait_for(asyncio.gather(lost, return_exceptions=True), 5)
    assert isinstance(outcome, JobNotFound)


class GatedLog(Log):
    """A log whose reads, once made, wait at a gate while it is closed (a slow read)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = 0

    async def read(
        self, wanted: Sequence[tuple[uuid.UUID, uuid.UUID, int]], limit: int
    ) -> list[StreamRead | None]:
        reads = await super().read(wanted, limit)
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1
        if self.fail is not None:
            raise self.fail
        return reads


async def test_a_notification_during_the_first_read_is_read_after_it(listener: Listener) -> None:
    log = GatedLog()
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    log.gate.clear()
    got: list[int] = []
    task = asyncio.create_task(collect(hub.watch(TENANT, job, 0), got))
    await settle()
    assert log.waiting == 1  # the first read is under way
    log.add(job, EventType.SUCCEEDED)
    notify(listener, job)  # its only notification, before the first read is in
    log.gate.set()  # the first read, made before that event, brings event 1 only
    await asyncio.wait_for(task, 5)
    assert got == [1, 2]


async def test_watchers_sharing_a_first_read_that_fails_all_get_its_error(
    listener: Listener,
) -> None:
    log = GatedLog()
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    log.gate.clear()
    tasks = [asyncio.create_task(collect(hub.watch(TENANT, job, 0), [])) for _ in range(3)]
    await settle()
    assert log.waiting == 1  # one read for the three
    log.fail = ConnectionResetError("database went away")
    log.gate.set()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
    assert [type(r) for r in results] == [ConnectionResetError] * 3
    assert hub.feed_count == 0
    log.fail = None
    log.add(job, EventType.SUCCEEDED)
    got: list[int] = []
    await asyncio.wait_for(collect(hub.watch(TENANT, job, 0), got), 5)
    assert got == [1, 2]


async def test_a_watcher_whose_shared_read_was_abandoned_reads_for_itself(
    listener: Listener,
) -> None:
    log = GatedLog()
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)
    log.add(job, EventType.SUCCEEDED)
    log.gate.clear()
    first = asyncio.create_task(collect(hub.watch(TENANT, job, 0), []))
    await settle()
    got: list[int] = []
    second = asyncio.create_task(collect(hub.watch(TENANT, job, 0), got))
    await settle()
    first.cancel()  # the watcher making the read leaves before it ends
    await asyncio.gather(first, return_exceptions=True)
    log.gate.set()
    await asyncio.wait_for(second, 5)
    assert got == [1, 2]


async def test_the_reader_does_not_log_with_the_first_watchers_bindings(
    log: Log, listener: Listener, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feeds, "log", structlog.get_logger("jobplane.server"))
    hub = FeedHub(log.read, listener, recheck_seconds=60)
    job = uuid.uuid4()
    log.add(job)

    async def watch_as_a_caller() -> None:
        # What the servicer binds for its call: one caller's identity.
        structlog.contextvars.bind_contextvars(api_key_id="key_first_caller")
        await collect(hub.watch(TENANT, job, 0), [])

    task = asyncio.create_task(watch_as_a_caller())
    await settle()
    assert {t.get_name() for t in hub._tasks} == {"watch-reader", "watch-recheck"}
    log.fail = ConnectionResetError("database went away")
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        notify(listener, job)
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
    (line,) = [entry for entry in logs if entry["event"] == "watch.read_failed"]
    assert "api_key_id" not in line
    await hub.stop()
