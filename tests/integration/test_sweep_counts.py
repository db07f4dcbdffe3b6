"""The sweeper's passes on the real database: what each settles and the counts it reports.

The tests claim and end attempts as a worker would (no broker), then leave
the rows as a crash could have left them, and check what a pass repairs and
how many jobs it says it decided.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import text

from jobplane.client import Job, JobState
from jobplane.store.attempts import AttemptStore, ClaimStatus
from jobplane.store.deadlines import DeadlineStore
from jobplane.store.sweeps import SweepStore
from jobplane.types import WaitingCode
from tests.support.stack import Stack

# As if a crash came between the counts and the transition they decide.
_COUNTED = text("UPDATE jobs SET deps_waiting = 0 WHERE id = :id")
# As if the mark were lost: the job's end does not know it has dependents.
_UNMARK = text("UPDATE jobs SET has_dependents = false WHERE id = :id")
_OUTCOMES = "SELECT count(*) FROM job_dependencies WHERE depends_on = :id AND outcome IS NOT NULL"


async def _succeed(stack: Stack, store: AttemptStore, job: Job) -> None:
    claim = await store.claim(await stack.envelope(job.id))
    assert claim.status is ClaimStatus.CLAIMED and claim.attempt is not None, (job.name, claim)
    await store.succeed(claim.attempt, {})


async def test_a_sweep_records_an_edge_whose_dependent_still_waits_and_decides_none(
    bare: Stack,
) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    a = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {})
    c = await client.submit("demo.echo", {}, after=[a, b])
    async with bare.engine.begin() as conn:
        await conn.execute(_UNMARK, {"id": a.id})
    await _succeed(bare, store, a)
    assert await bare.scalar(_OUTCOMES, id=a.id) == 0

    assert await SweepStore(bare.engine).settle_dependencies(limit=10) == 0
    assert await bare.scalar(_OUTCOMES, id=a.id) == 1
    # c still waits for b: the outcome recorded decided nothing.
    waiting = await client.get(c.name)
    assert waiting.state is JobState.QUEUED and waiting.waiting_code == WaitingCode.DEPENDENCIES
    assert b.name in waiting.waiting_reason


async def test_a_sweep_counts_the_jobs_it_decided_in_each_of_its_passes(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    a = await client.submit("demo.echo", {})
    b = await client.submit("demo.echo", {}, after=[a])
    x = await client.submit("demo.echo", {})
    c = await client.submit("demo.echo", {}, after=[x])
    # b's edge stays open; c's counts are written but not acted on.
    async with bare.engine.begin() as conn:
        await conn.execute(_UNMARK, {"id": a.id})
        await conn.execute(_COUNTED, {"id": c.id})
    await _succeed(bare, store, a)

    # One decided by the edge it records, one by the counts already written.
    assert await SweepStore(bare.engine).settle_dependencies(limit=10) == 2
    for job in (b, c):
        assert (await client.get(job.name)).waiting_code == "", job.name
    assert await SweepStore(bare.engine).settle_dependencies(limit=10) == 0


async def test_the_next_deadline_is_none_until_a_live_job_has_one(bare: Stack) -> None:
    deadlines = DeadlineStore(bare.engine)
    assert await deadlines.seconds_until_next() is None
    job = await bare.client().submit("demo.echo", {})
    assert await deadlines.seconds_until_next() is None
    soon = datetime.now(UTC) + timedelta(minutes=10)
    async with bare.engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET deadline = :at WHERE id = :id"), {"at": soon, "id": job.id}
        )
    seconds = await deadlines.seconds_until_next()
    assert seconds is not None and 500 < seconds <= 600
    past = datetime.now(UTC) - timedelta(minutes=1)
    async with bare.engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET deadline = :at WHERE id = :id"), {"at": past, "id": job.id}
        )
    # One already past reads 0, not a negative wait.
    assert await deadlines.seconds_until_next() == 0.0
