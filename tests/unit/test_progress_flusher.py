"""The worker's shared progress flusher, against a fake store (unit tests)."""

from __future__ import annotations

import asyncio
import gc
import uuid
import weakref
from collections.abc import Sequence

import pytest
from sqlalchemy.exc import DBAPIError

from jobplane.store.attempts import Attempt, AttemptStore, LeaseLost, ProgressUpdate
from jobplane.workers.progress import ProgressFlusher, ProgressRefused, ProgressWriter
from tests.support.attempts import an_attempt

Batch = tuple[Attempt, Sequence[ProgressUpdate]]


class FakeStore:
    """Records each many-job write; answers per attempt as told."""

    def __init__(self) -> None:
        self.writes: list[list[tuple[uuid.UUID, list[float]]]] = []
        self.fenced: set[uuid.UUID] = set()
        self.cancel: set[uuid.UUID] = set()
        self.fail: Exception | None = None
        self.gate: asyncio.Event | None = None
        self.refuse: set[uuid.UUID] = set()

    async def write_progress_many(self, batches: Sequence[Batch]) -> list[bool | None]:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        if any(a.job_id in self.refuse for a, _ in batches):
            raise db_error("22P05")  # untranslatable character: the same every time
        self.writes.append([(a.job_id, [u.progress for u in b]) for a, b in batches])
        return [None if a.job_id in self.fenced else a.job_id in self.cancel for a, _ in batches]


def attempt() -> Attempt:
    return an_attempt()


class DriverError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"driver error {sqlstate}")
        self.sqlstate = sqlstate


def db_error(sqlstate: str) -> DBAPIError:
    return DBAPIError("UPDATE jobs ...", {}, DriverError(sqlstate))


def update(progress: float) -> ProgressUpdate:
    return ProgressUpdate(progress=progress, message="", data={})


def flusher(store: FakeStore, window: float = 0.01) -> ProgressFlusher:
    return ProgressFlusher(store, window=window)  # type: ignore[arg-type]


async def test_reports_of_many_attempts_go_out_in_one_write() -> None:
    store = FakeStore()
    shared = flusher(store)
    writers = [ProgressWriter(shared, attempt()) for _ in range(3)]
    for step in (0.1, 0.2):
        for writer in writers:
            await writer.add(update(step))
    await asyncio.sleep(0.05)
    assert len(store.writes) == 1
    assert store.writes[0] == [(w.attempt.job_id, [0.1, 0.2]) for w in writers]
    assert [await w.drain() for w in writers] == [[], [], []]


async def test_a_fenced_attempt_gets_lease_lost_and_others_are_unaffected() -> None:
    store = FakeStore()
    shared = flusher(store)
    lost, kept = ProgressWriter(shared, attempt()), ProgressWriter(shared, attempt())
    store.fenced.add(lost.attempt.job_id)
    await lost.add(update(0.1))
    await kept.add(update(0.1))
    await asyncio.sleep(0.05)
    with pytest.raises(LeaseLost):
        await lost.add(update(0.2))
    await kept.add(update(0.2))
    await asyncio.sleep(0.05)
    assert store.writes[-1] == [(kept.attempt.job_id, [0.2])]


async def test_cancel_requested_calls_back_the_writer() -> None:
    store = FakeStore()
    called: list[bool] = []
    writer = ProgressWriter(
        flusher(store), attempt(), on_cancel_requested=lambda: called.append(True)
    )
    store.cancel.add(writer.attempt.job_id)
    await writer.add(update(0.5))
    await asyncio.sleep(0.05)
    assert called == [True]


async def test_a_failed_write_keeps_the_reports_in_order_for_the_outcome() -> None:
    store = FakeStore()
    store.fail = ConnectionResetError("gone")
    shared = flusher(store)
    writer = ProgressWriter(shared, attempt())
    await writer.add(update(0.1))
    await asyncio.sleep(0.05)
    await writer.add(update(0.2))
    pending = await writer.drain()
    assert [u.progress for u in pending] == [0.1, 0.2]
    await shared.stop()


async def test_drain_waits_for_a_write_in_flight() -> None:
    store = FakeStore()
    store.gate = asyncio.Event()
    shared = flusher(store, window=0.0)
    writer = ProgressWriter(shared, attempt())
    await writer.add(update(0.1))
    await asyncio.sleep(0.01)  # the flush has taken 0.1 and waits at the gate
    await writer.add(update(0.2))
    draining = asyncio.create_task(writer.drain())
    await asyncio.sleep(0.01)
    assert not draining.done()
    store.gate.set()
    pending = await asyncio.wait_for(draining, 1)
    assert store.writes[0] == [(writer.attempt.job_id, [0.1])]
    # 0.2 went out with a later flush that drain also waited for, or is handed over.
    written = [p for write in store.writes for _, batch in write for p in batch]
    assert written + [u.progress for u in pending] == [0.1, 0.2]


async def test_reports_the_database_refuses_fail_only_their_attempt() -> None:
    store = FakeStore()
    shared = flusher(store, window=60)  # flushed by hand below
    bad, good = ProgressWriter(shared, attempt()), ProgressWriter(shared, attempt())
    store.refuse.add(bad.attempt.job_id)
    await bad.add(update(0.1))
    await good.add(update(0.1))
    await shared.flush()
    # The batch of both was refused; written one by one, only the bad one is.
    assert store.writes == [[(good.attempt.job_id, [0.1])]]
    with pytest.raises(ProgressRefused, match="SQLSTATE 22P05"):
        await bad.add(update(0.2))
    await good.add(update(0.2))
    await shared.flush()
    assert store.writes[-1] == [(good.attempt.job_id, [0.2])]
    assert await bad.drain() == []
    await shared.stop()


async def test_a_database_that_is_down_keeps_every_report() -> None:
    store = FakeStore()
    store.fail = db_error("08006")  # connection failure: try again later
    shared = flusher(store, window=60)
    writer = ProgressWriter(shared, attempt())
    await writer.add(update(0.1))
    with pytest.raises(DBAPIError):
        await shared.flush()
    store.fail = None
    await writer.add(update(0.2))
    await shared.flush()
    assert store.writes == [[(writer.attempt.job_id, [0.1, 0.2])]]
    await shared.stop()


async def test_while_the_database_is_down_flushes_back_off() -> None:
    # A fixed 5 ms window would try (and log) 200 times a second for the
    # whole outage.
    store = FakeStore()
    store.fail = db_error("08006")
    tries: list[float] = []
    original = store.write_progress_many

    async def counting(batches: Sequence[Batch]) -> list[bool | None]:
        tries.append(asyncio.get_running_loop().time())
        return await original(batches)

    store.write_progress_many = counting  # type: ignore[method-assign]
    shared = flusher(store, window=0.005)
    writer = ProgressWriter(shared, attempt())
    await writer.add(update(0.1))
    await asyncio.sleep(0.5)
    # 5, 10, 20, 40, 80, 160 ms ... : about seven tries in half a second, not 100.
    assert 2 <= len(tries) <= 10, len(tries)
    store.fail = None
    for _ in range(100):
        if store.writes:
            break
        await asyncio.sleep(0.05)
    assert store.writes == [[(writer.attempt.job_id, [0.1])]]
    await shared.stop()


def test_the_fake_has_the_store_method() -> None:
    assert callable(AttemptStore.write_progress_many)


async def test_a_writer_at_its_high_water_mark_flushes_at_once_and_is_told_the_outcome() -> None:
    store = FakeStore()
    seen: list[float] = []
    shared = flusher(store, window=60)  # the window would never end within the test
    writer = ProgressWriter(shared, attempt(), high_water=3, on_progress=seen.append)
    await writer.add(update(0.1))
    await writer.add(update(0.2))
    assert store.writes == []
    await writer.add(update(0.3))
    assert store.writes == [[(writer.attempt.job_id, [0.1, 0.2, 0.3])]]
    assert seen == [0.1, 0.2, 0.3]
    # Fenced out at the flush the high-water mark made: the adding handler learns it.
    store.fenced.add(writer.attempt.job_id)
    await writer.add(update(0.4))
    await writer.add(update(0.5))
    with pytest.raises(LeaseLost):
        await writer.add(update(0.6))
    assert writer.take() == []  # nothing more goes out for it
    with pytest.raises(LeaseLost):
        await writer.add(update(0.7))
    assert seen == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    await shared.stop()


class SplitStore(FakeStore):
    """Refuses any group of more than one attempt for its values; then alone,
    ``alone`` answers each attempt's write in turn."""

    def __init__(self, alone: list[Exception | None]) -> None:
        super().__init__()
        self.alone = alone

    async def write_progress_many(self, batches: Sequence[Batch]) -> list[bool | None]:
        if len(batches) > 1:
            raise db_error("22P05")
        answer = self.alone.pop(0)
        if answer is not None:
            raise answer
        return await super().write_progress_many(batches)


@pytest.mark.parametrize(
    "failure", [db_error("08006"), asyncio.CancelledError()], ids=["database-down", "cancelled"]
)
async def test_a_failure_while_writing_one_by_one_keeps_the_rest_queued(
    failure: BaseException,
) -> None:
    store = SplitStore([None, failure])  # type: ignore[list-item]
    shared = flusher(store, window=60)
    writers = [ProgressWriter(shared, attempt()) for _ in range(3)]
    for n, writer in enumerate(writers):
        await writer.add(update(n / 10))
    with pytest.raises(type(failure)):
        await shared.flush()
    # The first was written alone; the one that failed and the one after keep theirs.
    assert store.writes == [[(writers[0].attempt.job_id, [0.0])]]
    assert writers[0].take() == []
    assert [u.progress for u in writers[1].take()] == [0.1]
    assert [u.progress for u in writers[2].take()] == [0.2]
    await shared.stop()


async def test_a_drained_writer_is_not_kept_by_the_flusher() -> None:
    # Its reports went to its outcome: the flusher holds on to nothing of an
    # attempt that ended, even while its window has not ended yet.
    store = FakeStore()
    shared = flusher(store, window=60)
    writer = ProgressWriter(shared, attempt())
    await writer.add(update(0.1))
    assert [u.progress for u in await writer.drain()] == [0.1]
    gone = weakref.ref(writer)
    del writer
    gc.collect()
    assert gone() is None
    await shared.flush()
    assert store.writes == []
    await shared.stop()
