"""Fan-out and join on the real database (ADR-0047).

The tests claim and end attempts as a worker would (no broker), so what they
see is the machine's rule alone: a stage before a fan-out stage spawns one
child per item in its success's transaction, each child's end settles the
job, and the last one dispatches the join stage with the results in order.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job, JobState, StageState
from jobplane.store.attempts import Attempt, AttemptStore, ClaimStatus, LeaseLost
from jobplane.topology import Topology
from jobplane.types import WaitingCode
from tests.support import services
from tests.support.fan_out import fan_topology
from tests.support.stack import Stack, start_stack

pytestmark = pytest.mark.integration

_EXPIRE = text("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = :id")


@pytest.fixture
async def fans(amqp_url: str) -> AsyncIterator[Topology]:
    names = fan_topology(f"f{uuid.uuid4().hex[:6]}.")
    yield names
    await services.delete_topology(amqp_url, names)


@pytest.fixture
async def fbare(
    engine: AsyncEngine, database_url: str, amqp_url: str, fans: Topology
) -> AsyncIterator[Stack]:
    """A server alone on the fan-out topology: the test claims as a worker would."""
    stack = await start_stack(engine, database_url, amqp_url, fans, relay=False, worker=False)
    yield stack
    await stack.close()


def _store(stack: Stack) -> AttemptStore:
    return AttemptStore(stack.db, lease_seconds=30.0)


async def _claim(stack: Stack, store: AttemptStore, job_id: str) -> Attempt:
    claim = await store.claim(await stack.envelope(job_id))
    assert claim.status is ClaimStatus.CLAIMED and claim.attempt is not None, claim
    return claim.attempt


async def _children(stack: Stack, job: Job) -> list[Job]:
    client = stack.client()
    page = await client.list(parent=job.name, page_size=100)
    return sorted(page.jobs, key=lambda j: j.payload.get("i", 0))


async def _split(stack: Stack, store: AttemptStore, pipeline: str, n: int) -> Job:
    client = stack.client()
    job = await client.submit(pipeline, {"doc": "d"})
    attempt = await _claim(stack, store, job.id)
    assert attempt.stage is not None and attempt.stage.fans_out
    await store.succeed(attempt, [{"i": i} for i in range(n)])  # type: ignore[arg-type]
    return await client.get(job.name)


async def _end(store: AttemptStore, attempt: Attempt, ok: bool, **result: Any) -> None:
    if ok:
        await store.succeed(attempt, result)
    else:
        await store.fail(attempt, "BROKEN", f"item {result} broke", retryable=False)


async def test_a_fan_out_spawns_children_and_the_join_gets_their_results_in_order(
    fbare: Stack,
) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await _split(fbare, store, "docs.ingest", 4)
    assert job.state is JobState.QUEUED and job.stage == "embed"
    assert job.waiting_code == WaitingCode.DEPENDENCIES
    assert "4 children" in job.waiting_reason
    assert [s.state for s in job.stages] == [
        StageState.SUCCEEDED,
        StageState.RUNNING,
        StageState.PENDING,
    ]
    children = await _children(fbare, job)
    assert [c.payload for c in children] == [{"i": i} for i in range(4)]
    assert all(c.parent == job.name and c.state is JobState.QUEUED for c in children)
    # Finished out of order: the join sees item order.
    progress = [job.progress]
    for child in reversed(children):
        attempt = await _claim(fbare, store, child.id)
        await _end(store, attempt, True, doubled=child.payload["i"] * 2)
        progress.append((await client.get(job.name)).progress)
    assert progress == sorted(progress) and progress[-1] > progress[0]
    joined = await client.get(job.name)
    assert joined.state is JobState.QUEUED and joined.stage == "index", joined
    attempt = await _claim(fbare, store, job.id)
    assert attempt.stage is not None and attempt.stage.results is not None
    results = attempt.stage.results
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert [r.result for r in results] == [{"doubled": i * 2} for i in range(4)]
    assert all(r.ok and r.error is None for r in results)
    assert [r.job for r in results] == [c.name for c in children]
    await store.succeed(attempt, {"indexed": len(results)})
    done = await client.get(job.name)
    assert done.state is JobState.SUCCEEDED and done.result == {"indexed": 4}
    assert [s.state for s in done.stages] == [StageState.SUCCEEDED] * 3


async def test_a_stale_attempt_spawns_nothing(fbare: Stack) -> None:
    store = _store(fbare)
    client = fbare.client()
    job = await client.submit("docs.ingest", {"doc": "d"})
    stale = await _claim(fbare, store, job.id)
    # Its lease runs out and a redelivery starts attempt 2: attempt 1 is fenced out.
    async with fbare.engine.begin() as conn:
        await conn.execute(_EXPIRE, {"id": job.id})
    fresh = await _claim(fbare, store, job.id)
    assert fresh.attempt == stale.attempt + 1
    with pytest.raises(LeaseLost):
        await store.succeed(stale, [{"i": 1}])  # type: ignore[arg-type]
    count = "SELECT count(*) FROM jobs WHERE parent_id = :id"
    assert await fbare.scalar(count, id=job.id) == 0
    await store.succeed(fresh, [{"i": 1}, {"i": 2}])  # type: ignore[arg-type]
    assert await fbare.scalar(count, id=job.id) == 2
    assert (await client.get(job.name)).stage == "embed"
