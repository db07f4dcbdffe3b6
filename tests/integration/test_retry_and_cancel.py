"""What the API's cancel and retry do to a job in each state, on real Postgres:
the state it is left in, the event that says why, and the error a refusal
carries (its message and field, exactly as a caller reads it)."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.envelope import Envelope
from jobplane.errors import InvalidArgument, JobAlreadyTerminal, JobNotFound, JobNotRetryable
from jobplane.store.attempts import Attempt, AttemptStore
from jobplane.store.db import Database
from jobplane.store.jobs import JobStore, NewJob
from jobplane.store.machine import NewStage
from jobplane.types import Job, JobState
from tests.support.rows import insert_tenant

_QUEUE = "default"


@pytest.fixture
async def tenant(engine: AsyncEngine) -> uuid.UUID:
    """A tenant of the test database."""
    return await insert_tenant(engine, "retry")


def _stages() -> tuple[NewStage, ...]:
    return (
        NewStage("fetch", "demo.fetch", _QUEUE, "v1", 3, 60.0, base=0.0, span=0.25),
        NewStage("each", "demo.each", _QUEUE, "v1", 3, 60.0, 0.25, 0.5, fan_out=True),
        NewStage("sum", "demo.sum", _QUEUE, "v1", 3, 60.0, base=0.75, span=0.25),
    )


async def _submit(store: JobStore, tenant: uuid.UUID, *, pipeline: bool = False) -> uuid.UUID:
    job, _ = await store.submit(
        tenant,
        NewJob(
            type="demo.pipe" if pipeline else "demo.echo",
            queue=_QUEUE,
            payload={},
            request_id=uuid.uuid4().hex,
            max_attempts=3,
            stages=_stages() if pipeline else (),
        ),
    )
    return uuid.UUID(job.id)


async def _claim(engine: AsyncEngine, db: Database, job_id: uuid.UUID) -> Attempt:
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                text("SELECT dispatch_id, tenant_id, type FROM jobs WHERE id = :id"),
                {"id": job_id},
            )
        ).one()
    envelope = Envelope(row.dispatch_id, job_id, row.tenant_id, row.type)
    claimed = await AttemptStore(db).claim(envelope)
    assert claimed.attempt is not None, claimed
    return claimed.attempt


async def _last_event(store: JobStore, tenant: uuid.UUID, job_id: uuid.UUID) -> tuple[str, str]:
    events = await store.milestones(tenant, job_id, 100)
    return events[-1].type.value, events[-1].message


async def test_a_queued_job_is_cancelled_at_once_with_the_reason_given_or_the_default(
    engine: AsyncEngine, db: Database, tenant: uuid.UUID
) -> None:
    store = JobStore(engine, db)
    told, untold = await _submit(store, tenant), await _submit(store, tenant)
    cancelled = await store.cancel(tenant, told, "no longer needed")
    assert cancelled.state is JobState.CANCELLED
    assert await _last_event(store, tenant, told) == ("cancelled", "no longer needed")
    assert (await store.cancel(tenant, untold, "")).state is JobState.CANCELLED
    assert await _last_event(store, tenant, untold) == ("cancelled", "cancelled by request")
    with pytest.raises(JobAlreadyTerminal) as refused:
        await store.cancel(tenant, told, "again")
    assert refused.value.message == f"jobs/{told} is already CANCELLED"
    with pytest.raises(JobNotFound) as missing:
        await store.cancel(uuid.uuid4(), told, "not yours")
    assert missing.value.message == f"jobs/{told} not found"
    # Its stream is not another tenant's to read either, and says which job.
    with pytest.raises(JobNotFound) as unread:
        await store.read_stream(uuid.uuid4(), told, 0, 10)
    assert unread.value.message == f"jobs/{told} not found"


async def test_a_running_job_is_asked_to_cancel_once(
    engine: AsyncEngine, db: Database, tenant: uuid.UUID
) -> None:
    store = JobStore(engine, db)
    job_id = await _submit(store, tenant)
    await _claim(engine, db, job_id)
    asked = await store.cancel(tenant, job_id, "stop")
    assert (asked.state, asked.cancel_requested) == (JobState.RUNNING, True)
    assert await _last_event(store, tenant, job_id) == ("cancel_requested", "stop")
    again = await store.cancel(tenant, job_id, "stop again")
    assert (again.state, again.cancel_requested) == (JobState.RUNNING, True)
    assert await _last_event(store, tenant, job_id) == ("cancel_requested", "stop")


async def test_only_a_failed_or_cancelled_job_is_retried(
    engine: AsyncEngine, db: Database, tenant: uuid.UUID
) -> None:
    store = JobStore(engine, db)
    job_id = await _submit(store, tenant)
    with pytest.raises(JobNotRetryable) as queued:
        await store.retry(tenant, job_id)
    assert queued.value.message == (
        f"jobs/{job_id} is QUEUED; only FAILED or CANCELLED jobs can be retried"
    )
    with pytest.raises(JobNotFound) as missing:
        await store.retry(uuid.uuid4(), job_id)
    assert missing.value.message == f"jobs/{job_id} not found"
    attempt = await _claim(engine, db, job_id)
    await AttemptStore(db).fail(attempt, "BROKE", "it broke", retryable=False)
    before = await store.get(tenant, job_id)
    retried = await store.retry(tenant, job_id)
    assert retried.state is JobState.QUEUED and retried.error is None
    assert await _last_event(store, tenant, job_id) == ("queued", "retry requested")
    again = await _claim(engine, db, job_id)
    assert again.attempt == before.attempt + 1


async def test_a_job_that_still_runs_after_others_is_not_retried(
    engine: AsyncEngine, db: Database, tenant: uuid.UUID
) -> None:
    store = JobStore(engine, db)
    job_id = await _submit(store, tenant)
    await store.cancel(tenant, job_id, "")
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE jobs SET deps_waiting = 2 WHERE id = :id"), {"id": job_id})
    with pytest.raises(JobNotRetryable) as refused:
        await store.retry(tenant, job_id)
    assert refused.value.message == (
        f"jobs/{job_id} runs after 2 job(s) that have not ended; retry it once they have"
    )
    assert (await store.get(tenant, job_id)).state is JobState.CANCELLED


async def test_a_restart_names_a_stage_of_the_pipeline_that_does_not_fan_out(
    engine: AsyncEngine, db: Database, tenant: uuid.UUID
) -> None:
    store = JobStore(engine, db)
    plain, pipe = await _submit(store, tenant), await _submit(store, tenant, pipeline=True)
    for job_id in (plain, pipe):
        await store.cancel(tenant, job_id, "")
    refusals = {
        (plain, "fetch"): f"jobs/{plain} is not a pipeline job; no stage named 'fetch'",
        (pipe, "nope"): f"jobs/{pipe} has no stage named 'nope'",
        (pipe, "each"): (
            f"stage 'each' of jobs/{pipe} fans out: restart from the stage before it (it "
            "spawns the children again), or retry without from_stage (only the children "
            "that did not succeed run again)"
        ),
    }
    for (job_id, stage), message in refusals.items():
        with pytest.raises(InvalidArgument) as refused:
            await store.retry(tenant, job_id, from_stage=stage)
        assert (refused.value.message, refused.value.field) == (message, "from_stage")
    restarted: Job = await store.retry(tenant, pipe, from_stage="sum")
    assert (restarted.state, restarted.stage) == (JobState.QUEUED, "sum")
    assert await _last_event(store, tenant, pipe) == ("queued", "restart requested from stage sum")
