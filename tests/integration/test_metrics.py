"""Metrics read at scrape time (outbox backlog, failed queue) and /readyz, on real
services: a relay that is stopped, a poison message, a broker that goes away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aio_pika
import aiohttp
import pytest
from prometheus_client import generate_latest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import AsyncClient
from jobplane.config import DEFAULT_WORKER_CONCURRENCY, ListenAddress
from jobplane.faults import FaultPoints, InjectedFault
from jobplane.observe.http import OpsServer, database_check
from jobplane.observe.metrics import (
    MAX_TYPE_LABELS,
    OTHER_TYPE,
    FailedQueueDepth,
    Metrics,
    RelayMetrics,
    WorkerMetrics,
    watch_outbox,
)
from jobplane.server import JobplaneServer
from jobplane.server.limits import TenantLimits
from jobplane.topology import Topology
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.relay import Relay
from jobplane.workers.runtime import Worker
from tests.integration.test_observability import samples, value
from tests.support.parts import Started
from tests.support.proxy import CuttableProxy
from tests.support.servers import Servers
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
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    ops: OpsServer,
    started: Started,
) -> None:
    watch_outbox(ops.metrics, engine)
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
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


async def test_the_failed_queue_depth_counts_a_dead_letter(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    ops: OpsServer,
    started: Started,
) -> None:
    depth = FailedQueueDepth(ops.metrics, amqp_url, topology.failed_queue)
    await started(start_stack(engine, database_url, amqp_url, topology, relay=False))
    started.callback(depth.close)
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
        interceptors=[WorkerMetrics(ops.metrics)],
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
        assert value(found, "jobplane_worker_slots", state="free") == DEFAULT_WORKER_CONCURRENCY
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


async def test_made_up_job_types_are_counted_as_other(
    engine: AsyncEngine, database_url: str, topology: Topology, started: Started
) -> None:
    metrics = Metrics()
    servers = await started(Servers(engine, database_url, topology))
    # 2,000 submits as fast as they go: past the default rate of a tenant.
    unlimited = TenantLimits(submits_per_second=0)
    server = await servers.start(metrics=metrics, limits=unlimited)
    key, _tenant = await server.keys.create_key("acme")
    client = servers.client(server, key)
    made_up = [f"made.up.t{n}" for n in range(2000)]
    for start in range(0, len(made_up), 100):
        await asyncio.gather(*(client.submit(t, {}) for t in made_up[start : start + 100]))
    found = samples((await metrics.exposition()).decode())
    submitted = {
        dict(labels)["type"]: count
        for (name, labels), count in found.items()
        if name == "jobplane_jobs_submitted_total"
    }
    # Every made-up type is one "other"; a type the topology names keeps its own.
    assert submitted.pop(OTHER_TYPE) == len(made_up)
    assert len(submitted) <= MAX_TYPE_LABELS
    assert not any(t.startswith("made.up.") for t in submitted)
    types = {dict(labels).get("type") for (_n, labels) in found}
    assert not any(t and t.startswith("made.up.") for t in types)


async def test_a_batch_counts_the_jobs_it_created_not_the_ones_it_replayed(
    engine: AsyncEngine, database_url: str, topology: Topology, started: Started
) -> None:
    metrics = Metrics()
    servers = await started(Servers(engine, database_url, topology))
    server = await servers.start(metrics=metrics)
    key, _tenant = await server.keys.create_key("acme")
    client = servers.client(server, key)
    await client.submit("demo.echo", {"n": 0}, request_id="r-0")
    await client.submit_many(
        [{"type": "demo.echo", "payload": {"n": n}, "request_id": f"r-{n}"} for n in range(3)]
    )
    found = samples((await metrics.exposition()).decode())
    submitted = sum(
        count for (name, labels), count in found.items() if name == "jobplane_jobs_submitted_total"
    )
    assert submitted == 3, found  # r-0 once, r-1 and r-2: the batch's r-0 was a replay


async def test_a_retry_scheduled_for_later_is_not_a_backlog(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    ops: OpsServer,
    started: Started,
) -> None:
    watch_outbox(ops.metrics, engine)
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    job = await stack.client().submit("demo.echo", {})
    # Its rows as a retry's dispatch is: written ten minutes ago, due in an hour.
    async with engine.begin() as conn:
        moved = await conn.execute(
            text(
                "UPDATE outbox SET create_time = now() - interval '10 minutes', "
                "available_at = now() + interval '1 hour' "
                "WHERE job_id = :job AND published_at IS NULL"
            ),
            {"job": uuid.UUID(job.name.removeprefix("jobs/"))},
        )
    assert moved.rowcount >= 1
    found = await _scrape(ops)
    assert value(found, "jobplane_outbox_backlog_rows") == 0
    assert value(found, "jobplane_outbox_oldest_age_seconds") == 0
    assert value(found, "jobplane_outbox_scheduled_rows") == moved.rowcount
    # Due a minute ago: now it is a backlog, a minute old.
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE outbox SET available_at = now() - interval '1 minute'"))
    found = await _scrape(ops)
    assert value(found, "jobplane_outbox_backlog_rows") == moved.rowcount
    assert 60 <= value(found, "jobplane_outbox_oldest_age_seconds") < 120
    assert value(found, "jobplane_outbox_scheduled_rows") == 0


async def test_readyz_waits_for_the_grpc_port_and_fails_from_its_drain(
    engine: AsyncEngine, database_url: str, topology: Topology, ops: OpsServer
) -> None:
    server = JobplaneServer(engine, database_url, topology, listen="127.0.0.1:0")
    ops.add_check("grpc", server.not_ready)
    status, body = await _get(ops, "/readyz")
    assert (status, json.loads(body)["not_ready"]) == (503, {"grpc": "not serving"})
    await server.start()
    stopping: asyncio.Task[None] | None = None
    try:
        status, body = await _get(ops, "/readyz")
        assert status == 200, body
        # A watch stays open into the drain.
        key, _tenant = await server.keys.create_key("acme")
        async with AsyncClient(server.address, key) as client:
            job = await client.submit("demo.echo", {})
            events = client.watch(job.name)
            await anext(events)
            stopping = asyncio.create_task(server.stop(grace=2.0))
            await asyncio.sleep(0)
            status, body = await _get(ops, "/readyz")
            assert not stopping.done()
            assert (status, json.loads(body)["not_ready"]) == (503, {"grpc": "not serving"})
            await events.aclose()
        await stopping
        assert (await _get(ops, "/readyz"))[0] == 503
    finally:
        if stopping is None:
            await server.stop(grace=0.5)


async def test_a_queue_without_consumers_shows_its_messages(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    ops: OpsServer,
    started: Started,
) -> None:
    queue = topology.queues[0].name
    depth = FailedQueueDepth(
        ops.metrics, amqp_url, topology.failed_queue, [q.name for q in topology.queues]
    )
    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    started.callback(depth.close)
    await stack.client().submit("demo.echo", {})

    async def waiting() -> bool:
        found = await _scrape(ops)
        return value(found, "jobplane_queue_messages", queue=queue) >= 1

    await eventually(waiting)
    found = await _scrape(ops)
    assert value(found, "jobplane_queue_consumers", queue=queue) == 0
    assert ("jobplane_queue_messages", frozenset({("queue", queue)})) in found
    await stack.start_worker()

    async def consumed() -> bool:
        found = await _scrape(ops)
        return (
            value(found, "jobplane_queue_consumers", queue=queue) >= 1
            and value(found, "jobplane_queue_messages", queue=queue) == 0
        )

    await eventually(consumed)


async def test_overlapping_scrapes_share_one_broker_connection(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from jobplane import broker

    # The relay declares the topology.
    stack = await start_stack(engine, database_url, amqp_url, topology, worker=False)

    opened: list[object] = []
    real = broker.connect

    async def counted(url: str, **kwargs: Any) -> Any:
        connection = await real(url, **kwargs)
        opened.append(connection)
        return connection

    monkeypatch.setattr(broker, "connect", counted)
    metrics = Metrics()
    depth = FailedQueueDepth(
        metrics, amqp_url, topology.failed_queue, [q.name for q in topology.queues]
    )
    try:
        await asyncio.gather(*(metrics.refresh() for _ in range(5)))
        assert len(opened) == 1
        # A read cancelled mid-way leaves the one connection usable, not a second one.
        scrape = asyncio.create_task(depth.read())
        await asyncio.sleep(0)
        scrape.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scrape
        await depth.read()
        assert len(opened) == 1
        assert metrics.scrape_errors.labels("failed_queue")._value.get() == 0
    finally:
        await depth.close()
        await stack.close()
    assert all(c.is_closed for c in opened)  # type: ignore[attr-defined]


class _FailOnce(FaultPoints):
    """``relay.after_confirm`` raises at its first hit only: a record that never ran."""

    def __init__(self) -> None:
        super().__init__(["relay.after_confirm"])
        self.fired = 0

    def hit(self, name: str) -> None:
        if name == "relay.after_confirm" and not self.fired:
            self.fired += 1
            raise InjectedFault(name)


async def test_a_batch_published_again_is_counted_once(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    stack = await start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    metrics, faults = Metrics(), _FailOnce()
    relay = Relay(
        engine,
        database_url,
        amqp_url,
        topology,
        poll_seconds=0.2,
        faults=faults,
        interceptors=[RelayMetrics(metrics)],
    )
    try:
        await stack.client().submit("demo.echo", {})
        await relay.start()

        async def published() -> bool:
            async with engine.connect() as conn:
                left = await conn.scalar(
                    text("SELECT count(*) FROM outbox WHERE published_at IS NULL")
                )
            return bool(left == 0)

        await eventually(published)
        async with engine.connect() as conn:
            rows = await conn.scalar(text("SELECT count(*) FROM outbox"))
    finally:
        await relay.stop()
        await stack.close()
    assert faults.fired == 1
    found = samples(generate_latest(metrics.registry).decode())
    confirmed = sum(
        count
        for (name, labels), count in found.items()
        if name == "jobplane_relay_published_total"
        and ("outcome", "confirmed") in labels
        and ("kind", "event_feed") not in labels
    )
    assert confirmed == rows


async def test_the_schedule_lag_shows_a_schedule_nothing_ticks(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    ops: OpsServer,
    started: Started,
) -> None:
    watch_outbox(ops.metrics, engine)
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    schedule = await stack.client().create_schedule("demo.echo", interval=3600)
    assert value(await _scrape(ops), "jobplane_schedule_lag_seconds") == 0
    async with engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE schedules SET next_run_time = now() - interval '90 seconds' WHERE id = :id"
            ),
            {"id": schedule.id},
        )
    assert 90 <= value(await _scrape(ops), "jobplane_schedule_lag_seconds") < 150
