"""What the sweeper's lease expiry does to a job whose worker stopped heartbeating:
the lease it hands to the decision, and the job and event the decision writes
(docs/guarantees.md)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import text

from jobplane.attempt_end import Decision, Fail, Retry
from jobplane.client import Job, JobState
from jobplane.store.attempts import AttemptStore
from jobplane.store.sweeps import ExpiredLease, LeaseRepair, SweepStore
from tests.support.stack import Stack


async def _claim(stack: Stack, store: AttemptStore, job: Job) -> Any:
    return (await store.claim(await stack.envelope(job.id))).attempt


async def _lease_ran_out(stack: Stack, job: Job, ago: str) -> None:
    async with stack.engine.begin() as conn:
        await conn.execute(
            text(f"UPDATE jobs SET lease_expires_at = now() - interval '{ago}' WHERE id = :id"),
            {"id": job.id},
        )


async def _newest_event(stack: Stack, job: Job) -> tuple[str, Any]:
    async with stack.engine.connect() as conn:
        found = await conn.execute(
            text(
                "SELECT message, data FROM job_events WHERE job_id = :id ORDER BY seq DESC LIMIT 1"
            ),
            {"id": job.id},
        )
        message, data = found.one()
        return str(message), data


async def test_an_expired_lease_is_decided_oldest_first_and_written_as_decided(
    bare: Stack,
) -> None:
    """Past the grace, each expired lease (oldest first, ``limit`` a pass) goes to the
    decision with its job's attempt, its budget's attempt (since an operator's
    retry) and max_attempts; a retry queues the job again after the delay, a
    failure ends it, each with the decision's message and error in its event."""
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    retried = await client.submit("demo.echo", {}, max_attempts=3)
    await store.fail(await _claim(bare, store, retried), "BROKEN", "broken", retryable=False)
    await client.retry(retried)  # its budget starts again: this is its first attempt of three
    await _claim(bare, store, retried)
    ended = await client.submit("demo.echo", {}, max_attempts=1)
    await _claim(bare, store, ended)
    within_grace = await client.submit("demo.echo", {})
    await _claim(bare, store, within_grace)
    await _lease_ran_out(bare, retried, "1 hour")
    await _lease_ran_out(bare, ended, "2 hours")
    await _lease_ran_out(bare, within_grace, "5 seconds")

    seen: list[ExpiredLease] = []

    def decide(lease: ExpiredLease) -> Decision:
        seen.append(lease)
        if lease.job_id == uuid.UUID(retried.id):
            return Retry("LEASE_EXPIRED", "its worker died", 30.0, details={"worker": "w-1"})
        return Fail("LEASE_EXPIRED", "its worker died, last", details={"attempts_exhausted": True})

    sweeps = SweepStore(bare.engine)
    assert await sweeps.expire_leases(grace=60, limit=1, decide=decide) == LeaseRepair(failed=1)
    before = datetime.now(UTC)
    assert await sweeps.expire_leases(grace=60, limit=10, decide=decide) == LeaseRepair(requeued=1)
    after = datetime.now(UTC)
    queue = str(await bare.scalar("SELECT queue FROM jobs WHERE id = :id", id=retried.id))
    assert seen == [
        ExpiredLease(uuid.UUID(ended.id), attempt=1, budget_attempt=1, max_attempts=1, queue=queue),
        ExpiredLease(
            uuid.UUID(retried.id), attempt=2, budget_attempt=1, max_attempts=3, queue=queue
        ),
    ]

    again = await client.get(retried.name)
    assert (again.state, again.attempt) == (JobState.QUEUED, 2)
    assert again.next_attempt_time is not None
    assert before + timedelta(seconds=30) <= again.next_attempt_time
    assert again.next_attempt_time <= after + timedelta(seconds=30)
    assert await _newest_event(bare, retried) == (
        "its worker died",
        {"error": {"worker": "w-1", "code": "LEASE_EXPIRED", "retryable": True}},
    )

    failed = await client.get(ended.name)
    assert failed.state is JobState.FAILED and failed.error is not None
    assert (failed.error.code, failed.error.message, failed.error.retryable) == (
        "LEASE_EXPIRED",
        "its worker died, last",
        False,
    )
    assert await _newest_event(bare, ended) == (
        "its worker died, last",
        {"error": {"attempts_exhausted": True, "code": "LEASE_EXPIRED", "retryable": False}},
    )
    assert (await client.get(within_grace.name)).state is JobState.RUNNING


async def test_a_decision_the_state_machine_refuses_is_not_counted(bare: Stack) -> None:
    """A decision that does not fit the job (a failure while attempts are left, a
    retry when none is) changes nothing: the job stays RUNNING, and the pass
    reports what it changed, not what it was told."""
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    left = await client.submit("demo.echo", {}, max_attempts=3)
    await _claim(bare, store, left)
    last = await client.submit("demo.echo", {}, max_attempts=1)
    await _claim(bare, store, last)
    await _lease_ran_out(bare, left, "1 hour")
    await _lease_ran_out(bare, last, "2 hours")

    def backwards(lease: ExpiredLease) -> Decision:
        if lease.max_attempts == 1:
            return Retry("LEASE_EXPIRED", "its worker died", 0.0)
        return Fail("LEASE_EXPIRED", "its worker died, last")

    sweeps = SweepStore(bare.engine)
    assert await sweeps.expire_leases(grace=60, limit=10, decide=backwards) == LeaseRepair()
    for job in (left, last):
        assert (await client.get(job.name)).state is JobState.RUNNING
