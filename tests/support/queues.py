"""What the broker holds, asked over AMQP (the broker's own view, not a worker's)."""

from __future__ import annotations

import aio_pika
import aio_pika.abc


async def ready_count(amqp_url: str, queue: str) -> int:
    """Messages in ``queue`` waiting for a consumer (delivered, unacked ones are not counted)."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def publish_raw(amqp_url: str, exchange: str, routing_key: str, body: bytes) -> None:
    """Publish ``body`` as a duplicate or stray message would arrive (confirmed by the broker)."""
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel: aio_pika.abc.AbstractChannel = await connection.channel()
        target = await channel.get_exchange(exchange)
        await target.publish(aio_pika.Message(body), routing_key=routing_key)
