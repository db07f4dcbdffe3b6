"""Lifecycle events and ``ctx.emit``, end to end on real Postgres and RabbitMQ.

A job's transitions publish ``job.queued``, ``job.started``, ``job.succeeded``
(…) in order, each caused by the one before it and correlated to the job;
SubscribeEvents and a queue bound to ``job.#`` see the same chain (the
topology publishes every lifecycle event: ``publish_lifecycle = ["job.#"]``).
A handler's emitted events reach both only with the attempt that wins: never
from one that failed, was retried or lost its lease.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aio_pika
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.attempt_end import RetryPolicy
from jobplane.events import Event, amqp_properties, decode, encode
from jobplane.events.convert import event_from_pb
from jobplane.names import parse_job_name
from jobplane.store.machine import MACHINE, MAX_EMITTED_EVENTS, lifecycle_event_id
from jobplane.store.sweeps import SweepStore
from jobplane.topology import Topology
from jobplane.types import JobState
from jobplane.workers.handlers import EmitError, JobContext, PermanentError, Registry
from jobplane.workers.sweeper import lease_expired
from tests.support.event_api import all_published, bound_queue, event_api
from tests.support.events import take_all
from tests.support.stack import Stack, eventually, start_stack

registry = Registry()
# The first attempt of life.stale waits here until the test has taken its lease.
_stale_gate: dict[str, asyncio.Event] = {}


@registry.handler("life.ok")
async def _ok(ctx: JobContext) -> dict[str, Any]:
    ctx.emit("thing.made", {"n": 1})
    ctx.emit("thing.checked", {"n": 2}, causation_id="outside-cause", project_id="web")
    return {"ok": True}


@registry.handler("life.flaky")
async def _flaky(ctx: JobContext) -> dict[str, Any]:
    ctx.emit("thing.tried", {"attempt": ctx.attempt})
    if ctx.attempt == 1:
        raise RuntimeError("first attempts fail")
    return {"attempt": ctx.attempt}


@registry.handler("life.fails")
async def _fails(ctx: JobContext) -> dict[str, Any]:
    ctx.emit("thing.tried", {"attempt": ctx.attempt})
    raise PermanentError("no", code="NOPE")


@registry.handler("life.stale")
async def _stale(ctx: JobContext) -> dict[str, Any]:
    ctx.emit("thing.tried", {"attempt": ctx.attempt})
    if ctx.attempt == 1:
        _stale_gate["started"].set()
        # Held until the job is another attempt's; then it returns as if done.
        await _stale_gate["release"].wait()
    return {"attempt": ctx.attempt}


@registry.handler("life.waits")
async def _waits(ctx: JobContext) -> dict[str, Any]:
    await asyncio.sleep(3600)  # until cancelled
    return {}


@registry.handler("life.bad_emit")
async def _bad_emit(ctx: JobContext) -> dict[str, Any]:
    problems = []
    bad: list[tuple[str, dict[str, Any]]] = [
        ("Not.Lowercase", {}),
        ("thing.nan", {"x": float("nan")}),
        ("thing.nul", {"x": "a\x00b"}),
        ("thing.object", {"x": object()}),
    ]
    for event_type, payload in bad:
        try:
            ctx.emit(event_type, payload)
        except EmitError as exc:
            problems.append(exc.field)
    for n in range(MAX_EMITTED_EVENTS):
        ctx.emit("thing.many", {"n": n})
    try:
        ctx.emit("thing.many", {"n": MAX_EMITTED_EVENTS})
    except EmitError:
        problems.append("count")
    return {"problems": problems}


@pytest.fixture
async def stack(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> AsyncIterator[Stack]:
    # Every lifecycle event published: the exchange carries the chain too.
    running = await start_stack(
        engine,
        database_url,
        amqp_url,
        replace(topology, publish_lifecycle=("job.#",)),
        registry=registry,
        worker_options={"concurrency": 4, "retry_base_delay": 0.05},
    )
    yield running
    await running.close()


async def _subscribed(stack: Stack, count: int, patterns: list[str]) -> list[Event]:
    async with event_api(stack) as api:
        stream = api.subscribe(patterns)
        try:
            replies = await stream.take(count)
        finally:
            stream.cancel()
    return [event_from_pb(r.event) for r in replies]


def _job_events(events: list[Event], job_id: uuid.UUID) -> list[Event]:
    return [e for e in events if e.payload.get("job_id") == str(job_id) or _emitted(e)]


def _emitted(event: Event) -> bool:
    return event.event_type.startswith("thing.")


def _check_chain(events: list[Event], job_id: uuid.UUID, correlation: str) -> None:
    """Lifecycle events of one job: ids from its event seqs, each caused by the one before."""
    lifecycle = [e for e in events if e.event_type.startswith("job.")]
    previous: Event | None = None
    for event in lifecycle:
        assert event.correlation_id == correlation, event
        assert event.payload["job_id"] == str(job_id)
        assert event.payload["name"] == f"jobs/{job_id}"
        if previous is None:
            assert event.causation_id is None
            assert event.event_id == lifecycle_event_id(job_id, 1)
        else:
            assert event.causation_id == str(previous.event_id), (event, previous)
            assert event.timestamp >= previous.timestamp
        previous = event


async def test_a_jobs_lifecycle_and_emitted_events_arrive_in_order_on_both_paths(
    stack: Stack, amqp_url: str
) -> None:
    exchange = stack.topology.events_exchange
    async with bound_queue(amqp_url, exchange, ["job.#", "thing.*"]) as (queue, _):
        job = await stack.client().submit(
            "life.ok", {}, correlation_id="order-42", labels={"team": "a", "env": "b"}
        )
        done = await stack.client().wait(job.name, timeout=30)
        assert done.state is JobState.SUCCEEDED
        job_id = uuid.UUID(str(parse_job_name(job.name)))
        await all_published(stack)
        messages = await take_all(amqp_url, queue)
    streamed = await _subscribed(stack, 5, ["job.#", "thing.*"])
    wanted = ["job.queued", "job.started", "thing.made", "thing.checked", "job.succeeded"]
    assert [e.event_type for e in streamed] == wanted
    _check_chain(streamed, job_id, "order-42")
    queued, started, made, checked, succeeded = streamed
    # What a lifecycle event says: the job, no result (GetJob reads it).
    assert succeeded.payload == {
        "name": f"jobs/{job_id}",
        "job_id": str(job_id),
        "type": "life.ok",
        "queue": started.payload["queue"],
        "state": "succeeded",
        "attempt": 1,
        "max_attempts": queued.payload["max_attempts"],
        "labels": {"env": "b", "team": "a"},
    }
    assert queued.payload["state"] == "queued" and queued.payload["attempt"] == 0
    # Emitted events: the job's correlation, job.started as cause unless given.
    assert made.correlation_id == checked.correlation_id == "order-42"
    assert made.causation_id == str(started.event_id)
    assert checked.causation_id == "outside-cause"
    # The project a handler names travels with its event (none when not named).
    assert (made.project_id, checked.project_id) == (None, "web")
    assert (made.payload, checked.payload) == ({"n": 1}, {"n": 2})
    # The exchange: the same events, in the same order, once each, with the
    # documented properties and a body decode reads (compact, as encode writes).
    assert [m.routing_key for m in messages] == wanted
    assert [json.loads(m.body)["project_id"] for m in messages] == [None, None, None, "web", None]
    for message, event in zip(messages, streamed, strict=True):
        assert decode(message.body) == event
        assert message.body == encode(decode(message.body))
        props = amqp_properties(event)
        assert message.message_id == props["message_id"] == str(event.event_id)
        assert message.type == event.event_type
        assert message.correlation_id == "order-42"
        assert message.content_type == "application/json"
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert message.app_id == "jobplane"
        assert (message.headers or {}) == props["headers"]


async def test_a_retried_job_chains_through_its_retry_and_publishes_only_the_winners_emits(
    stack: Stack,
) -> None:
    job = await stack.client().submit("life.flaky", {}, max_attempts=3)
    done = await stack.client().wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED
    job_id = uuid.UUID(str(parse_job_name(job.name)))
    await all_published(stack)
    events = await _subscribed(stack, 6, ["#"])
    assert [e.event_type for e in events] == [
        "job.queued",
        "job.started",
        "job.retry_scheduled",
        "job.started",
        "thing.tried",
        "job.succeeded",
    ]
    # No correlation id given: the job's id is the chain's.
    _check_chain(events, job_id, str(job_id))
    retry = events[2]
    assert retry.payload["error"]["retryable"] is True
    assert retry.payload["state"] == "queued" and retry.payload["next_attempt_time"]
    assert events[4].payload == {"attempt": 2}
    assert events[4].causation_id == str(events[3].event_id)


async def test_a_failed_attempt_publishes_none_of_its_events(stack: Stack) -> None:
    job = await stack.client().submit("life.fails", {}, max_attempts=1)
    done = await stack.client().wait(job.name, timeout=30)
    assert done.state is JobState.FAILED
    job_id = uuid.UUID(str(parse_job_name(job.name)))
    await all_published(stack)
    events = await _subscribed(stack, 3, ["#"])
    assert [e.event_type for e in events] == ["job.queued", "job.started", "job.failed"]
    _check_chain(events, job_id, str(job_id))
    assert events[2].payload["error"] == {"code": "NOPE", "message": "no", "retryable": False}
    assert await stack.scalar("SELECT count(*) FROM events WHERE event_type LIKE 'thing.%'") == 0


async def test_only_a_cancel_request_carries_its_reason(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("life.waits", {}, labels={"team": "a"})

    async def running() -> bool:
        return (await client.get(job.name)).state is JobState.RUNNING

    await eventually(running)
    await client.cancel(job.name, reason="no longer wanted")
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.CANCELLED
    job_id = uuid.UUID(str(parse_job_name(job.name)))
    await all_published(stack)
    events = await _subscribed(stack, 4, ["#"])
    assert [e.event_type for e in events] == [
        "job.queued",
        "job.started",
        "job.cancel_requested",
        "job.cancelled",
    ]
    _check_chain(events, job_id, str(job_id))
    queued, started, asked, cancelled = events
    assert asked.payload == {
        "name": f"jobs/{job_id}",
        "job_id": str(job_id),
        "type": "life.waits",
        "queue": queued.payload["queue"],
        "state": "running",
        "attempt": 1,
        "max_attempts": queued.payload["max_attempts"],
        "labels": {"team": "a"},
        "reason": "no longer wanted",
    }
    assert [e.payload.get("reason") for e in (queued, started, cancelled)] == [None] * 3
    assert cancelled.payload["error"] == {
        "code": "CANCELLED",
        "message": "no longer wanted",
        "retryable": False,
    }


async def test_an_attempt_that_lost_its_lease_publishes_none_of_its_events(
    stack: Stack, engine: AsyncEngine, amqp_url: str
) -> None:
    _stale_gate.update(started=asyncio.Event(), release=asyncio.Event())
    async with bound_queue(amqp_url, stack.topology.events_exchange, ["thing.#"]) as (queue, _):
        job = await stack.client().submit("life.stale", {}, max_attempts=3)
        job_id = uuid.UUID(str(parse_job_name(job.name)))
        await asyncio.wait_for(_stale_gate["started"].wait(), timeout=30)
        # The first attempt's lease runs out (its worker is presumed dead) and
        # the sweeper gives the job to a new attempt, which succeeds.
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE jobs SET lease_expires_at = now() - interval '1 hour' WHERE id = :id"),
                {"id": job_id},
            )
        await SweepStore(engine).expire_leases(
            grace=0, limit=10, decide=lambda lease: lease_expired(lease, RetryPolicy(0.0, 0.0))
        )
        assert await stack.scalar("SELECT state FROM jobs WHERE id = :id", id=job_id) != "running"
        done = await stack.client().wait(job.name, timeout=30)
        assert done.state is JobState.SUCCEEDED and done.attempt == 2
        # The stale attempt now returns: its outcome is fenced out.
        _stale_gate["release"].set()
        await all_published(stack)
        await asyncio.sleep(0.5)
        messages = await take_all(amqp_url, queue)
    tried = [decode(m.body).payload for m in messages]
    assert tried == [{"attempt": 2}]
    stored = await stack.scalar(
        "SELECT jsonb_agg(payload) FROM events WHERE event_type = 'thing.tried'"
    )
    assert stored == [{"attempt": 2}]
    events = await _subscribed(stack, 5, ["job.#"])
    assert [e.event_type for e in events] == [
        "job.queued",
        "job.started",
        "job.retry_scheduled",
        "job.started",
        "job.succeeded",
    ]
    assert events[2].payload["error"]["code"] == "LEASE_EXPIRED"
    _check_chain(events, job_id, str(job_id))


async def test_emit_refuses_bad_events_in_the_handler_and_bounds_an_attempt(
    stack: Stack,
) -> None:
    job = await stack.client().submit("life.bad_emit", {})
    done = await stack.client().wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED
    assert done.result == {"problems": ["event_type", "payload", "payload", "payload", "count"]}
    await all_published(stack)
    count = await stack.scalar("SELECT count(*) FROM events WHERE event_type = 'thing.many'")
    assert count == MAX_EMITTED_EVENTS


async def test_with_lifecycle_events_off_a_job_publishes_none(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    MACHINE.set_lifecycle_events(False)
    try:
        running = await start_stack(engine, database_url, amqp_url, topology, registry=registry)
        try:
            job = await running.client().submit("life.ok", {})
            done = await running.client().wait(job.name, timeout=30)
            assert done.state is JobState.SUCCEEDED
            await all_published(running)
            types = await running.scalar("SELECT array_agg(event_type ORDER BY seq) FROM events")
            # The handler's events still go with its success.
            assert types == ["thing.made", "thing.checked"]
            # The server's start told jobplane.submit_job the same.
            assert await running.scalar("SELECT lifecycle_events FROM submit_settings") is False
        finally:
            await running.close()
    finally:
        MACHINE.set_lifecycle_events(True)
