"""Metrics read at scrape time (outbox backlog, failed queue) and /readyz, on real
services: a relay that is stopped, a poison message, a broker that goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aio_pika
import aiohttp
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.config import ListenAddress
from jobplane.observe.http import OpsServer, database_check
from jobplane.observe.metrics import FailedQueueDepth, Metrics, watch_outbox
from jobplane.topology import Topology
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.runtime import Worker
from tests.integration.test_observability import samples, value
from tests.support.proxy import CuttableProxy
from tests.support.stack import eventually, start_stack


@pytest.fixture
async def ops(engine: AsyncEngine) -> AsyncIterator[OpsServer]:
    metrics = Metrics()
    metrics.add_pool(engine)
    server = OpsServer(ListenAddress("127.0.0.1", 0), metrics)
    server.add_check("database", database_check(engine))
    await server.start()
    yield server
    await server.stop()


async def _get(ops: OpsServer, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{ops.address}{path}") as response,
    ):
        return response.status, await response.text()


async def _scrape(ops: OpsServer) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    status, body = await _get(ops, "/metrics")
    assert status == 200
    return samples(body)


async def test_the_outbox_backlog_shows_while_no_relay_runs(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, ops: OpsServer
) -> None:
    watch_outbox(ops.metrics, engine)
    stack = await start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    try:
        client = stack.client()
        for n in range(3):
            await client.submit("demo.echo", {"n": n})
        await asyncio.sleep(0.3)
        found = await _scrape(ops)
        assert value(found, "jobplane_outbox_backlog_rows") == 3
        assert value(found, "jobplane_outbox_oldest_age_seconds") >= 0.3
        await stack.start_relay()

        async def drained() -> bool:
            found = await _scrape(ops)
            backlog = value(found, "jobplane_outbox_backlog_rows")
            return backlog == 0 and value(found, "jobplane_outbox_oldest_age_seconds") == 0

        await eventually(drained)
    finally:
        await stack.close()


async def test_the_failed_queue_depth_counts_a_dead_letter(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, ops: OpsServer
) -> None:
    depth = FailedQueueDepth(ops.metrics, amqp_url, topology.failed_queue)
    stack = await start_stack(engine, database_url, amqp_url, topology, relay=False)
    try:
        found = await _scrape(ops)
        assert value(found, "jobplane_failed_queue_messages", queue=topology.failed_queue) == 0
        # A message no envelope decodes from: the worker rejects it to the dead letters.
        connection = await aio_pika.connect(amqp_url)
        async with connection:
            channel = await connection.channel()
            exchange = await channel.get_exchange(topology.exchange)
            await exchange.publish(aio_pika.Message(b"not an envelope"), routing_key="demo.echo")

        async def dead_lettered() -> bool:
            found = await _scrape(ops)
            return value(found, "jobplane_failed_queue_messages", queue=topology.failed_queue) == 1

        await eventually(dead_lettered)
    finally:
        await depth.close()
        await stack.close()


async def test_readyz_names_the_broker_while_it_is_unreachable(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, ops: OpsServer
) -> None:
    target = urlsplit(amqp_url)
    assert target.hostname is not None and target.port is not None
    proxy = CuttableProxy(target.hostname, target.port)
    await proxy.start()
    proxied = amqp_url.replace(f"{target.hostname}:{target.port}", f"127.0.0.1:{proxy.port}")
    worker = Worker(
        engine,
        database_url,
        proxied,
        topology,
        demo_registry,
        lease_seconds=5.0,
        metrics=ops.metrics,
    )
    ops.add_check("broker", worker.not_ready)
    status, body = await _get(ops, "/readyz")
    assert status == 503
    assert json.loads(body)["not_ready"] == {"broker": "no broker connection"}
    await worker.start()
    try:
        status, body = await _get(ops, "/readyz")
        assert status == 200, body
        found = await _scrape(ops)
        assert value(found, "jobplane_worker_slots", state="free") == 8
        await proxy.cut()

        async def not_ready() -> bool:
            status, body = await _get(ops, "/readyz")
            return status == 503 and "broker" in json.loads(body)["not_ready"]

        await eventually(not_ready)
        assert (await _get(ops, "/livez"))[0] == 200
        await proxy.start()

        async def ready() -> bool:
            return (await _get(ops, "/readyz"))[0] == 200

        await eventually(ready, timeout=30)
    finally:
        await worker.stop(grace=1.0)
        await proxy.cut()


async def test_a_taken_port_is_refused_by_name(engine: AsyncEngine, ops: OpsServer) -> None:
    host, port = ops.address.rsplit(":", 1)
    second = OpsServer(ListenAddress(host, int(port)), Metrics())
    with pytest.raises(Exception, match=r"JOBPLANE_METRICS_LISTEN: 127\.0\.0\.1:\d+ is in use"):
        await second.start()
