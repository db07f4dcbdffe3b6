"""Cancellation, duplicate deliveries, broker outages and server restarts."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aio_pika
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobEvent, JobState
from jobplane.envelope import Envelope
from jobplane.topology import Topology
from jobplane.types import EventType
from jobplane.workers.handlers import JobContext, Registry
from tests.support.parts import Started
from tests.support.ports import free_port
from tests.support.proxy import CuttableProxy
from tests.support.stack import Stack, eventually, start_stack


async def test_cancel_queued_job_is_immediate_and_never_runs(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    ran: list[str] = []
    registry = Registry()

    @registry.handler("demo.echo")
    async def echo(ctx: JobContext) -> dict[str, Any]:
        ran.append(ctx.name)
        return {}

    # No worker yet: the job stays QUEUED (its message may already be in the queue).
    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    client = stack.client()
    job = await client.submit("demo.echo", {})
    await eventually(
        lambda: stack.scalar(
            "SELECT count(*) = 1 FROM outbox WHERE kind = 'job.dispatch' "
            "AND published_at IS NOT NULL"
        )
    )
    cancelled = await client.cancel(job.name, reason="changed my mind")
    assert cancelled.state is JobState.CANCELLED
    assert cancelled.error is not None and cancelled.error.message == "changed my mind"

    # The worker now receives the message and must do nothing with it.
    await stack.start_worker(registry)
    probe = await client.submit("demo.echo", {})
    await asyncio.wait_for(client.wait(probe.name), timeout=20)
    await eventually(lambda: _queue_drained(stack))
    assert ran == [probe.name]
    final = await client.get(job.name)
    assert final.state is JobState.CANCELLED
    events = [e async for e in client.watch(job.name)]
    assert [e.type for e in events] == [EventType.QUEUED, EventType.CANCELLED]


async def test_cancel_pending_dispatch_drops_the_outbox_row(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    client = stack.client()
    job = await client.submit("demo.echo", {})
    assert (
        await stack.scalar(
            "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
        )
        == 1
    )
    await client.cancel(job.name)
    assert await stack.scalar("SELECT count(*) FROM outbox WHERE kind = 'job.dispatch'") == 0


async def test_cancel_running_job_stops_the_handler_within_two_seconds(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.progress", {"steps": 1000, "interval_ms": 20})
    seen: list[JobEvent] = []

    async def watch() -> None:
        async for event in client.watch(job.name):
            seen.append(event)

    watcher = asyncio.create_task(watch())
    await eventually(lambda: _async(sum(e.type is EventType.PROGRESS for e in seen) >= 3))

    started = time.monotonic()
    requested = await client.cancel(job.name, reason="stop")
    assert requested.state in (JobState.RUNNING, JobState.CANCELLED)
    await asyncio.wait_for(watcher, timeout=5)
    elapsed = time.monotonic() - started
    final = await client.get(job.name)
    assert final.state is JobState.CANCELLED
    assert elapsed < 2.0, f"cancelled after {elapsed:.2f}s"
    assert seen[-1].type is EventType.CANCELLED
    assert any(e.type is EventType.CANCEL_REQUESTED for e in seen)

    # The handler stopped emitting: no event is stored after the terminal one.
    last_seq = final.last_seq
    await asyncio.sleep(0.5)
    assert (
        await stack.scalar(
            "SELECT max(seq) FROM job_events WHERE job_id = :id", id=uuid.UUID(final.id)
        )
        == last_seq
    )
    assert stack.worker is not None and stack.worker.running_jobs == []


async def test_same_message_delivered_twice_runs_the_handler_once(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    runs: dict[str, int] = {}
    registry = Registry()

    @registry.handler("count.me")
    async def count(ctx: JobContext) -> dict[str, Any]:
        runs[ctx.name] = runs.get(ctx.name, 0) + 1
        await asyncio.sleep(0.3)  # long enough for the twin to arrive mid-run
        return {"runs": runs[ctx.name]}

    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    client = stack.client()
    job = await client.submit("count.me", {})
    await eventually(
        lambda: stack.scalar(
            "SELECT count(*) = 1 FROM outbox WHERE kind = 'job.dispatch' "
            "AND published_at IS NOT NULL"
        )
    )
    # Publish the very same dispatch again, as a relay crash after the
    # confirm would: both copies now wait in the queue.
    await _publish_copy(stack, uuid.UUID(job.id))
    await stack.start_worker(registry, concurrency=4)
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.SUCCEEDED
    await eventually(lambda: _queue_drained(stack))

    # And once more after it finished: acked without running.
    await _publish_copy(stack, uuid.UUID(job.id))
    await eventually(lambda: _queue_drained(stack))
    assert runs == {job.name: 1}
    assert (await client.get(job.name)).attempt == 1


async def test_relay_keeps_rows_while_broker_is_unreachable(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    from urllib.parse import urlsplit

    target = urlsplit(amqp_url)
    proxy = CuttableProxy(target.hostname or "127.0.0.1", target.port or 5672)
    await proxy.start()
    await proxy.cut()  # the broker is unreachable from the start
    started.callback(proxy.cut)
    proxied = amqp_url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")

    stack = await started(start_stack(engine, database_url, amqp_url, topology, relay=False))
    await stack.start_relay(proxied)
    client = stack.client()
    jobs = [await client.submit("demo.echo", {"i": i}) for i in range(5)]
    await asyncio.sleep(1.5)
    assert (
        await stack.scalar(
            "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
        )
        == 5
    )
    states = [(await client.get(j.name)).state for j in jobs]
    assert states == [JobState.QUEUED] * 5

    await proxy.start()  # the broker is back
    for job in jobs:
        done = await asyncio.wait_for(client.wait(job.name), timeout=30)
        assert done.state is JobState.SUCCEEDED
    assert (
        await stack.scalar(
            "SELECT count(*) FROM outbox WHERE kind = 'job.dispatch' AND published_at IS NULL"
        )
        == 0
    )


async def test_sdk_watch_survives_a_server_restart(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    port = free_port()
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, listen=f"127.0.0.1:{port}")
    )
    client = stack.client()
    job = await client.submit("demo.progress", {"steps": 40, "interval_ms": 50})
    seen: list[JobEvent] = []

    async def watch() -> None:
        async for event in client.watch(job.name):
            seen.append(event)

    watcher = asyncio.create_task(watch())
    await eventually(lambda: _async(len(seen) >= 5))

    # Restart the server mid-stream; the worker keeps writing events.
    await stack.server.stop(grace=0)
    await asyncio.sleep(0.7)
    await stack.server.start()
    await asyncio.wait_for(watcher, timeout=30)

    seqs = [e.seq for e in seen]
    assert seqs == list(range(1, len(seen) + 1)), seqs
    assert seen[-1].type is EventType.SUCCEEDED
    assert (await client.get(job.name)).last_seq == len(seen)


async def _publish_copy(stack: Stack, job_id: uuid.UUID) -> None:
    envelope = await stack.envelope(str(job_id))
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(stack.topology.exchange)
        await exchange.publish(
            aio_pika.Message(envelope.encode(), message_id=str(envelope.event_id)),
            routing_key=envelope.job_type,
        )


async def _queue_drained(stack: Stack) -> bool:
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(stack.topology.queues[0].name, passive=True)
        ready = queue.declaration_result.message_count
    worker_idle = stack.worker is not None and not stack.worker.busy
    return ready == 0 and worker_idle


async def _async(value: bool) -> bool:
    return value


async def test_relay_does_not_mark_a_returned_publish(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    from dataclasses import replace

    from jobplane.workers.relay import Relay

    # The server accepts the type, but the exchange the relay declared has no
    # binding for it: the broker returns the mandatory message. Its job.queued
    # is published (the topology says so).
    published = replace(topology, publish_lifecycle=("job.queued",))
    stack = await started(
        start_stack(engine, database_url, amqp_url, published, relay=False, worker=False)
    )
    narrow = replace(topology, queues=(replace(topology.queues[0], bindings=("reports.*",)),))
    relay = await started(Relay(engine, database_url, amqp_url, narrow, poll_seconds=0.1))
    await stack.client().submit("demo.echo", {})
    await eventually(
        lambda: stack.scalar("SELECT publish_attempts >= 1 FROM outbox WHERE kind = 'job.dispatch'")
    )
    assert await stack.scalar("SELECT published_at IS NULL FROM outbox WHERE kind = 'job.dispatch'")
    assert "not confirmed" in await stack.scalar(
        "SELECT last_error FROM outbox WHERE kind = 'job.dispatch'"
    )

    # Its job.queued is published (by the event feed); the dispatch never counts.
    async def queued_event_published() -> bool:
        return relay.events_published >= 1

    await eventually(queued_event_published)
    assert relay.published == 0
    assert await stack.scalar("SELECT published_at IS NULL FROM outbox WHERE kind = 'job.dispatch'")


async def test_unreadable_and_unknown_messages_go_to_the_failed_queue(stack: Stack) -> None:
    unknown = Envelope(uuid.uuid4(), uuid.uuid4(), stack.tenant_id, "demo.echo")
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(stack.topology.exchange)
        for body in (b"\x00not an envelope", unknown.encode()):
            await exchange.publish(aio_pika.Message(body), routing_key="demo.echo")

        async def failed_count() -> bool:
            queue = await channel.declare_queue(stack.topology.failed_queue, passive=True)
            return queue.declaration_result.message_count == 2

        await eventually(failed_count)
    # Jobs keep flowing.
    client = stack.client()
    done = await asyncio.wait_for(client.wait((await client.submit("demo.echo", {})).name), 20)
    assert done.state is JobState.SUCCEEDED
