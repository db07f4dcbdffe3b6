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
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobState
from jobplane.ids import new_id
from jobplane.topology import Topology
from jobplane.workers.relay import Relay
from jobplane.workers.sweeper import Sweeper
from tests.support.stack import Stack, eventually, start_stack

# A job, its first event and its outbox row, written the way a writer that
# skips the server's validation (or one from before it) would.
_INSERT_JOB = text(
    """
    WITH j AS (
        INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts, request_id,
                          request_hash, correlation_id, dispatch_id, last_seq)
        VALUES (:id, :tenant_id, :type, :queue, 'queued', '{}', 3, :request_id, '\\x00',
                :correlation_id, :dispatch_id, 1)
        RETURNING id, tenant_id, type, correlation_id, dispatch_id
    ), e AS (
        INSERT INTO job_events (job_id, seq, tenant_id, type, state, progress, message, attempt)
        SELECT id, 1, tenant_id, 'queued', 'queued', 0, 'queued', 0 FROM j
    )
    INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id)
    SELECT dispatch_id, tenant_id, id, type, correlation_id FROM j
    """
)


async def _insert_job(stack: Stack, job_type: str, correlation_id: str = "") -> str:
    job_id = new_id()
    async with stack.engine.begin() as conn:
        await conn.execute(
            _INSERT_JOB,
            {
                "id": job_id,
                "tenant_id": stack.tenant_id,
                "type": job_type,
                "queue": stack.topology.queues[0].name,
                "request_id": str(job_id),
                "correlation_id": correlation_id,
                "dispatch_id": new_id(),
            },
        )
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
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    stack = await start_stack(engine, database_url, amqp_url, topology, relay=False)
    try:
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
                "SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL AND published_at IS NULL"
            )
            == 2
        )
        assert (
            await stack.scalar(
                "SELECT count(*) FROM outbox WHERE published_at IS NULL AND failed_at IS NULL"
            )
            == 0
        )
        # Still on its first connection: the bad rows never reached the channel.
        assert relay.connects == 1 and relay.connected
        assert relay.failed == 2
    finally:
        await stack.close()


async def test_a_dispatch_returned_for_too_long_fails_as_unroutable(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    # The server accepts demo.echo, but the broker's only queue binds reports.*
    # (a topology that differs from the server's file): every publish returns.
    stack = await start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    narrow = replace(topology, queues=(replace(topology.queues[0], bindings=("reports.*",)),))
    relay = Relay(
        engine,
        database_url,
        amqp_url,
        narrow,
        poll_seconds=0.1,
        unroutable_after=0.5,
        unroutable_returns=2,
    )
    await relay.start()
    try:
        client = stack.client()
        job = await client.submit("demo.echo", {})
        done = await asyncio.wait_for(client.wait(job.name), timeout=20)
        assert done.state is JobState.FAILED
        assert done.error is not None and done.error.code == "JOB_TYPE_UNROUTABLE"
        assert await stack.scalar("SELECT returns >= 2 FROM outbox")
        assert [e[1:] for e in await _events(stack, job.id)] == [
            ("queued", "None"),
            ("failed", "JOB_TYPE_UNROUTABLE"),
        ]
        assert relay.published == 0 and relay.connects == 1
    finally:
        await relay.stop()
        await stack.close()


async def _purge(stack: Stack) -> int:
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(stack.topology.queues[0].name)
        result: Any = await queue.purge()
        return int(result.message_count)


async def test_the_sweeper_republishes_a_dispatch_the_broker_lost(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    stack = await start_stack(engine, database_url, amqp_url, topology, worker=False)
    sweeper = Sweeper(engine, republish_after=10.0)
    try:
        client = stack.client()
        job = await client.submit("demo.echo", {"lost": True})
        await eventually(lambda: stack.scalar("SELECT published_at IS NOT NULL FROM outbox"))
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
        assert await stack.scalar("SELECT republish_count FROM outbox") == 1
        await eventually(lambda: stack.scalar("SELECT published_at IS NOT NULL FROM outbox"))
        # The next re-publish of this dispatch waits twice as long.
        await age(19.0)
        assert (await sweeper.sweep_once()).republished == 0

        await stack.start_worker()
        done = await asyncio.wait_for(client.wait(job.name), timeout=20)
        assert done.state is JobState.SUCCEEDED and done.attempt == 1
        # A claimed (here: finished) job's dispatch is never re-published.
        await age(3600.0)
        assert (await sweeper.sweep_once()).republished == 0
    finally:
        await stack.close()
