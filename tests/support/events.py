"""Events for consumer tests: a side effect to count, and a stand-in for the relay.

The handler writes one row per run into ``event_effects``, which has no key
on the event: an event applied twice would leave two rows, so the row count
is what "applied once" means.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import aio_pika
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.events import Event, amqp_properties, encode, ensure_inbox

TENANT = uuid.UUID("5f0c4a3e-2b1d-4e6f-8a9b-0c1d2e3f4a5b")

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS event_effects (
    event_id   uuid NOT NULL,
    event_type text NOT NULL,
    pid        integer NOT NULL DEFAULT pg_backend_pid()
)
"""


async def prepare(engine: AsyncEngine) -> None:
    """The inbox and the side-effect table in the consumer's database."""
    await ensure_inbox(engine)
    async with engine.begin() as conn:
        await conn.execute(text(EFFECTS_DDL))


async def record_effect(event: Event, conn: AsyncConnection) -> None:
    """The side effect of one handler run, in the consumer's transaction."""
    await conn.execute(
        text("INSERT INTO event_effects (event_id, event_type) VALUES (:id, :type)"),
        {"id": event.event_id, "type": event.event_type},
    )


async def effects(engine: AsyncEngine) -> list[tuple[uuid.UUID, str]]:
    """Every committed side effect, oldest first."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT event_id, event_type FROM event_effects ORDER BY ctid")
        )
        return [(row[0], row[1]) for row in rows]


async def inbox_rows(engine: AsyncEngine, consumer: str) -> list[uuid.UUID]:
    """The event ids in ``consumer``'s inbox."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT event_id FROM jobplane_inbox WHERE consumer = :c ORDER BY received_at"),
            {"c": consumer},
        )
        return [row[0] for row in rows]


def event(event_type: str = "job.started", **payload: object) -> Event:
    """A fresh event of the test tenant."""
    return Event.new(event_type, dict(payload), tenant_id=TENANT)


async def publish(amqp_url: str, exchange: str, items: Iterable[Event | tuple[str, bytes]]) -> None:
    """Publish as the relay does (persistent, confirmed, the contract's properties).

    An ``(routing_key, body)`` pair is published as it is: a stray message.
    """
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        target = await channel.get_exchange(exchange, ensure=True)
        for item in items:
            if isinstance(item, Event):
                message = aio_pika.Message(encode(item), **amqp_properties(item))
                await target.publish(message, routing_key=item.event_type)
            else:
                routing_key, body = item
                await target.publish(aio_pika.Message(body), routing_key=routing_key)


async def take_all(amqp_url: str, queue: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message ready in ``queue``, acked (it is read to be looked at)."""
    taken = []
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        source = await channel.get_queue(queue, ensure=True)
        while (message := await source.get(fail=False)) is not None:
            await message.ack()
            taken.append(message)
    return taken
