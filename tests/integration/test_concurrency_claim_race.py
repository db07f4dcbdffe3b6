"""A concurrency key's claims racing its ends and holds: no job dropped, no key
left with jobs held and nothing to release them (ADR-0040)."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job
from jobplane.envelope import Envelope
from jobplane.store.attempts import AttemptStore, ClaimResult, ClaimStatus
from jobplane.topology import Topology
from jobplane.types import JobState
from tests.support.parts import Started
from tests.support.stack import Stack, one_running_per_tenant, start_stack

_DUE = text(
    "SELECT id, dispatch_id, type FROM jobs WHERE state = 'queued' AND dispatch_id IS NOT NULL"
)


async def _claim(stack: Stack, store: AttemptStore, job: Job) -> ClaimResult:
    return await store.claim(await stack.envelope(job.id))


async def _dispatched(stack: Stack, job: Job) -> bool:
    found = await stack.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=job.id)
    return found is not None


@pytest.mark.parametrize("limit", ["concurrency key", "queue budget"])
async def test_a_job_made_due_then_held_for_an_older_one_hands_its_slot_on(
    limit: str,
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
) -> None:
    options: dict[str, Any] = {}
    if limit == "queue budget":
        stack = await one_running_per_tenant(engine, database_url, amqp_url, topology, started)
        job_type = "cross.op"
    else:
        stack = await started(
            start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
        )
        job_type, options = "demo.echo", {"concurrency_key": "k"}
    # Oldest first: first, older, due, last. One may run at once.
    client = stack.client()
    store = AttemptStore(stack.db, lease_seconds=30.0)
    first, older, due, last = [await client.submit(job_type, {"i": i}, **options) for i in range(4)]
    running = await _claim(stack, store, last)
    assert (await _claim(stack, store, due)).status is ClaimStatus.HELD
    assert running.attempt is not None
    await store.succeed(running.attempt, {})
    # `due` is made due; `first`, which never waited, is older and starts first.
    assert await _dispatched(stack, due)
    running = await _claim(stack, store, first)
    assert running.status is ClaimStatus.CLAIMED and running.attempt is not None
    # `older` is held; when `first` ends, its slot is `due`'s, promised already.
    assert (await _claim(stack, store, older)).status is ClaimStatus.HELD
    await store.succeed(running.attempt, {})
    assert not await _dispatched(stack, older)
    # `due` is refused for `older`, which waits ahead of it, and is held: the
    # slot it was promised goes to `older` rather than to nobody.
    assert (await _claim(stack, store, due)).status is ClaimStatus.HELD
    assert await _dispatched(stack, older)
    assert (await _claim(stack, store, older)).status is ClaimStatus.CLAIMED
    assert not await _dispatched(stack, due)


async def test_a_job_made_due_for_a_budget_then_held_for_its_key_frees_the_budget(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    """A queue budget of one on `cross.*`; a key of one shared with `other.*`."""
    budget = replace(
        topology.queues[0], bindings=("cross.#",), max_running_per_tenant=1, log_prefix="c"
    )
    other = replace(topology.queues[0], name=f"{topology.queues[0].name}.other")
    other = replace(other, bindings=("other.#",))
    spec = replace(topology, queues=(budget, other))
    stack = await started(
        start_stack(engine, database_url, amqp_url, spec, relay=False, worker=False)
    )
    client = stack.client()
    store = AttemptStore(stack.db, lease_seconds=30.0)
    running = await client.submit("cross.op", {})
    keyed = await client.submit("cross.op", {}, concurrency_key="k")
    plain = await client.submit("cross.op", {})
    elsewhere = await client.submit("other.op", {}, concurrency_key="k")
    first = await _claim(stack, store, running)
    assert first.attempt is not None
    # Both wait for the budget; its end makes the older, `keyed`, due.
    assert (await _claim(stack, store, keyed)).status is ClaimStatus.HELD
    assert (await _claim(stack, store, plain)).status is ClaimStatus.HELD
    await store.succeed(first.attempt, {})
    assert await _dispatched(stack, keyed) and not await _dispatched(stack, plain)
    # The key is taken on the other queue: `keyed` is held for it, and the
    # budget's slot it was promised goes to `plain`.
    assert (await _claim(stack, store, elsewhere)).status is ClaimStatus.CLAIMED
    assert (await _claim(stack, store, keyed)).status is ClaimStatus.HELD
    assert await _dispatched(stack, plain)
    assert (await _claim(stack, store, plain)).status is ClaimStatus.CLAIMED


async def test_claims_racing_a_keys_ends_are_held_or_claimed_never_dropped(bare: Stack) -> None:
    """Eight claimers at the deliveries of a limit-one key, each job retried three
    times (a new delivery racing the key's held ones), ends as quick as can be."""
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    jobs = [
        await client.submit(
            "demo.echo", {"i": i}, concurrency_key="k", concurrency_limit=1, max_attempts=10
        )
        for i in range(40)
    ]
    deliveries: asyncio.Queue[Envelope] = asyncio.Queue()
    delivered: set[uuid.UUID] = set()
    seen: Counter[ClaimStatus] = Counter()
    dropped: list[uuid.UUID] = []

    async def relay() -> None:
        while True:
            async with bare.engine.connect() as conn:
                for job_id, dispatch_id, job_type in await conn.execute(_DUE):
                    if dispatch_id not in delivered:
                        delivered.add(dispatch_id)
                        envelope = Envelope(dispatch_id, job_id, bare.tenant_id, job_type)
                        deliveries.put_nowait(envelope)
            await asyncio.sleep(0.002)

    async def claimer() -> None:
        while True:
            envelope = await deliveries.get()
            claim = await store.claim(envelope)
            seen[claim.status] += 1
            if claim.attempt is not None and claim.attempt.attempt < 4:
                await store.schedule_retry(claim.attempt, "AGAIN", "again", delay=0)
            elif claim.attempt is not None:
                await store.succeed(claim.attempt, {})
            elif claim.status is ClaimStatus.IN_FLIGHT and claim.state is JobState.QUEUED:
                # A worker acks this delivery: the job's only one.
                dropped.append(envelope.job_id)

    tasks = [asyncio.create_task(relay())] + [asyncio.create_task(claimer()) for _ in range(8)]
    ids = [job.id for job in jobs]
    try:
        # Up to a minute: 160 claims and ends through one slot, on a busy machine.
        for _ in range(1200):
            succeeded = await bare.scalar(
                "SELECT count(*) FROM jobs WHERE state = 'succeeded' AND id = ANY(:ids)", ids=ids
            )
            if succeeded == len(jobs) or dropped:
                break
            await asyncio.sleep(0.05)
    finally:
        for task in tasks:
            task.cancel()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
    # Every claimer was still at work: none died of an error (a deadlock included).
    assert [e for e in ended if not isinstance(e, asyncio.CancelledError)] == []
    assert not dropped, seen
    assert succeeded == len(jobs), seen
    assert seen[ClaimStatus.HELD] > 0 and seen[ClaimStatus.CLAIMED] == 4 * len(jobs)
