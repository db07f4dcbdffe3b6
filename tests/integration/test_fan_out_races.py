"""Fan-out's locks under concurrent ends, on the real database (ADR-0047).

A child's end locks the child, then settles its job (the job's lock); fail
fast, CancelJob and RetryJob of the job lock the job, then its children. The
tests hold a child's end between its two statements, or fail children at
once, and check that nothing deadlocks, or that what does is run again: no
caller sees it, the job is decided once and every child ends or is asked to.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from sqlalchemy import text

from jobplane.client import EventType, JobState
from jobplane.store.machine.core import MACHINE
from jobplane.store.machine.dependencies import settle
from jobplane.store.sweeps import SweepStore
from tests.integration.test_fan_out import (  # noqa: F401
    _children,
    _claim,
    _end,
    _split,
    _store,
    fans,
    fbare,
)
from tests.support.stack import Stack, eventually

pytestmark = pytest.mark.integration

_HOLD = text("SELECT 1 FROM jobs WHERE id = :id FOR NO KEY UPDATE")


async def _lock_waits(stack: Stack) -> bool:
    waiting = await stack.scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND datname = current_database()"
    )
    return bool(waiting)


async def test_fail_fast_does_not_wait_for_a_sibling_in_the_middle_of_its_end(
    fbare: Stack,  # noqa: F811
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.strict", 3)
    a, b, c = await _children(fbare, job)
    att_a = await _claim(fbare, store, a.id)
    att_b = await _claim(fbare, store, b.id)
    out_b = store.failed(att_b, "BROKEN", "b broke", retryable=False)
    async with fbare.engine.connect() as conn:
        transaction = await conn.begin()
        # B's end, its first statement: B's own row, locked to the commit.
        assert await MACHINE.apply(conn, out_b.transition, out_b.params, out_b.cause, settles=False)
        # A fails meanwhile: fail fast decides and cancels the siblings it
        # can lock, without waiting for B's (B would wait for the job's lock).
        await asyncio.wait_for(_end(store, att_a, False, i=0), timeout=20)
        # B's settle, its second statement: the job is decided already.
        await settle(MACHINE, conn, [uuid.UUID(b.id)])
        await transaction.commit()
    failed = await client.get(job.name)
    assert failed.state is JobState.FAILED and failed.error is not None
    assert failed.error.code == "CHILDREN_FAILED"
    states = [(await client.get(k.name)).state for k in (a, b, c)]
    assert states == [JobState.FAILED, JobState.FAILED, JobState.CANCELLED]
    open_edges = "SELECT count(*) FROM job_dependencies WHERE job_id = :id AND outcome IS NULL"
    assert await fbare.scalar(open_edges, id=job.id) == 0


async def test_children_failing_at_once_under_fail_fast_fail_the_job_once(
    fbare: Stack,  # noqa: F811
) -> None:
    store = _store(fbare)
    client = fbare.client()
    for _ in range(4):
        job = await _split(fbare, store, "docs.strict", 5)
        kids = await _children(fbare, job)
        # Four fail together; the fifth runs on and is asked to cancel.
        attempts = [await _claim(fbare, store, k.id) for k in kids]
        ends = [_end(store, at, False, i=n) for n, at in enumerate(attempts[:4])]
        results = await asyncio.wait_for(asyncio.gather(*ends, return_exceptions=True), 60)
        assert [r for r in results if isinstance(r, BaseException)] == []
        failed = await client.get(job.name)
        assert failed.state is JobState.FAILED
        ends_of_job = "SELECT count(*) FROM job_events WHERE job_id = :id AND type = :type"
        assert await fbare.scalar(ends_of_job, id=job.id, type=EventType.FAILED.value) == 1
        for kid in kids[:4]:
            assert (await client.get(kid.name)).state is JobState.FAILED
        last = await client.get(kids[4].name)
        if not last.cancel_requested:
            # Its lock was held when the job failed (a claim, a report): the sweeper's.
            assert await SweepStore(fbare.engine).settle_dependencies(limit=10) >= 1
        assert (await client.get(kids[4].name)).cancel_requested
        await store.cancelled(attempts[4])
        assert (await client.get(kids[4].name)).state is JobState.CANCELLED


async def test_a_sibling_held_when_fail_fast_decides_is_cancelled_by_the_sweeper(
    fbare: Stack,  # noqa: F811
) -> None:
    store = _store(fbare)
    client = fbare.client()
    sweeps = SweepStore(fbare.engine)
    job = await _split(fbare, store, "docs.strict", 3)
    a, b, c = await _children(fbare, job)
    att_a = await _claim(fbare, store, a.id)
    att_b = await _claim(fbare, store, b.id)
    async with fbare.engine.connect() as holder:
        transaction = await holder.begin()
        # As B's progress report or heartbeat would, B's row is held.
        await holder.execute(_HOLD, {"id": b.id})
        await asyncio.wait_for(_end(store, att_a, False, i=0), timeout=20)
        await transaction.commit()
    assert (await client.get(job.name)).state is JobState.FAILED
    assert (await client.get(c.name)).state is JobState.CANCELLED
    skipped = await client.get(b.name)
    assert skipped.state is JobState.RUNNING and not skipped.cancel_requested
    # The job's own row held meanwhile: the pass skips it and counts nothing.
    async with fbare.engine.connect() as holder:
        transaction = await holder.begin()
        await holder.execute(_HOLD, {"id": job.id})
        assert await sweeps.settle_dependencies(limit=10) == 0
        await transaction.rollback()
    assert not (await client.get(b.name)).cancel_requested
    assert await sweeps.settle_dependencies(limit=10) == 1
    assert (await client.get(b.name)).cancel_requested
    assert await sweeps.settle_dependencies(limit=10) == 0
    await store.cancelled(att_b)
    assert (await client.get(b.name)).state is JobState.CANCELLED


async def test_the_sweeper_leaves_the_children_of_a_job_retried_since_be(
    fbare: Stack,  # noqa: F811
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.strict", 2)
    a, b = await _children(fbare, job)
    att_a = await _claim(fbare, store, a.id)
    await _claim(fbare, store, b.id)
    async with fbare.engine.connect() as holder:
        transaction = await holder.begin()
        await holder.execute(_HOLD, {"id": b.id})
        await asyncio.wait_for(_end(store, att_a, False, i=0), timeout=20)
        await transaction.commit()
    # Retried before the sweeper's pass: the job waits for B again.
    retried = await client.retry(job.name)
    assert retried.state is JobState.QUEUED and retried.stage == "embed"
    assert await SweepStore(fbare.engine).settle_dependencies(limit=10) == 0
    running = await client.get(b.name)
    assert running.state is JobState.RUNNING and not running.cancel_requested


async def test_cancel_of_the_job_while_a_child_ends_answers_ok(
    fbare: Stack,  # noqa: F811
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.ingest", 2)
    a, b = await _children(fbare, job)
    out_a = store.failed(await _claim(fbare, store, a.id), "BROKEN", "a broke", retryable=False)
    async with fbare.engine.connect() as conn:
        transaction = await conn.begin()
        # A's end, its first statement: A's row locked to the commit.
        assert await MACHINE.apply(conn, out_a.transition, out_a.params, out_a.cause, settles=False)
        # CancelJob locks the job, then waits for A's lock ...
        cancel = asyncio.create_task(client.cancel(job.name, reason="stop"))
        await eventually(lambda: _lock_waits(fbare))
        # ... while A's settle waits for the job's: one of the two is rolled back.
        await settle(MACHINE, conn, [uuid.UUID(a.id)])
        await transaction.commit()
    cancelled = await asyncio.wait_for(cancel, timeout=30)
    assert cancelled.state is JobState.CANCELLED
    assert (await client.get(a.name)).state is JobState.FAILED
    assert (await client.get(b.name)).state is JobState.CANCELLED


async def test_retry_of_the_job_while_a_child_ends_answers_ok(
    fbare: Stack,  # noqa: F811
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.strict", 2)
    a, b = await _children(fbare, job)
    att_a = await _claim(fbare, store, a.id)
    att_b = await _claim(fbare, store, b.id)
    async with fbare.engine.connect() as holder:
        transaction = await holder.begin()
        await holder.execute(_HOLD, {"id": b.id})
        await asyncio.wait_for(_end(store, att_a, False, i=0), timeout=20)
        await transaction.commit()
    # B runs on, not asked to cancel: RetryJob of the job waits for it too.
    assert (await client.get(job.name)).state is JobState.FAILED
    out_b = store.failed(att_b, "BROKEN", "b broke", retryable=False)
    async with fbare.engine.connect() as conn:
        transaction = await conn.begin()
        assert await MACHINE.apply(conn, out_b.transition, out_b.params, out_b.cause, settles=False)
        # RetryJob locks the job, then waits for B's lock ...
        retry = asyncio.create_task(client.retry(job.name))
        await eventually(lambda: _lock_waits(fbare))
        # ... while B's settle waits for the job's: one of the two is rolled back.
        await settle(MACHINE, conn, [uuid.UUID(b.id)])
        await transaction.commit()
    retried = await asyncio.wait_for(retry, timeout=30)
    assert retried.state is JobState.QUEUED and retried.stage == "embed"
    # Both failed children run again; the job waits for them.
    assert [(await client.get(k.name)).state for k in (a, b)] == [JobState.QUEUED] * 2
    assert retried.fan_out is not None
    assert (retried.fan_out.children, retried.fan_out.ended) == (2, 0)
