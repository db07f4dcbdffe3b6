"""What the broker holds, asked over AMQP (the broker's own view, not a worker's)."""

from __future__ import annotations

import aio_pika
import aio_pika.abc

from jobplane.envelope import Envelope
from jobplane.topology import Topology
from jobplane.workers.dlq import FailedQueue


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


async def dead_letter(amqp_url: str, topology: Topology, *envelopes: Envelope) -> None:
    """Dead-letter ``envelopes``, in order, as the broker would."""
    await FailedQueue(amqp_url, topology).list()  # declares the topology
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        dlx = await channel.get_exchange(topology.dead_letter_exchange)
        for envelope in envelopes:
            message = aio_pika.Message(envelope.encode(), message_id=str(envelope.event_id))
            await dlx.publish(message, "")
