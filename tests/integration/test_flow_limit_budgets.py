"""What a flow limit's budget counts, claim by claim, as a worker would claim: only
the jobs waiting for it, the RUNNING jobs that started under it (the first
matching entry's, not another's), and a pipeline stage's slot is freed by the
stage that held it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job
from jobplane.store.attempts import AttemptStore, ClaimStatus, HandBack
from jobplane.topology import RateLimitSpec, Topology
from tests.support.parts import Started
from tests.support.stack import Stack, start_stack


@pytest.fixture
def limits() -> tuple[RateLimitSpec, ...]:
    return (RateLimitSpec("solo", ("solo.op",), max_running=1),)


@pytest.fixture
async def limited(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    limits: tuple[RateLimitSpec, ...],
    started: Started,
) -> AsyncIterator[Stack]:
    """A server alone, under ``limits``: the test claims and writes as a worker would."""
    spec = replace(topology, rate_limits=limits)
    yield await started(
        start_stack(engine, database_url, amqp_url, spec, relay=False, worker=False)
    )


async def _claim(stack: Stack, store: AttemptStore, job: Job) -> ClaimStatus:
    return (await store.claim(await stack.envelope(job.id))).status


async def test_a_parked_job_does_not_hold_the_budget_it_waited_for(limited: Stack) -> None:
    client = limited.client()
    store = AttemptStore(limited.db, lease_seconds=30.0)
    first, second, third = [await client.submit("solo.op", {}) for _ in range(3)]
    running = await store.claim(await limited.envelope(first.id))
    assert running.status is ClaimStatus.CLAIMED and running.attempt is not None
    assert await _claim(limited, store, second) is ClaimStatus.HELD
    # Its slot is free: the held job is dispatched, and handed back with no
    # live worker for it: parked, no longer waiting for the limit.
    await store.succeed(running.attempt, {})
    gone, _ = await store.hand_back(
        await limited.envelope(second.id), base_delay=1.0, max_delay=1.0
    )
    assert gone is HandBack.PARKED
    assert await _claim(limited, store, third) is ClaimStatus.CLAIMED
