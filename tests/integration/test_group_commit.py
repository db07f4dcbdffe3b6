"""Group commit (ADR-0028): many claims, or many outcomes, in one statement.

Each row of a group is fenced on its own, and gets what it would have got
alone: one refused row changes nothing of itself and nothing of the others.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import Job, JobState
from jobplane.events.envelope import Event
from jobplane.faults import FaultPoints, InjectedFault
from jobplane.store.attempts import Attempt, AttemptStore, ClaimStatus
from jobplane.store.events import emitted
from jobplane.topology import Topology
from jobplane.workers.handlers import JobContext, Registry
from jobplane.workers.relay import FairSettings
from tests.support.parts import Started
from tests.support.queues import publish_raw, ready_count
from tests.support.stack import Stack, eventually, start_stack


@pytest.fixture
async def idle(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> AsyncIterator[Stack]:
    """A server and a relay: the test starts the worker once the messages wait.

    Every message in the queue before any worker consumes it: fair dispatch
    is off, which would keep all but a few in the outbox (ADR-0042).
    """
    stack = await start_stack(
        engine,
        database_url,
        amqp_url,
        topology,
        worker=False,
        relay_options={"fair": FairSettings(enabled=False)},
    )
    yield stack
    await stack.close()


async def _history(stack: Stack, job_id: str) -> list[Any]:
    """What the job's transitions wrote: its events, domain events and outbox rows,
    without what differs from job to job (ids, times)."""
    params = {"id": uuid.UUID(job_id)}
    events = await stack.scalar(
        "SELECT jsonb_agg(jsonb_build_array(seq, type, state, attempt, progress, message, data) "
        "ORDER BY seq) FROM job_events WHERE job_id = :id",
        **params,
    )
    domain = await stack.scalar(
        "SELECT coalesce(jsonb_agg(jsonb_build_array(event_type, causation_id IS NULL, "
        "payload - 'name' - 'job_id' - 'next_attempt_time' - 'labels') ORDER BY seq), '[]') "
        "FROM events WHERE job_id = :id",
        **params,
    )
    outbox = await stack.scalar(
        "SELECT jsonb_agg(jsonb_build_array(kind, routing_key, headers, published_at IS NULL, "
        "available_at > now() + interval '30 seconds') ORDER BY available_at) "
        "FROM outbox WHERE job_id = :id",
        **params,
    )
    return [events, domain, outbox]


async def test_one_statement_claims_a_group_and_refuses_only_its_stale_duplicate_and_cancelled(
    bare: Stack,
) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    jobs = [await client.submit("demo.echo", {"n": n}) for n in range(5)]
    envelopes = [await bare.envelope(j.id) for j in jobs]
    # jobs[3]: cancelled while queued. jobs[4]: its current dispatch is newer
    # than the message (a retry's), so the message is stale.
    await client.cancel(jobs[3].name)
    stale = replace(envelopes[4], event_id=uuid.uuid4())
    group = [*envelopes[:3], envelopes[0], envelopes[3], stale]
    # What a claim alone writes, for comparison.
    single = await client.submit("demo.echo", {"n": 0})
    assert (await store.claim(await bare.envelope(single.id), worker="w")).attempt is not None
    alone = await _history(bare, single.id)

    results = await store.claim_many([store.claim_request(e, worker="w") for e in group])

    claimed = [r for r in results if r is not None]
    assert [r.status for r in claimed] == [ClaimStatus.CLAIMED] * 3
    assert [r.attempt.job_id for r in claimed if r.attempt] == [e.job_id for e in envelopes[:3]]
    assert results[3:] == [None, None, None]
    # The refused are told why, as a claim of their own would have been.
    refused = [await store.refused_claim(store.claim_request(e)) for e in group[3:]]
    assert [r.status for r in refused] == [
        ClaimStatus.IN_FLIGHT,  # the duplicate: the first copy holds a live lease
        ClaimStatus.FINISHED,
        ClaimStatus.STALE,
    ]
    for job in jobs[:3]:
        got = await client.get(job.name)
        assert got.state is JobState.RUNNING and got.attempt == 1
        assert await _history(bare, job.id) == alone
    assert (await client.get(jobs[4].name)).state is JobState.QUEUED
    assert (await client.get(jobs[4].name)).attempt == 0
    # Each claimed attempt owns its job: its own token, its own outcome.
    for result in claimed:
        assert result.attempt is not None
        await store.succeed(result.attempt, {"ok": True})
    assert {(await client.get(j.name)).state for j in jobs[:3]} == {JobState.SUCCEEDED}


async def test_one_fenced_out_outcome_leaves_the_others_of_its_group_committed(
    bare: Stack,
) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    jobs = [await client.submit("demo.echo", {"n": n}) for n in range(5)]
    attempts: list[Attempt] = []
    for job in jobs:
        claim = await store.claim(await bare.envelope(job.id))
        assert claim.attempt is not None
        attempts.append(claim.attempt)
    forged = replace(attempts[4], lease_token=uuid.uuid4())
    # The same outcomes written one at a time, for comparison.
    singles = [await client.submit("demo.echo", {"n": n}) for n in range(4)]
    alone = []
    writes: list[Callable[[Attempt], Awaitable[None]]] = [
        lambda a: store.succeed(a, {"k": 0}),
        lambda a: store.fail(a, "BROKEN", "broken", retryable=False),
        lambda a: store.schedule_retry(a, "AGAIN", "again", delay=60),
        lambda a: store.succeed(a, {"k": 3}),
    ]
    for job, write in zip(singles, writes, strict=True):
        claim = await store.claim(await bare.envelope(job.id))
        assert claim.attempt is not None
        await write(claim.attempt)
        alone.append(await _history(bare, job.id))
    outcomes = [
        store.succeeded(attempts[0], {"k": 0}),
        store.failed(attempts[1], "BROKEN", "broken", retryable=False),
        store.retried(attempts[2], "AGAIN", "again", delay=60),
        store.succeeded(attempts[3], {"k": 3}),
        store.succeeded(forged, {"k": "forged"}),
    ]

    done = await store.finish_many(outcomes)

    assert done == [True, True, True, True, False]
    states = [(await client.get(j.name)) for j in jobs]
    assert [s.state for s in states] == [
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.QUEUED,
        JobState.SUCCEEDED,
        JobState.RUNNING,
    ]
    assert states[0].result == {"k": 0} and states[3].result == {"k": 3}
    assert states[1].error is not None and states[1].error.code == "BROKEN"
    # Each row wrote what it writes alone: its events, its lifecycle event,
    # the retry's next dispatch.
    assert [await _history(bare, j.id) for j in jobs[:4]] == alone
    assert len(alone[2][2]) == 2  # the retry's dispatch, due in a minute
    # The fenced-out row wrote nothing.
    assert len((await _history(bare, jobs[4].id))[0]) == 2
    # The owner of the fenced-out row is unaffected: it ends its job itself.
    assert await store.finish_many([store.succeeded(attempts[4], {"k": 4})]) == [True]
    assert (await client.get(jobs[4].name)).result == {"k": 4}


async def test_each_attempt_of_a_group_commits_its_own_emitted_events_in_order(
    bare: Stack,
) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    jobs = [await client.submit("demo.echo", {"n": n}) for n in range(4)]
    attempts: list[Attempt] = []
    for job in jobs:
        claim = await store.claim(await bare.envelope(job.id))
        assert claim.attempt is not None
        attempts.append(claim.attempt)
    counts = [2, 0, 3, 1]
    forged = replace(attempts[3], lease_token=uuid.uuid4())  # fenced out: none of its events
    outcomes = []
    for attempt, n in zip([*attempts[:3], forged], counts, strict=True):
        made = [
            emitted(
                Event.new(f"thing.made{k}", {"k": k}, tenant_id=attempt.tenant_id),
                attempt.job_id,
            )
            for k in range(n)
        ]
        outcomes.append(store.succeeded(attempt, {}, emitted=made))

    assert await store.finish_many(outcomes) == [True, True, True, False]

    for job, n in zip(jobs, counts, strict=True):
        types = await bare.scalar(
            "SELECT coalesce(jsonb_agg(event_type ORDER BY seq), '[]') FROM events "
            "WHERE job_id = :id AND event_type LIKE 'thing.%'",
            id=uuid.UUID(job.id),
        )
        expected = [f"thing.made{k}" for k in range(n)] if job is not jobs[3] else []
        assert types == expected
        # Each job's own events come before its job.succeeded.
        last = await bare.scalar(
            "SELECT event_type FROM events WHERE job_id = :id ORDER BY seq DESC LIMIT 1",
            id=uuid.UUID(job.id),
        )
        assert last == ("job.started" if job is jobs[3] else "job.succeeded")


# --- the worker: groups of concurrent deliveries --------------------------------


def _counting(runs: list[str], gate: asyncio.Event | None = None) -> Registry:
    registry = Registry()

    @registry.handler("group.op")
    async def op(ctx: JobContext) -> dict[str, Any]:
        runs.append(ctx.name)
        if gate is not None:
            await gate.wait()
        return {"ran": True}

    return registry


async def _queued(stack: Stack, count: int) -> list[Job]:
    """``count`` jobs submitted, their messages all waiting in the queue."""
    client = stack.client()
    jobs = [await client.submit("group.op", {"n": n}) for n in range(count)]

    async def published() -> bool:
        unpublished = await stack.scalar(
            "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
        )
        return bool(unpublished == 0)

    await eventually(published)
    return jobs


async def test_a_worker_claims_concurrent_deliveries_in_one_group_refusing_only_the_bad_ones(
    idle: Stack, amqp_url: str, topology: Topology
) -> None:
    runs: list[str] = []
    stack = idle
    client = stack.client()
    jobs = await _queued(stack, 6)
    # Delivered with the others: a cancelled job's message, a duplicate
    # of a live one, and a stale one (not the job's current dispatch).
    await client.cancel(jobs[5].name)
    first = await stack.envelope(jobs[0].id)
    await publish_raw(amqp_url, topology.exchange, first.job_type, first.encode())
    stale = replace(await stack.envelope(jobs[1].id), event_id=uuid.uuid4())
    await publish_raw(amqp_url, topology.exchange, stale.job_type, stale.encode())

    # Eight deliveries, eight slots, a window long enough for all that find a
    # group running.
    worker = await stack.start_worker(_counting(runs), concurrency=8, prefetch=8, group_window=0.5)
    await eventually(lambda: _states(client, jobs[:5], JobState.SUCCEEDED), timeout=20)
    await eventually(lambda: _queue_empty(amqp_url, topology))
    assert sorted(runs) == sorted(j.name for j in jobs[:5])  # each once
    # The first claims go at once (no group was running, ADR-0053); those
    # delivered while they ran wait and go together: a statement for many.
    claims = worker.group_sizes["claim"]
    assert sum(size * n for size, n in claims.items()) == 8
    assert sum(claims.values()) < 8, claims
    assert (await client.get(jobs[5].name)).state is JobState.CANCELLED
    assert (await client.get(jobs[1].name)).attempt == 1


async def test_a_fenced_out_attempt_in_an_outcome_group_does_not_hold_back_the_others(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    runs: list[str] = []
    gate = asyncio.Event()
    stack = await started(
        start_stack(
            engine,
            database_url,
            amqp_url,
            topology,
            registry=_counting(runs, gate),
            worker_options={"concurrency": 4, "group_window": 0.5},
        )
    )
    client = stack.client()
    jobs = [await client.submit("group.op", {"n": n}) for n in range(4)]
    await eventually(lambda: _is(len(runs) == 4))
    # Another attempt owns jobs[0] now (its lease token is not ours).
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET lease_token = gen_random_uuid() WHERE id = :id"),
            {"id": uuid.UUID(jobs[0].id)},
        )
    gate.set()
    await eventually(lambda: _states(client, jobs[1:], JobState.SUCCEEDED))
    assert stack.worker is not None
    assert stack.worker.group_sizes["outcome"] == {4: 1}
    fenced = await client.get(jobs[0].name)
    assert fenced.state is JobState.RUNNING and fenced.result is None
    # Its message was acked all the same: the outcome is not ours to write.
    await eventually(lambda: _queue_empty(amqp_url, topology))


class _FirstOutcomesLost(FaultPoints):
    """The ack of the first ``n`` committed outcomes is lost: the message is nacked
    (an exception before the ack) and the broker delivers it again."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self._left = n

    def hit(self, name: str) -> None:
        if name == "worker.after_outcome" and self._left > 0:
            self._left -= 1
            raise InjectedFault(name)


async def test_redelivered_messages_of_ended_jobs_in_a_group_run_nothing_again(
    idle: Stack, amqp_url: str, topology: Topology
) -> None:
    runs: list[str] = []
    stack = idle
    client = stack.client()
    jobs = await _queued(stack, 8)
    # Four at a time: two of the first four come back redelivered, with
    # two new ones, into the next group.
    worker = await stack.start_worker(
        _counting(runs),
        concurrency=4,
        prefetch=4,
        group_window=0.2,
        faults=_FirstOutcomesLost(2),
    )
    await eventually(lambda: _states(client, jobs, JobState.SUCCEEDED), timeout=20)
    await eventually(lambda: _queue_empty(amqp_url, topology))
    assert sorted(runs) == sorted(j.name for j in jobs)  # nothing ran twice
    claims = worker.group_sizes["claim"]
    assert sum(size * n for size, n in claims.items()) == 10  # 8 + 2 redeliveries
    assert max(claims) >= 2


async def test_acks_of_a_group_go_as_one_multiple_ack_where_the_tags_allow(
    idle: Stack, amqp_url: str, topology: Topology
) -> None:
    runs: list[str] = []
    gate = asyncio.Event()
    stack = idle
    client = stack.client()
    jobs = await _queued(stack, 6)
    worker = await stack.start_worker(
        _counting(runs, gate), concurrency=6, prefetch=6, group_window=0.3
    )
    await eventually(lambda: _is(len(runs) == 6))
    gate.set()
    await eventually(lambda: _states(client, jobs, JobState.SUCCEEDED))
    await eventually(lambda: _queue_empty(amqp_url, topology))
    # Six outcomes committed together, tags 1..6 of one channel: one frame.
    assert worker.group_sizes["outcome"] == {6: 1}
    assert worker.acks_sent == {"multiple": 1, "single": 0}


async def _states(client: Any, jobs: list[Any], state: JobState) -> bool:
    return all([(await client.get(j.name)).state is state for j in jobs])


async def _queue_empty(amqp_url: str, topology: Topology) -> bool:
    # Nothing ready, and nothing delivered but unacked: a passive declare on a
    # fresh connection counts ready ones; the worker holds none unacked once
    # its slots are free.
    return await ready_count(amqp_url, topology.queues[0].name) == 0


async def _is(value: bool) -> bool:
    return value


async def test_a_claim_group_that_fails_after_its_statement_commits_nothing(bare: Stack) -> None:
    client = bare.client()
    store = AttemptStore(bare.db, lease_seconds=30.0)
    good, bad = [await client.submit("demo.echo", {"n": n}) for n in range(2)]
    # A payload the attempt cannot be read from: the claim's statement takes the
    # row, reading the attempt after it fails.
    async with bare.engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET payload = '[[1]]' WHERE id = :id"), {"id": uuid.UUID(bad.id)}
        )
    requests = [store.claim_request(await bare.envelope(j.id), worker="w") for j in (good, bad)]
    with pytest.raises((TypeError, ValueError)):
        await store.claim_many(requests)
    # Neither job is held under a lease nobody runs: both are still queued, and
    # the good one's same request claims it alone.
    for job in (good, bad):
        assert await bare.scalar("SELECT state FROM jobs WHERE id = :id", id=job.id) == "queued"
        assert await bare.scalar("SELECT attempt FROM jobs WHERE id = :id", id=job.id) == 0
    [claimed] = await store.claim_many(requests[:1])
    assert claimed is not None and claimed.status is ClaimStatus.CLAIMED
    assert claimed.attempt is not None and claimed.attempt.lease_token == requests[0].lease_token
