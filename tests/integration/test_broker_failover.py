"""Several AMQP addresses on the real broker: each reached through a proxy that can be cut."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aio_pika
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.broker_addresses import failover_of
from jobplane.client import JobState
from jobplane.topology import Topology
from tests.support.parts import Started
from tests.support.proxy import CuttableProxy
from tests.support.stack import eventually, start_stack


@pytest.fixture
async def two_nodes(amqp_url: str) -> AsyncIterator[tuple[CuttableProxy, CuttableProxy, str]]:
    """Two addresses of the run's broker (two proxies), and the setting naming both."""
    target = urlsplit(amqp_url)
    proxies = (
        CuttableProxy(target.hostname or "127.0.0.1", target.port or 5672),
        CuttableProxy(target.hostname or "127.0.0.1", target.port or 5672),
    )
    for proxy in proxies:
        await proxy.start()
    where = f"{target.hostname}:{target.port}"
    setting = ",".join(amqp_url.replace(where, f"127.0.0.1:{p.port}") for p in proxies)
    yield proxies[0], proxies[1], setting
    for proxy in proxies:
        await proxy.cut()


async def test_connect_passes_over_an_address_that_is_down(
    two_nodes: tuple[CuttableProxy, CuttableProxy, str],
) -> None:
    first, second, setting = two_nodes
    await first.cut()
    connection = await broker.connect(setting)
    async with connection:
        assert f":{second.port}/" in str(connection)
    assert failover_of(setting).order()[0] == setting.split(",")[1]


async def test_a_robust_connection_moves_to_the_next_address_and_keeps_consuming(
    two_nodes: tuple[CuttableProxy, CuttableProxy, str], amqp_url: str
) -> None:
    first, _second, setting = two_nodes
    connection = await broker.connect(setting, robust=True)
    assert isinstance(connection, broker.FailoverConnection)
    assert connection.address == setting.split(",")[0]
    received: asyncio.Queue[bytes] = asyncio.Queue()
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue("", exclusive=True)

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await message.ack()
            await received.put(message.body)

        await queue.consume(take)
        await first.cut()  # the node of the connection is lost
        await eventually(lambda: _on(connection, setting.split(",")[1]), timeout=15)
        # The consumer was restored on the other node: a message reaches it.
        # (An exclusive server-named queue is declared anew by the restore.)
        publisher = await broker.connect(amqp_url)
        async with publisher:
            sending = await publisher.channel()
            await sending.default_exchange.publish(
                aio_pika.Message(b"after the loss"), routing_key=queue.name
            )
        assert await asyncio.wait_for(received.get(), timeout=15) == b"after the loss"


async def _on(connection: broker.FailoverConnection, address: str) -> bool:
    return connection.address == address and connection.connected.is_set()


async def test_relay_and_worker_move_to_a_live_address_and_finish_every_job(
    engine: AsyncEngine,
    database_url: str,
    topology: Topology,
    started: Started,
    two_nodes: tuple[CuttableProxy, CuttableProxy, str],
) -> None:
    first, _second, setting = two_nodes
    stack = await started(start_stack(engine, database_url, setting, topology))
    client = stack.client()
    before = [await client.submit("demo.echo", {"i": i}) for i in range(10)]
    for job in before:
        assert (await asyncio.wait_for(client.wait(job.name), 30)).state is JobState.SUCCEEDED
    connects = stack.relay.connects if stack.relay is not None else 0
    await first.cut()
    after = [await client.submit("demo.echo", {"i": i}) for i in range(10)]
    for job in after:
        assert (await asyncio.wait_for(client.wait(job.name), 30)).state is JobState.SUCCEEDED
    assert stack.relay is not None and stack.relay.connects > connects
    assert failover_of(setting).order()[-1] == setting.split(",")[0]
