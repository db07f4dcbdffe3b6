"""Lifecycle events reach the broker only where the topology says (ADR-0052), on real
Postgres and RabbitMQ.

Without ``[events] publish_lifecycle`` no lifecycle event is published, yet
every one is written and streamed by SubscribeEvents; handler events and a
tenant's own ``job.*`` events are published as always. The patterns live in
``lifecycle_publish``, which the relays' feed reads on every pass: a change
takes effect without a restart. The feed moves its position past what it
leaves out, without reading those rows back.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import txn
from jobplane.events.convert import event_from_pb
from jobplane.names import parse_job_name
from jobplane.store.event_feed import EventFeed
from jobplane.store.events import Position
from jobplane.store.routes import sync_submit_rules
from jobplane.topology import Topology
from jobplane.types import JobState
from jobplane.workers.handlers import JobContext, PermanentError, Registry
from tests.support.event_api import all_published, bound_queue, event_api, request
from tests.support.events import take_all
from tests.support.stack import Stack, eventually, start_stack

registry = Registry()


@registry.handler("pub.ok")
async def _ok(ctx: JobContext) -> dict[str, Any]:
    ctx.emit("thing.made", {"n": ctx.payload.get("n", 0)})
    return {"ok": True}


@registry.handler("pub.fails")
async def _fails(ctx: JobContext) -> dict[str, Any]:
    raise PermanentError("no", code="NOPE")


async def _stack(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, **parts: Any
) -> Stack:
    return await start_stack(engine, database_url, amqp_url, topology, registry=registry, **parts)


@pytest.fixture
async def stack(
    request: pytest.FixtureRequest,
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
) -> AsyncIterator[Stack]:
    """A stack on the default topology: no lifecycle event published."""
    marker = request.node.get_closest_marker("stack")
    parts = dict(marker.kwargs) if marker is not None else {}
    running = await _stack(engine, database_url, amqp_url, topology, **parts)
    yield running
    await running.close()


async def _run(stack: Stack, job_type: str, **payload: Any) -> uuid.UUID:
    job = await stack.client().submit(job_type, payload)
    done = await stack.client().wait(job.name, timeout=30)
    assert done.state in (JobState.SUCCEEDED, JobState.FAILED)
    return uuid.UUID(str(parse_job_name(job.name)))


async def _position(stack: Stack) -> Position:
    async with stack.engine.connect() as conn:
        at = (await conn.execute(text("SELECT CAST(txid AS text), seq FROM event_relay"))).one()
    return Position(int(at[0]), int(at[1]))


async def _last_event(stack: Stack) -> Position:
    async with stack.engine.connect() as conn:
        at = (
            await conn.execute(
                text("SELECT CAST(txid AS text), seq FROM events ORDER BY txid DESC, seq DESC")
            )
        ).first()
    assert at is not None
    return Position(int(at[0]), int(at[1]))


async def test_without_a_declaration_no_lifecycle_event_reaches_the_broker(
    stack: Stack, amqp_url: str
) -> None:
    exchange = stack.topology.events_exchange
    async with bound_queue(amqp_url, exchange, ["job.#", "thing.#"]) as (queue, _):
        job_id = await _run(stack, "pub.ok", n=1)
        await all_published(stack)
        messages = await take_all(amqp_url, queue)
    # The handler's event is published; the job's lifecycle events are not.
    assert [m.routing_key for m in messages] == ["thing.made"]
    # They are written all the same, and streamed, in order, by SubscribeEvents.
    async with event_api(stack) as api:
        stream = api.subscribe(["job.#", "thing.#"])
        try:
            replies = await stream.take(4)
        finally:
            stream.cancel()
    streamed = [event_from_pb(r.event) for r in replies]
    assert [e.event_type for e in streamed] == [
        "job.queued",
        "job.started",
        "thing.made",
        "job.succeeded",
    ]
    assert all(
        e.payload.get("job_id") == str(job_id) for e in streamed if e.event_type.startswith("job.")
    )
    # The feed moved past them all.
    assert await _position(stack) == await _last_event(stack)


async def test_only_the_declared_lifecycle_types_are_published(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    declared = replace(topology, publish_lifecycle=("job.failed",))
    running = await _stack(engine, database_url, amqp_url, declared)
    try:
        async with bound_queue(amqp_url, declared.events_exchange, ["job.#"]) as (queue, _):
            await _run(running, "pub.ok")
            failed = await _run(running, "pub.fails")
            await all_published(running)
            messages = await take_all(amqp_url, queue)
    finally:
        await running.close()
    assert [m.routing_key for m in messages] == ["job.failed"]
    assert str(failed) in messages[0].body.decode()


async def test_a_change_applied_while_the_relay_runs_takes_effect_without_a_restart(
    stack: Stack, amqp_url: str
) -> None:
    exchange = stack.topology.events_exchange
    async with bound_queue(amqp_url, exchange, ["job.#"]) as (queue, _):
        await _run(stack, "pub.ok")
        await all_published(stack)
        assert await take_all(amqp_url, queue) == []
        # What `jobplane topology apply` does with the new file.
        async with stack.engine.connect() as conn:
            limits = (
                await conn.execute(
                    text("SELECT max_payload_bytes, max_schedule_seconds FROM submit_settings")
                )
            ).one()
        changed = await sync_submit_rules(
            stack.engine,
            replace(stack.topology, publish_lifecycle=("job.succeeded", "job.queued")),
            max_payload_bytes=limits[0],
            max_schedule_seconds=limits[1],
        )
        assert changed
        job_id = await _run(stack, "pub.ok")
        await all_published(stack)
        messages = await take_all(amqp_url, queue)
        assert [m.routing_key for m in messages] == ["job.queued", "job.succeeded"]
        assert all(str(job_id) in m.body.decode() for m in messages)
        # Taken back: none again.
        await sync_submit_rules(
            stack.engine,
            stack.topology,
            max_payload_bytes=limits[0],
            max_schedule_seconds=limits[1],
        )
        await _run(stack, "pub.ok")
        await all_published(stack)
        assert await take_all(amqp_url, queue) == []


async def test_a_tenants_own_job_event_is_published(stack: Stack, amqp_url: str) -> None:
    exchange = stack.topology.events_exchange
    async with bound_queue(amqp_url, exchange, ["job.#"]) as (queue, _):
        async with event_api(stack) as api:
            published = await api.publish(request("job.succeeded", payload={"mine": True}))
        await all_published(stack)
        messages = await take_all(amqp_url, queue)
    assert [m.message_id for m in messages] == [published.event_id]
    stored = await stack.scalar(
        "SELECT lifecycle FROM events WHERE event_id = CAST(:id AS uuid)", id=published.event_id
    )
    assert stored is False


async def test_submit_job_in_sql_marks_its_job_queued_as_a_lifecycle_event(stack: Stack) -> None:
    async with stack.engine.begin() as conn:
        job_id = await txn.submit_job(conn, tenant="acme", type="pub.ok", payload={"n": 7})
    marks = await stack.scalar(
        "SELECT array_agg(event_type || ':' || lifecycle ORDER BY seq) FROM events "
        "WHERE job_id = :id AND event_type = 'job.queued'",
        id=job_id,
    )
    assert marks == ["job.queued:true"]


@pytest.mark.stack(relay=False, worker=False)
async def test_the_feed_moves_past_what_it_leaves_out_and_publishes_what_follows_in_order(
    stack: Stack,
) -> None:
    # Three jobs' job.queued (lifecycle, left out), then an event of the
    # tenant's own, then two more job.queued.
    for n in range(3):
        await stack.client().submit("pub.ok", {"n": n})
    async with event_api(stack) as api:
        own = await api.publish(request("artifact.created"))
    for n in range(2):
        await stack.client().submit("pub.ok", {"n": n})

    async def settled() -> bool:
        return bool(
            await stack.scalar(
                "SELECT pg_snapshot_xmin(pg_current_snapshot()) > max(txid) FROM events"
            )
        )

    # Until no transaction older than the last event's runs (any database's).
    await eventually(settled, timeout=20)
    feed = EventFeed(stack.db)
    async with feed.claim(500) as batch:
        assert batch is not None
        # Only what is published is read; the end is past everything settled.
        assert [e.stored.event.event_id for e in batch.events] == [uuid.UUID(own.event_id)]
        assert batch.end == await _last_event(stack)
        assert batch.end > batch.events[0].stored.position
        await batch.advance(batch.end)
    assert await _position(stack) == await _last_event(stack)
    # Read once: the next pass finds nothing to publish and nothing to pass.
    async with feed.claim(500) as batch:
        assert batch is not None
        assert batch.events == [] and batch.end is None


async def test_handler_events_behind_left_out_ones_are_published_in_commit_order(
    stack: Stack, amqp_url: str
) -> None:
    exchange = stack.topology.events_exchange
    async with bound_queue(amqp_url, exchange, ["#"]) as (queue, _):
        for n in range(5):
            await stack.client().submit("pub.ok", {"n": n})
        async with event_api(stack) as api:
            stream = api.subscribe(["thing.#"])
            try:
                replies = await stream.take(5)
            finally:
                stream.cancel()
        await all_published(stack)
        messages = await take_all(amqp_url, queue)
    streamed = [event_from_pb(r.event) for r in replies]
    # Only the handlers' events, in the order they committed (the feed's).
    assert [m.message_id for m in messages] == [str(e.event_id) for e in streamed]
    assert sorted(e.payload["n"] for e in streamed) == [0, 1, 2, 3, 4]
    assert await _position(stack) == await _last_event(stack)
