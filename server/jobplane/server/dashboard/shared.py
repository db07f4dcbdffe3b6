"""What the dashboard reads of the deployment, cached for a few seconds.

Queues and workers serve every tenant. A page shows a tenant only what reveals
no other tenant's data (ADR-0025): a queue's depth and consumers and a
worker's registration and load are aggregates over every tenant; rates and
failed messages are the tenant's own. Each figure is fetched at most once per
``ttl`` however many pages ask for it, and concurrent askers share one fetch.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

import aiormq
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.logs import describe_error
from jobplane.store.workers import WorkerRecord, WorkerStore
from jobplane.topology import Topology
from jobplane.workers.dlq import FailedMessage, FailedQueue, ReplayReport

log = structlog.get_logger("jobplane.server.dashboard")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Failed messages looked at per refresh (and per replay).
FAILED_SCAN = 1000
#: How often, at most, the failed queue is peeked, for every tenant together.
#: A peek takes messages unacknowledged and returns them; on RabbitMQ 4.0 and
#: later a quorum queue counts each return toward its delivery limit (20 by
#: default) and drops the message past it (docs/dashboard.md).
FAILED_SECONDS = 30.0
_ENTRIES = 10_000


class Cached(Generic[K, V]):
    """``fetch(key)``, kept ``ttl`` seconds; callers arriving meanwhile share one fetch."""

    def __init__(
        self,
        fetch: Callable[[K], Awaitable[V]],
        ttl: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._ttl = ttl
        self._clock = clock
        self._values: dict[K, tuple[float, V]] = {}
        self._pending: dict[K, asyncio.Future[V]] = {}

    async def get(self, key: K) -> V:
        """The value of ``key``, fetched when it is older than ``ttl``."""
        kept = self._values.get(key)
        if kept is not None and kept[0] > self._clock():
            return kept[1]
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._refresh(key))
            self._pending[key] = pending
        return await asyncio.shield(pending)

    async def _refresh(self, key: K) -> V:
        try:
            value = await self._fetch(key)
        finally:
            self._pending.pop(key, None)
        if len(self._values) >= _ENTRIES:
            self._values.clear()
        self._values[key] = (self._clock() + self._ttl, value)
        return value

    def replace(self, key: K, change: Callable[[V], V]) -> None:
        """Change the kept value of ``key`` in place (its age unchanged), if any."""
        kept = self._values.get(key)
        if kept is not None:
            self._values[key] = (kept[0], change(kept[1]))

    def forget(self, key: K) -> None:
        """Fetch ``key`` afresh next time."""
        self._values.pop(key, None)


@dataclass(frozen=True, slots=True)
class QueueFigures:
    """One queue as the broker counts it (every tenant's messages)."""

    name: str
    bindings: tuple[str, ...]
    messages: int | None  # None: the broker could not be asked
    consumers: int | None


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    """A registered worker and the attempts it runs now (every tenant's)."""

    record: WorkerRecord
    running: int


class Deployment:
    """The deployment-wide figures of the dashboard's pages."""

    def __init__(
        self,
        engine: AsyncEngine,
        amqp_url: str,
        topology: Topology,
        *,
        ttl: float = 5.0,
        failed_ttl: float = FAILED_SECONDS,
    ) -> None:
        self._engine = engine
        self._topology = topology
        self._amqp_url = amqp_url
        self._workers = WorkerStore(engine)
        self._failed = FailedQueue(amqp_url, topology)
        self.queues: Cached[str, list[QueueFigures]] = Cached(self._queues, ttl)
        self.workers: Cached[str, list[WorkerFigures]] = Cached(self._worker_figures, ttl)
        self.failed: Cached[str, list[FailedMessage]] = Cached(self._failed_messages, failed_ttl)

    async def _queues(self, _key: str) -> list[QueueFigures]:
        names = [(q.name, q.bindings) for q in self._topology.queues]
        names.append((self._topology.failed_queue, ()))
        try:
            counts = await self._broker_counts([n for n, _ in names])
        except Exception as exc:
            if not broker.broker_down(exc):
                raise
            log.warning("dashboard.queues.unavailable", error=describe_error(exc))
            counts = {}
        return [
            QueueFigures(name, bindings, *counts.get(name, (None, None)))
            for name, bindings in names
        ]

    async def _broker_counts(self, names: list[str]) -> dict[str, tuple[int, int]]:
        """Messages and consumers of each queue, by passive declares (nothing is created)."""
        counts: dict[str, tuple[int, int]] = {}
        connection = await broker.connect(self._amqp_url, timeout=5.0)
        async with connection:
            for name in names:
                # A passive declare of a missing queue closes its channel: one each.
                channel = await connection.channel()
                try:
                    declared = await channel.declare_queue(name, passive=True)
                except aiormq.exceptions.ChannelNotFoundEntity:
                    continue  # not declared yet: no figures
                result = declared.declaration_result
                counts[name] = (int(result.message_count or 0), int(result.consumer_count or 0))
                if not channel.is_closed:
                    await channel.close()
        return counts

    async def _worker_figures(self, _key: str) -> list[WorkerFigures]:
        records = await self._workers.list()
        running = await self._workers.running()
        return [WorkerFigures(r, running.get(str(r.id), 0)) for r in records]

    async def _failed_messages(self, _key: str) -> list[FailedMessage]:
        try:
            return await self._failed.list(FAILED_SCAN)
        except Exception as exc:
            if not broker.broker_down(exc):
                raise
            log.warning("dashboard.failed.unavailable", error=describe_error(exc))
            return []

    async def failed_of(self, tenant: uuid.UUID) -> list[FailedMessage]:
        """The tenant's messages among the first FAILED_SCAN of the failed queue, from
        the one snapshot every tenant's pages share (at most FAILED_SECONDS old)."""
        return [m for m in await self.failed.get("") if _of(m, tenant, None)]

    async def replay(self, tenant: uuid.UUID, jobs: frozenset[uuid.UUID] | None) -> ReplayReport:
        """Replay the tenant's failed messages (of ``jobs``, when given), as `dlq replay` does.

        The queue is read again only when the snapshot holds such a message: a
        replay of nothing costs the queue nothing. The replayed messages then
        leave the snapshot; it is not peeked afresh before its time.
        """
        if not [m for m in await self.failed.get("") if _of(m, tenant, jobs)]:
            return ReplayReport()
        report = await self._failed.replay(self._engine, FAILED_SCAN, tenant=tenant, jobs=jobs)
        gone = {*report.replayed, *report.finished, *report.waiting}
        self.failed.replace(
            "",
            lambda messages: [
                m for m in messages if not (_of(m, tenant, jobs) and _job_name(m) in gone)
            ],
        )
        return report


def _of(message: FailedMessage, tenant: uuid.UUID, jobs: frozenset[uuid.UUID] | None) -> bool:
    envelope = message.envelope
    return (
        envelope is not None
        and envelope.tenant_id == tenant
        and (jobs is None or envelope.job_id in jobs)
    )


def _job_name(message: FailedMessage) -> str:
    return f"jobs/{message.envelope.job_id}" if message.envelope is not None else ""
