"""The worker's consumers (ADR-0055) outlive a consumer the broker cancelled.

The worker consumes through aiormq, so aio-pika does not restore its
consumers: the worker does, when a channel reopens (the failover tests) and
when the broker cancels one, as it does for every consumer of a queue that is
deleted. Once the queue is back, the worker consumes it again.
"""

from __future__ import annotations

import asyncio

from jobplane import broker
from jobplane.client import JobState
from jobplane.topology import declare
from tests.support.stack import Stack, eventually


async def test_a_consumer_the_broker_cancelled_consumes_again_once_its_queue_is_back(
    stack: Stack,
) -> None:
    client = stack.client()
    first = await client.submit("demo.echo", {})
    assert (await asyncio.wait_for(client.wait(first.name), timeout=30)).state is JobState.SUCCEEDED
    assert stack.worker is not None and stack.worker.not_ready() is None

    connection = await broker.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(stack.topology.queues[0].name)
        await asyncio.sleep(1.0)  # the worker finds no queue for a while
        channel = await connection.channel()
        await declare(channel, stack.topology)

    async def consumed() -> bool:
        return await _consumers(stack) == 1

    await eventually(consumed, timeout=20)
    second = await client.submit("demo.echo", {})
    done = await asyncio.wait_for(client.wait(second.name), timeout=30)
    assert done.state is JobState.SUCCEEDED


async def _consumers(stack: Stack) -> int:
    connection = await broker.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(stack.topology.queues[0].name, passive=True)
        assert queue.declaration_result.consumer_count is not None
        return queue.declaration_result.consumer_count
