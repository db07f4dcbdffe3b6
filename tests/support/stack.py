"""A whole jobplane (server, relay, worker) in the test's event loop, on real services."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobStore
from jobplane.client import AsyncClient
from jobplane.envelope import Envelope
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.server import JobplaneServer
from jobplane.store.db import Database
from jobplane.topology import Topology
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.handlers import Registry
from jobplane.workers.relay import Relay
from jobplane.workers.runtime import Worker
from tests.support.parts import Started


@dataclass
class Stack:
    """The running parts of one test's jobplane, and ways to look inside."""

    engine: AsyncEngine
    database_url: str
    amqp_url: str
    topology: Topology
    server: JobplaneServer
    key: str
    tenant_id: uuid.UUID
    relay: Relay | None = None
    worker: Worker | None = None
    blobs: BlobStore | None = None
    clients: list[AsyncClient] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)

    @property
    def db(self) -> Database:
        """The server's pool of the hot statements (ADR-0030), for stores a test makes."""
        return self.server.db

    def client(self, key: str | None = None, **kwargs: Any) -> AsyncClient:
        """An SDK client of this stack's server (closed with the stack)."""
        client = AsyncClient(self.server.address, key or self.key, **kwargs)
        self.clients.append(client)
        return client

    async def new_key(self, tenant: str) -> str:
        """An API key of another tenant."""
        key, _tenant = await self.server.keys.create_key(tenant)
        return key

    async def start_relay(self, amqp_url: str | None = None, **kwargs: Any) -> Relay:
        """Start a relay (to ``amqp_url``, default the run's vhost); ``kwargs`` go to
        :class:`Relay` (``fair=FairSettings(...)``, ``batch_size=``)."""
        kwargs.setdefault("poll_seconds", 0.2)
        relay = Relay(
            self.engine,
            self.database_url,
            amqp_url or self.amqp_url,
            self.topology,
            **kwargs,
        )
        await relay.start()
        self.relay = relay
        return relay

    async def start_worker(self, registry: Registry | None = None, **kwargs: Any) -> Worker:
        """Start a worker with ``registry`` (default: the demo handlers); ``worker`` is the last."""
        kwargs.setdefault("lease_seconds", 5.0)
        kwargs.setdefault("retry_base_delay", 0.05)
        kwargs.setdefault("presence_interval", 0.5)
        kwargs.setdefault("handback_delay", 0.05)
        kwargs.setdefault("handback_max_delay", 0.5)
        kwargs.setdefault("blobs", self.blobs)
        worker = Worker(
            self.engine,
            self.database_url,
            self.amqp_url,
            self.topology,
            registry or demo_registry,
            **kwargs,
        )
        await worker.start()
        self.worker = worker
        self.workers.append(worker)
        return worker

    async def scalar(self, sql: str, **params: Any) -> Any:
        """One value from the test database."""
        async with self.engine.connect() as conn:
            return (await conn.execute(text(sql), params)).scalar()

    async def envelope(self, job_id: str) -> Envelope:
        """The dispatch message the job's current outbox row stands for."""
        dispatch = await self.scalar("SELECT dispatch_id FROM jobs WHERE id = :id", id=job_id)
        job_type = await self.scalar("SELECT type FROM jobs WHERE id = :id", id=job_id)
        return Envelope(uuid.UUID(str(dispatch)), uuid.UUID(job_id), self.tenant_id, job_type)

    async def counts(self) -> dict[str, int]:
        """Rows in jobs, job_events and outbox (its job dispatches; events are counted apart)."""
        tables = {"jobs": "jobs", "job_events": "job_events"}
        tables["outbox"] = "outbox WHERE kind = 'job.dispatch'"
        return {
            name: int(await self.scalar(f"SELECT count(*) FROM {table}"))
            for name, table in tables.items()
        }

    async def close(self) -> None:
        """Stop everything that was started."""
        for client in self.clients:
            await client.close()
        for worker in self.workers:
            await worker.stop(grace=2.0)
        if self.relay is not None:
            await self.relay.stop()
        await self.server.stop(grace=0.5)


async def start_stack(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    *,
    relay: bool = True,
    worker: bool = True,
    registry: Registry | None = None,
    faults: FaultPoints = NO_FAULTS,
    listen: str = "127.0.0.1:0",
    worker_options: dict[str, Any] | None = None,
    blobs: BlobStore | None = None,
    relay_options: dict[str, Any] | None = None,
) -> Stack:
    """Start server (and relay, worker unless told not to) on real services."""
    server = JobplaneServer(
        engine,
        database_url,
        topology,
        listen=listen,
        faults=faults,
        recheck_seconds=2.0,
        blobs=blobs,
    )
    await server.start()
    key, tenant_id = await server.keys.create_key("acme")
    stack = Stack(engine, database_url, amqp_url, topology, server, key, tenant_id, blobs=blobs)
    try:
        if relay:
            await stack.start_relay(**(relay_options or {}))
        if worker:
            await stack.start_worker(registry, **(worker_options or {}))
    except BaseException:
        await stack.close()
        raise
    return stack


async def eventually(
    check: Callable[[], Awaitable[bool]], *, timeout: float = 10.0, interval: float = 0.05
) -> None:
    """Wait until ``check()`` is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if await check():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


async def one_running_per_tenant(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> Stack:
    """A server alone whose first queue runs one job per tenant at once."""
    queue = replace(topology.queues[0], max_running_per_tenant=1)
    spec = replace(topology, queues=(queue, *topology.queues[1:]))
    return await started(
        start_stack(engine, database_url, amqp_url, spec, relay=False, worker=False)
    )
