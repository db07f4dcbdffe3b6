"""One pass of the relay's outbox (``relay_once``, what ``jobplane relay --once``
runs each round), in this process on real Postgres and RabbitMQ.

A pass claims up to a batch of due dispatches and a batch of the other rows,
publishes each where it goes (a dispatch to the jobs exchange, to its job
type's queue; an event to the events exchange), marks the confirmed rows
published, and says how many rows it took; the rows beyond the batch stay
due for the next pass, and a pass with nothing due takes nothing.
"""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import JobSpec
from jobplane.events import Event
from jobplane.events.envelope import encode
from jobplane.topology import Topology
from jobplane.workers.relay import FairSettings, Relay
from tests.support.event_api import bound_queue
from tests.support.events import take_all
from tests.support.parts import Started
from tests.support.queues import ready_count
from tests.support.stack import Stack, start_stack

_EVENT_ROW = text(
    "INSERT INTO outbox (id, tenant_id, kind, routing_key, correlation_id, body, headers) "
    "VALUES (:id, :tenant, 'event', :type, '', :body, CAST('{}' AS jsonb))"
)
# Each dispatch row's fate: published or not, and how many times it was claimed.
_DISPATCHES = (
    "SELECT count(*) FILTER (WHERE published_at IS NOT NULL), "
    "count(*) FILTER (WHERE published_at IS NULL), max(publish_attempts) "
    "FROM outbox WHERE kind = 'job.dispatch'"
)


async def _dispatches(stack: Stack) -> tuple[int, int, int]:
    async with stack.engine.connect() as conn:
        published, due, attempts = (await conn.execute(text(_DISPATCHES))).one()
        return int(published), int(due), int(attempts or 0)


async def test_a_pass_publishes_a_batch_where_each_row_goes_and_marks_it_published(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    queue = topology.queues[0].name
    jobs = await stack.client().submit_many([JobSpec("demo.echo", {"i": i}) for i in range(5)])
    assert len(jobs) == 5
    event = Event.new("artifact.created", {"n": 1}, tenant_id=stack.tenant_id)
    body = encode(event)
    event_row = uuid.uuid4()
    async with engine.begin() as conn:
        await conn.execute(
            _EVENT_ROW,
            {"id": event_row, "tenant": stack.tenant_id, "type": event.event_type, "body": body},
        )
    # Fair dispatch off: the queue has no consumer, and its credit would cut the batch.
    relay = Relay(
        engine,
        database_url,
        amqp_url,
        topology,
        batch_size=3,
        fair=FairSettings(enabled=False),
        db=stack.db,
    )
    link = await relay._open()  # checks the topology, as a pass's caller does first
    try:
        async with bound_queue(amqp_url, topology.events_exchange, ["artifact.#"]) as (name, _):
            # Three dispatches (the batch) and the event row (the other rows' part).
            assert await relay.relay_once(link.exchange, link.events) == 4
            assert await _dispatches(stack) == (3, 2, 1)
            assert await stack.scalar(
                "SELECT published_at IS NOT NULL FROM outbox WHERE id = :id", id=event_row
            )
            assert await ready_count(amqp_url, queue) == 3
            (published,) = await take_all(amqp_url, name)
            assert published.message_id == str(event.event_id)
            assert published.routing_key == event.event_type
            assert published.body == body
            assert relay.published == 4

            # The rest of the dispatches, then nothing is due.
            assert await relay.relay_once(link.exchange, link.events) == 2
            assert await _dispatches(stack) == (5, 0, 1)
            assert await relay.relay_once(link.exchange, link.events) == 0
            assert await take_all(amqp_url, name) == []
    finally:
        await link.close()
    assert relay.published == 6 and relay.failed == 0
    # Each job's dispatch reached its queue once, as the job's own message.
    messages = await take_all(amqp_url, queue)
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT id, job_id FROM outbox WHERE kind = 'job.dispatch' ORDER BY id")
        )
        expected = sorted((str(row.id), str(row.job_id)) for row in rows)
    assert sorted((m.message_id, (m.headers or {}).get("job_id")) for m in messages) == expected
    assert {str(job_id) for _, job_id in expected} == {job.id for job in jobs}
