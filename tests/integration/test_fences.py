"""Fenced outcomes and dispatch ids, on the real database.

Every write of an attempt matches its (job, attempt, lease token) while the
job runs; a stale attempt's write changes nothing and raises LeaseLost. A
claim matches the job's current dispatch: an old duplicate message must not
start a retry that is due later.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job, JobState
from jobplane.store.attempts import Attempt, AttemptStore, ClaimStatus, LeaseLost, ProgressUpdate
from jobplane.topology import Topology
from jobplane.workers.handlers import JobContext, Registry, RetryableError
from tests.support.parts import Started
from tests.support.queues import publish_raw
from tests.support.stack import Stack, eventually, start_stack


def _writes(store: AttemptStore, attempt: Attempt) -> dict[str, Callable[[], Awaitable[Any]]]:
    """Every write an attempt can make, each of which the fence must refuse."""
    update = ProgressUpdate(0.5, "stale", {"stale": True})
    return {
        "progress": lambda: store.write_progress(attempt, [update]),
        "heartbeat": lambda: store.heartbeat(attempt),
        "succeed": lambda: store.succeed(attempt, {"stale": True}),
        "succeed+progress": lambda: store.succeed(attempt, {"stale": True}, [update]),
        "fail": lambda: store.fail(attempt, "STALE", "stale", retryable=False),
        "fail+progress": lambda: store.fail(
            attempt, "STALE", "stale", retryable=True, pending=[update]
        ),
        "cancelled": lambda: store.cancelled(attempt),
        "cancelled+progress": lambda: store.cancelled(attempt, [update]),
        "schedule_retry": lambda: store.schedule_retry(attempt, "STALE", "stale", delay=0),
        "schedule_retry+progress": lambda: store.schedule_retry(
            attempt, "STALE", "stale", delay=0, pending=[update], refund=True
        ),
    }


async def _snapshot(stack: Stack, job_id: str) -> tuple[Any, ...]:
    """The job's row, its events and its outbox rows, as the database has them."""
    params = {"id": uuid.UUID(job_id)}
    return (
        await stack.scalar("SELECT to_jsonb(j) FROM jobs j WHERE id = :id", **params),
        await stack.scalar(
            "SELECT coalesce(jsonb_agg(to_jsonb(e) ORDER BY seq), '[]') "
            "FROM job_events e WHERE job_id = :id",
            **params,
        ),
        await stack.scalar(
            "SELECT coalesce(jsonb_agg(to_jsonb(o) ORDER BY id), '[]') "
            "FROM outbox o WHERE job_id = :id",
            **params,
        ),
    )


async def _assert_all_refused(
    stack: Stack, store: AttemptStore, attempt: Attempt, job: Job
) -> None:
    before = await _snapshot(stack, job.id)
    wrote = []
    for name, write in _writes(store, attempt).items():
        try:
            await write()
        except LeaseLost:
            continue
        wrote.append(name)
    assert wrote == [], f"a stale attempt wrote: {wrote}"
    assert await _snapshot(stack, job.id) == before


async def _two_attempts(stack: Stack, job: Job) -> tuple[AttemptStore, Attempt, Attempt]:
    """A first attempt whose lease ran out, and the second attempt that took the job."""
    store = AttemptStore(stack.db, lease_seconds=0.1)
    envelope = await stack.envelope(job.id)
    stale = (await store.claim(envelope)).attempt
    assert stale is not None
    await asyncio.sleep(0.3)
    winner = (await store.claim(envelope)).attempt
    assert winner is not None and winner.attempt == stale.attempt + 1
    return AttemptStore(stack.db, lease_seconds=30.0), stale, winner


async def test_a_stale_attempt_can_neither_schedule_a_retry_nor_cancel(bare: Stack) -> None:
    client = bare.client()
    job = await client.submit("demo.echo", {})
    store, stale, winner = await _two_attempts(bare, job)

    await _assert_all_refused(bare, store, stale, job)

    await store.succeed(winner, {"winner": True})
    done = await client.get(job.name)
    assert done.state is JobState.SUCCEEDED and done.result == {"winner": True}


async def test_the_lease_token_alone_decides_between_claims_of_one_attempt(bare: Stack) -> None:
    client = bare.client()
    job = await client.submit("demo.echo", {})
    store = AttemptStore(bare.db, lease_seconds=30.0)
    owner = (await store.claim(await bare.envelope(job.id))).attempt
    assert owner is not None
    # Same job, same attempt number, another token: not the owner.
    forged = replace(owner, lease_token=uuid.uuid4())

    await _assert_all_refused(bare, store, forged, job)

    await store.cancelled(owner)
    assert (await client.get(job.name)).state is JobState.CANCELLED


async def test_an_attempt_cannot_write_after_its_job_ended(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    endings: dict[str, Callable[[Attempt], Awaitable[None]]] = {
        "succeed": lambda a: store.succeed(a, {}),
        "fail": lambda a: store.fail(a, "BROKEN", "broken", retryable=False),
        "cancelled": store.cancelled,
        "schedule_retry": lambda a: store.schedule_retry(a, "AGAIN", "again", delay=60),
    }
    for ending in endings.values():
        job = await client.submit("demo.echo", {})
        attempt = (await store.claim(await bare.envelope(job.id))).attempt
        assert attempt is not None
        await ending(attempt)
        await _assert_all_refused(bare, store, attempt, job)


async def test_an_old_dispatch_cannot_claim_a_retry_that_is_due_later(bare: Stack) -> None:
    client = bare.client()
    job = await client.submit("demo.echo", {})
    store = AttemptStore(bare.db, lease_seconds=30.0)
    first = await bare.envelope(job.id)
    attempt = (await store.claim(first)).attempt
    assert attempt is not None
    await store.schedule_retry(attempt, "AGAIN", "again", delay=60)
    retry = await bare.envelope(job.id)
    assert retry.event_id != first.event_id

    # The first dispatch's message again (a relay re-publish, a redelivery).
    before = await _snapshot(bare, job.id)
    claim = await store.claim(first)
    assert claim.status is ClaimStatus.STALE
    assert claim.attempt is None
    assert await _snapshot(bare, job.id) == before
    waiting = await client.get(job.name)
    assert waiting.state is JobState.QUEUED and waiting.attempt == 1

    # The current dispatch claims it when it comes.
    second = await store.claim(retry)
    assert second.status is ClaimStatus.CLAIMED
    assert second.attempt is not None and second.attempt.attempt == 2


async def test_a_worker_acks_an_old_dispatch_without_starting_the_retry_early(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    runs: list[tuple[str, int]] = []
    registry = Registry()

    @registry.handler("later.op")
    async def later(ctx: JobContext) -> dict[str, Any]:
        runs.append((ctx.name, ctx.attempt))
        raise RetryableError("come back in a minute", delay=60)

    @registry.handler("probe.op")
    async def probe(ctx: JobContext) -> dict[str, Any]:
        runs.append((ctx.name, ctx.attempt))
        return {}

    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    client = stack.client()
    job = await client.submit("later.op", {})
    first = await stack.envelope(job.id)
    # One message at a time, in queue order: once the probe below ran,
    # the duplicate before it was settled.
    await stack.start_worker(registry, prefetch=1)
    await eventually(lambda: _retry_pending(stack, job.name))

    await publish_raw(amqp_url, topology.exchange, first.job_type, first.encode())
    check = await client.submit("probe.op", {})
    assert (await asyncio.wait_for(client.wait(check.name), timeout=20)).state is (
        JobState.SUCCEEDED
    )

    assert runs == [(job.name, 1), (check.name, 1)]
    waiting = await client.get(job.name)
    assert waiting.state is JobState.QUEUED
    assert waiting.attempt == 1
    assert waiting.next_attempt_time is not None


async def _retry_pending(stack: Stack, name: str) -> bool:
    job = await stack.client().get(name)
    return job.state is JobState.QUEUED and job.next_attempt_time is not None


async def test_an_outcome_commits_the_progress_still_pending_before_it(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    pending = [ProgressUpdate(0.25, "quarter", {"n": 1}), ProgressUpdate(0.75, "most", {"n": 2})]
    endings: dict[str, tuple[Callable[[Attempt], Awaitable[None]], JobState]] = {
        "succeeded": (lambda a: store.succeed(a, {"ok": True}, pending), JobState.SUCCEEDED),
        "failed": (
            lambda a: store.fail(a, "BROKEN", "broken", retryable=False, pending=pending),
            JobState.FAILED,
        ),
        "cancelled": (lambda a: store.cancelled(a, pending), JobState.CANCELLED),
        "retry_scheduled": (
            lambda a: store.schedule_retry(a, "AGAIN", "again", delay=60, pending=pending),
            JobState.QUEUED,
        ),
    }
    for event_type, (ending, state) in endings.items():
        job = await client.submit("demo.echo", {})
        attempt = (await store.claim(await bare.envelope(job.id))).attempt
        assert attempt is not None
        await ending(attempt)
        events = [e async for e in client.watch(job.name)] if state.terminal else []
        rows = await bare.scalar(
            "SELECT jsonb_agg(jsonb_build_array(type, message, progress) ORDER BY seq) "
            "FROM job_events WHERE job_id = :id",
            id=uuid.UUID(job.id),
        )
        assert [r[0] for r in rows] == ["queued", "started", "progress", "progress", event_type]
        assert [r[1] for r in rows[2:4]] == ["quarter", "most"]
        assert (await client.get(job.name)).state is state
        if events:
            assert [e.seq for e in events] == [1, 2, 3, 4, 5]
