"""Dispatches that cannot reach a worker end: failed by the relay, or re-published.

- A row the broker can never accept fails its job (DISPATCH_FAILED) without
  holding up the other rows of its batch or making the relay reconnect.
- A row returned unroutable for too long fails its job (JOB_TYPE_UNROUTABLE).
- A dispatch the broker lost (a purged queue) is published again by the
  sweeper, and the job then runs.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

import aio_pika
import pytest
import structlog
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from structlog.testing import capture_logs

from jobplane.client import JobState
from jobplane.observe import tracing
from jobplane.store import sweeps
from jobplane.store.outbox import GiveUp, OutboxStore
from jobplane.topology import Topology
from jobplane.workers import sweeper as sweeper_module
from jobplane.workers.relay import Relay
from jobplane.workers.sweeper import Sweeper
from tests.support.parts import Started
from tests.support.rows import insert_job
from tests.support.stack import Stack, eventually, start_stack


async def _insert_dispatch(
    stack: Stack, job_type: str = "demo.echo", correlation_id: str = ""
) -> tuple[uuid.UUID, uuid.UUID]:
    """A QUEUED job with a due dispatch on the first queue: (job id, dispatch id)."""
    return await insert_job(
        stack.engine, stack.tenant_id, stack.topology.queues[0].name, job_type, correlation_id
    )


async def _insert_job(stack: Stack, job_type: str, correlation_id: str = "") -> str:
    job_id, _dispatch = await _insert_dispatch(stack, job_type, correlation_id)
    return str(job_id)


async def _events(stack: Stack, job_id: str) -> list[tuple[int, str, str]]:
    async with stack.engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT seq, type, data->'error'->>'code' FROM job_events WHERE job_id = :id "
                "ORDER BY seq"
            ),
            {"id": uuid.UUID(job_id)},
        )
        return [(int(r[0]), str(r[1]), str(r[2])) for r in rows]


async def test_rows_the_broker_cannot_accept_fail_their_jobs_and_the_batch_goes_on(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, topology, relay=False))
    # One batch: good rows around the two bad ones.
    good = [await _insert_job(stack, "demo.echo") for _ in range(2)]
    long_correlation = await _insert_job(stack, "demo.echo", correlation_id="c" * 256)
    long_key = await _insert_job(stack, "demo." + "k" * 300)
    good += [await _insert_job(stack, "demo.echo", correlation_id="c" * 255)]

    relay = await stack.start_relay()
    client = stack.client()
    for job_id in good:
        done = await asyncio.wait_for(client.wait(f"jobs/{job_id}"), timeout=20)
        assert done.state is JobState.SUCCEEDED
    for job_id, says in ((long_correlation, "correlation id"), (long_key, "routing key")):
        job = await asyncio.wait_for(client.wait(f"jobs/{job_id}"), timeout=20)
        assert job.state is JobState.FAILED
        assert job.error is not None and job.error.code == "DISPATCH_FAILED"
        assert says in job.error.message and not job.error.retryable
        assert await _events(stack, job_id) == [
            (1, "queued", "None"),
            (2, "failed", "DISPATCH_FAILED"),
        ]
    assert (
        await stack.scalar(
            "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' "
            "AND failed_at IS NOT NULL AND published_at IS NULL"
        )
        == 2
    )
    assert (
        await stack.scalar(
            "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' "
            "AND published_at IS NULL AND failed_at IS NULL"
        )
        == 0
    )
    # Still on its first connection: the bad rows never reached the channel.
    assert relay.connects == 1 and relay.connected
    assert relay.failed == 2


async def test_a_dispatch_returned_for_too_long_fails_as_unroutable(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    # The server accepts demo.echo, but the broker's only queue binds reports.*
    # (a topology that differs from the server's file): every publish returns.
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    narrow = replace(topology, queues=(replace(topology.queues[0], bindings=("reports.*",)),))
    relay = await started(
        Relay(
            engine,
            database_url,
            amqp_url,
            narrow,
            poll_seconds=0.1,
            unroutable_after=0.5,
            unroutable_returns=2,
        )
    )
    client = stack.client()
    job = await client.submit("demo.echo", {})
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.FAILED
    assert done.error is not None and done.error.code == "JOB_TYPE_UNROUTABLE"
    assert await stack.scalar("SELECT returns >= 2 FROM outbox WHERE kind = 'job.dispatch'")
    assert [e[1:] for e in await _events(stack, job.id)] == [
        ("queued", "None"),
        ("failed", "JOB_TYPE_UNROUTABLE"),
    ]
    # Nothing it published was the dispatch: only the job's lifecycle events.
    assert relay.connects == 1
    assert relay.published <= await stack.scalar("SELECT count(*) FROM events")
    assert await stack.scalar("SELECT published_at IS NULL FROM outbox WHERE kind = 'job.dispatch'")


async def _purge(stack: Stack) -> int:
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(stack.topology.queues[0].name)
        result: Any = await queue.purge()
        return int(result.message_count)


async def test_the_sweeper_republishes_a_dispatch_the_broker_lost(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    sweeper = Sweeper(engine, republish_after=10.0, republish_every=0.0)
    client = stack.client()
    job = await client.submit("demo.echo", {"lost": True})
    await eventually(
        lambda: stack.scalar(
            "SELECT published_at IS NOT NULL FROM outbox WHERE kind = 'job.dispatch'"
        )
    )
    assert await _purge(stack) == 1  # the broker lost it

    async def age(seconds: float) -> None:
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE outbox SET published_at = now() - make_interval(secs => :s)"),
                {"s": seconds},
            )

    await age(9.0)  # younger than the bound: a deep queue may still hold it
    assert (await sweeper.sweep_once()).republished == 0
    await age(11.0)
    assert (await sweeper.sweep_once()).republished == 1
    assert await stack.scalar("SELECT republish_count FROM outbox WHERE kind = 'job.dispatch'") == 1
    await eventually(
        lambda: stack.scalar(
            "SELECT published_at IS NOT NULL FROM outbox WHERE kind = 'job.dispatch'"
        )
    )
    # The next re-publish of this dispatch waits twice as long.
    await age(19.0)
    assert (await sweeper.sweep_once()).republished == 0

    await stack.start_worker()
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.SUCCEEDED and done.attempt == 1
    # A claimed (here: finished) job's dispatch is never re-published.
    await age(3600.0)
    assert (await sweeper.sweep_once()).republished == 0


async def _returned(store: OutboxStore, *, returns: int) -> list[uuid.UUID]:
    """Every due row comes back unroutable once; returns those given up on."""
    async with store.claim(10) as batch:
        return await batch.mark_returned(
            [row.id for row in batch.rows], "returned", give_up_after=0.0, give_up_returns=returns
        )


async def _make_due(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE outbox SET available_at = now()"))


async def test_only_returns_in_a_row_count_towards_unroutable(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    store = OutboxStore(stack.db)
    _job_id, dispatch_id = await _insert_dispatch(stack)
    for _ in range(2):
        assert await _returned(store, returns=3) == []
        await _make_due(engine)
    # A nack (or a timeout) between returns ends the run.
    async with store.claim(10) as batch:
        await batch.mark_retry([row.id for row in batch.rows], "nacked")
    assert await stack.scalar("SELECT returns FROM outbox WHERE kind = 'job.dispatch'") == 0
    for _ in range(2):
        await _make_due(engine)
        assert await _returned(store, returns=3) == []
    await _make_due(engine)
    assert await _returned(store, returns=3) == [dispatch_id]  # three in a row

    # A publish ends a run too, and so does the sweeper's re-publish.
    await _make_due(engine)
    async with store.claim(10) as batch:
        await batch.mark_published([row.id for row in batch.rows])
    assert await stack.scalar(
        "SELECT (returns, first_returned_at) FROM outbox WHERE kind = 'job.dispatch'"
    ) == (0, None)
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE outbox SET returns = 7, first_returned_at = now() - interval '1 hour', "
                "published_at = now() - interval '1 hour'"
            )
        )
    sweeper = Sweeper(engine, republish_after=60.0)
    assert (await sweeper.sweep_once()).republished == 1
    assert await stack.scalar(
        "SELECT (returns, first_returned_at) FROM outbox WHERE kind = 'job.dispatch'"
    ) == (0, None)


async def test_giving_up_on_a_row_of_a_parked_job_settles_the_row(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    store = OutboxStore(stack.db)
    job_id = await _insert_job(stack, "demo.echo")
    # The job was parked (no dispatch) while this row was still due.
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE jobs SET dispatch_id = NULL"))

    # A job locked by another transaction is busy: nothing is written.
    async with engine.connect() as holder:
        await holder.execute(text("SELECT 1 FROM jobs FOR UPDATE"))
        async with store.claim(10) as batch:
            assert await batch.fail(batch.rows[0], "DISPATCH_FAILED", "x") is GiveUp.BUSY
        await holder.rollback()
    assert await stack.scalar("SELECT failed_at FROM outbox WHERE kind = 'job.dispatch'") is None

    async with store.claim(10) as batch:
        assert await batch.fail(batch.rows[0], "DISPATCH_FAILED", "x") is GiveUp.MOVED_ON
    assert await stack.scalar(
        "SELECT failed_at IS NOT NULL FROM outbox WHERE kind = 'job.dispatch'"
    )
    # The parked job is left as it was: it waits for a worker, not for this row.
    assert await stack.scalar(
        "SELECT (state, dispatch_id) FROM jobs WHERE id = :id", id=uuid.UUID(job_id)
    ) == ("queued", None)
    async with store.claim(10) as batch:
        assert batch.rows == []  # settled, not due again


async def _lost_dispatches(stack: Stack, count: int) -> list[tuple[uuid.UUID, uuid.UUID]]:
    """``count`` QUEUED jobs whose dispatch was published an hour ago and never
    claimed: (job id, dispatch id) of each."""
    inserted = [await _insert_dispatch(stack) for _ in range(count)]
    async with stack.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE outbox SET published_at = now() - interval '1 hour' "
                "WHERE published_at IS NULL AND republish_count = 0"
            )
        )
    return inserted


async def test_one_sweeper_at_a_time_republishes_on_its_own_schedule(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    await _lost_dispatches(stack, 1)
    # Another sweeper's pass holds the lock: this one leaves the pass to it.
    async with engine.connect() as other:
        await other.execute(
            text("SELECT pg_advisory_xact_lock(:key)"), {"key": sweeps.REPUBLISH_LOCK_KEY}
        )
        assert (await Sweeper(engine, republish_every=0.0).sweep_once()).republished == 0
        await other.rollback()

    hourly = Sweeper(engine, republish_after=60.0, republish_every=3600.0)
    assert (await hourly.sweep_once()).republished == 1
    await _lost_dispatches(stack, 1)
    # Leases and stuck rows are swept every time; lost dispatches once an hour here.
    assert (await hourly.sweep_once()).republished == 0
    assert (
        await stack.scalar(
            "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
        )
        == 1
    )


async def test_a_republish_pass_looks_at_a_bounded_part_of_the_backlog(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    await _lost_dispatches(stack, 5)
    store = sweeps.SweepStore(engine)
    passes = []
    while True:
        done = await store.republish_unclaimed(after=60.0, scan=2, window=1)
        assert done is not None
        passes.append((len(done.republished), done.scanned, done.lap_done))
        if done.lap_done:
            break
    # Each pass reads two QUEUED jobs at most and goes on where the last stopped.
    assert passes == [(2, 2, False), (2, 2, False), (1, 1, True)]
    assert (
        await stack.scalar(
            "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND republish_count = 1"
        )
        == 5
    )
    # After a lap the next pass starts again from the first.
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE outbox SET published_at = now() - interval '1 day'"))
    done = await store.republish_unclaimed(after=60.0, scan=10)
    assert done is not None and len(done.republished) == 5 and done.lap_done


async def test_a_republished_dispatchs_line_names_the_jobs_trace(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    monkeypatch: pytest.MonkeyPatch,
    started: Started,
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    ((job_id, dispatch_id),) = await _lost_dispatches(stack, 1)
    trace_id = uuid.uuid4().hex
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE outbox SET headers = "
                "jsonb_build_object('traceparent', CAST(:parent AS text))"
            ),
            {"parent": f"00-{trace_id}-{'1' * 16}-00"},
        )
    # Tracing handed over, as the CLI does when it is on (no provider
    # needed); a logger not yet used, so capture_logs sees its lines.
    monkeypatch.setattr(sweeper_module, "log", structlog.get_logger("jobplane.sweeper"))
    traced = Sweeper(engine, republish_every=0.0, interceptors=[tracing.RelayTracing()])
    with capture_logs() as logs:
        assert (await traced.sweep_once()).republished == 1
    (line,) = [e for e in logs if e["event"] == "sweeper.dispatch.republished"]
    assert line["trace_id"] == trace_id
    # The line names the job and the dispatch made due again, and its count.
    assert (line["job"], line["event_id"], line["republish"]) == (
        f"jobs/{job_id}",
        str(dispatch_id),
        1,
    )
    assert (
        await stack.scalar("SELECT republish_count FROM outbox WHERE id = :id", id=dispatch_id) == 1
    )
