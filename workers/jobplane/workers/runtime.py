"""The worker runtime: consume, claim (fenced), run the handler, commit, then ack.

A message is acked only after the outcome of its attempt is committed, so a
worker that dies at any point leaves the message to be redelivered; the claim
decides what a redelivery does (run, wait, or ack a duplicate). A message of a
type this worker has no handler for is not claimed: the job is handed back
through the outbox, or parked when no live worker handles it (ADR-0007).
Whatever goes wrong while a message is handled, it ends acked or nacked.

Here: the :class:`Worker`, what it is made of and its start and stop. Its
parts: consuming deliveries (``delivery.py``), running a handler
attempt (``attempt.py``, ``running.py``) and recording its
outcome (``recording.py``). Each part is a base class of
:class:`Worker` holding its methods; the worker's constructor sets up the
state they share.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog
from aio_pika.abc import AbstractConnection
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.config import DEFAULT_DB_POOL_SIZE, DEFAULT_INLINE_BYTES, DEFAULT_WORKER_CONCURRENCY
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.lifecycle import Lifecycle
from jobplane.names import job_name
from jobplane.store.attempts import AttemptStore
from jobplane.store.db import Database
from jobplane.store.deployment import this_deployment
from jobplane.store.down import until_database_up
from jobplane.store.listen import Listener
from jobplane.store.rows import CANCEL_CHANNEL
from jobplane.topology import Ownership, Topology, ensure
from jobplane.workers.consumers import Consumers
from jobplane.workers.delivery import Deliveries
from jobplane.workers.group import DEFAULT_GROUP_MAX, DEFAULT_GROUP_WINDOW
from jobplane.workers.handlers import Registry
from jobplane.workers.interceptors import Interceptor, chain
from jobplane.workers.presence import Presence
from jobplane.workers.priority import Slots
from jobplane.workers.progress import ProgressFlusher
from jobplane.workers.running import Running, StopCause
from jobplane.workers.threads import HandlerThreads

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore

__all__ = ["StopCause", "Worker", "worker_pool_size"]

log = structlog.get_logger("jobplane.worker")


class Worker(Deliveries, Lifecycle):
    """Consumes the topology's queues and runs the registry's handlers.

    ``async with Worker(...) as worker:`` starts it and stops it with the
    default grace (or ``await start()``, then ``await stop(grace)``); :meth:`run`
    is a whole process's life.
    """

    # long: one keyword per setting of a worker, each kept as it is given
    def __init__(
        self,
        engine: AsyncEngine,
        database_url: str,
        amqp_url: str,
        topology: Topology,
        registry: Registry,
        *,
        concurrency: int = DEFAULT_WORKER_CONCURRENCY,
        prefetch: int | None = None,
        lease_seconds: float = 30.0,
        queues: list[str] | None = None,
        progress_window: float = 0.005,
        retry_base_delay: float | None = None,
        faults: FaultPoints = NO_FAULTS,
        presence_interval: float = 5.0,
        handback_delay: float = 0.5,
        handback_max_delay: float = 10.0,
        cancel_grace: float = 10.0,
        max_result_bytes: int = 256 * 1024,
        reserve: int | None = None,
        blobs: BlobStore | None = None,
        inline_bytes: int | None = None,
        interceptors: Sequence[Interceptor] = (),
        group_window: float = DEFAULT_GROUP_WINDOW,
        group_max: int = DEFAULT_GROUP_MAX,
        db: Database | None = None,
        sync_threads: int | None = None,
        listen_url: str | None = None,
    ) -> None:
        _check_sizes(concurrency, group_max, sync_threads)
        # Plain ``def`` handlers run in these threads; no more than the slots
        # by default, since a thread only ever runs a slot's handler.
        self._sync_threads = sync_threads or concurrency
        self._engine = engine
        # The attempts' statements run on asyncpg (ADR-0030): the caller's
        # pool, or one of the worker's own, opened and closed with it, no
        # larger than the settings' default pool (as the CLI's).
        self._owns_db = db is None
        size = min(DEFAULT_DB_POOL_SIZE, worker_pool_size(concurrency))
        self._db = db or Database(database_url, size=size)
        self._store = AttemptStore(self._db, lease_seconds=lease_seconds)
        self._amqp_url = amqp_url
        self._topology = topology
        self._registry = registry
        self._concurrency = concurrency
        self._prefetch = prefetch
        self._queues = queues or [q.name for q in topology.queues]
        self._slots = _slots(topology, self._queues, concurrency, reserve)
        self._progress = ProgressFlusher(self._store, window=progress_window)
        self._retry_base_delay = retry_base_delay
        self._faults = faults
        self._cancels = Listener(listen_url or database_url, CANCEL_CHANNEL)  # ADR-0048
        self._cancels.on_notify(self._on_cancel_notification)
        self._connection: AbstractConnection | None = None
        self.ownership: Ownership | None = None
        self._consumers = Consumers(self._on_message)
        self._tasks: set[asyncio.Task[None]] = set()
        self._running: dict[str, Running] = {}
        self._presence = Presence(
            engine,
            self._store,
            types=list(registry),
            queues=self._queues,
            concurrency=concurrency,
            interval=presence_interval,
        )
        self._handback_delay = handback_delay
        self._handback_max_delay = handback_max_delay
        self._cancel_grace = cancel_grace
        self._max_result_bytes = max_result_bytes
        # The object store handlers reach through ctx (the caller's; None: blobs disabled).
        self._blobs = blobs
        self._inline_bytes = _inline_limit(inline_bytes, max_result_bytes)
        # The registry's lifespans: entered at start, left at stop after the handlers.
        self._lifespans = contextlib.AsyncExitStack()
        # What the process observes of this worker (tracing, metrics): read
        # once at each seam, None when it observes nothing.
        self._intercept = intercept = chain(interceptors)
        self._claims, self._outcomes, self._acks = self._group_commit(group_window, group_max)
        if intercept is not None:
            intercept.known(self._slot_counts, topology, registry)

    def _slot_counts(self) -> tuple[int, int]:
        return (self._slots.running, self._concurrency) if self._consumers else (0, 0)

    def not_ready(self) -> str | None:
        """Why this worker does not take deliveries now (None: it does)."""
        connection = self._connection
        if connection is None or connection.is_closed or connection.transport is None:
            return "no broker connection"
        return None if self._consumers else "not consuming"

    @property
    def busy(self) -> bool:
        """True while any delivered message is still being handled."""
        return bool(self._tasks)

    @property
    def group_sizes(self) -> dict[str, dict[int, int]]:
        """How many claim and outcome groups of each size this worker wrote."""
        return {
            "claim": dict(self._claims.sizes) if self._claims else {},
            "outcome": dict(self._outcomes.sizes) if self._outcomes else {},
        }

    @property
    def acks_sent(self) -> dict[str, int]:
        """basic.ack frames sent through groups: with ``multiple`` and without."""
        acks = self._acks
        return {"multiple": acks.multiple, "single": acks.single} if acks else {}

    @property
    def running_jobs(self) -> list[str]:
        """Names of the jobs whose handlers run now."""
        return [job_name(k) for k in self._running]

    async def start(self) -> None:
        """Check the topology (declaring only what is missing) and start consuming.

        Waits while the broker or the database is down; raises
        :class:`TopologyMissing` when part of the topology is missing and this
        account may not declare it.
        """
        for name in self._queues:
            self._topology.queue(name)  # unknown queue names fail here, not later
        await self._db.open()
        # Threads start only when a plain handler first runs; daemons, so that
        # one given up on cannot keep the process from exiting.
        self._threads = HandlerThreads(self._sync_threads, thread_name_prefix="jobplane-handler")
        try:
            await self._enter_lifespans()
        except BaseException:
            await self._close_pools()
            raise
        try:
            self._deployment = await until_database_up(lambda: this_deployment(self._engine), log)
            await self._cancels.start()
        except BaseException:
            await self._lifespans.aclose()
            await self._close_pools()
            raise
        try:
            self.ownership = await broker.until_up(self._check_topology, log)
            self._connection = await broker.until_up(
                lambda: broker.connect(self._amqp_url, robust=True), log
            )
            self._bounce_channel = await self._connection.channel(publisher_confirms=True)
            # Registered before consuming: others park a job only when no live
            # worker handles its type, so a worker that consumes must be seen.
            await until_database_up(self._presence.start, log)
            await self._consumers.start(
                self._connection,
                [self._topology.queue(name) for name in self._queues],
                self._slots,
                prefetch=self._prefetch,
            )
        except BaseException:
            # Whatever started is stopped: a failed start leaves nothing running.
            await self._consumers.cancel()
            with contextlib.suppress(Exception):
                await self._presence.stop()
            if self._connection is not None:
                with contextlib.suppress(Exception):
                    await self._connection.close()
                self._connection = None
            await self._cancels.stop()
            await self._lifespans.aclose()
            await self._close_pools()
            raise
        log.info(
            "worker.started",
            worker=self.id,
            queues=self._queues,
            handlers=list(self._registry),
            concurrency=self._concurrency,
            prefetch=self._prefetch or {c: self._slots.prefetch(c) for c in self._slots.classes},
            reserve=self._slots.reserve,
            deployment=self._deployment.id,
        )

    async def _check_topology(self) -> Ownership:
        assert self._deployment is not None
        connection = await broker.connect(self._amqp_url)
        async with connection:
            return await ensure(connection, self._topology, self._deployment)

    async def stop(self, grace: float = 10.0) -> None:
        """Stop consuming; give running handlers ``grace`` seconds, then cancel them."""
        self._stopping = True
        await self._consumers.cancel()
        self._slots.close()  # deliveries waiting for a slot go back to their queue
        await self._presence.stop()
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            if pending:
                for running in list(self._running.values()):
                    running.stop(StopCause.SHUTDOWN)
                await asyncio.wait(pending, timeout=10)
        for batcher in (self._claims, self._outcomes, self._acks):
            if batcher is not None:
                # Bounded: a statement stuck on a lock must not hold the stop.
                await batcher.stop(timeout=10)
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
            self._connection = None
        await self._progress.stop()
        await self._cancels.stop()
        await self._lifespans.aclose()
        await self._close_pools()
        log.info("worker.stopped")

    async def _close_pools(self) -> None:
        """Close the worker's database pool (its own) and its handler threads."""
        if self._threads is not None:
            # Not joined: a handler thread given up on may never return. Its
            # threads are daemons, so the process still exits when it is done.
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        if self._owns_db:
            await self._db.close()

    async def _enter_lifespans(self) -> None:
        """Enter the registry's lifespans (what its handlers share); all or none."""
        try:
            for factory in self._registry.lifespans:
                await self._lifespans.enter_async_context(factory())
        except BaseException:
            await self._lifespans.aclose()
            raise


def worker_pool_size(concurrency: int) -> int:
    """Connections a worker's attempts use at most: concurrent groups, progress
    and heartbeats of ``concurrency`` handlers, between 4 and 20."""
    return max(4, min(concurrency, 20))


def _check_sizes(concurrency: int, group_max: int, sync_threads: int | None) -> None:
    """Refuse sizes no worker can run with, before anything is set up."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    if group_max < 1:
        raise ValueError("group_max must be at least 1")
    if sync_threads is not None and sync_threads < 1:
        raise ValueError("sync_threads must be at least 1")


def _slots(topology: Topology, queues: list[str], concurrency: int, reserve: int | None) -> Slots:
    """Handler slots across all the ``queues``, granted by queue priority."""
    specs = [q for q in topology.queues if q.name in queues]
    return Slots(concurrency, [q.priority for q in specs], reserve=reserve)


def _inline_limit(inline_bytes: int | None, max_result_bytes: int) -> int:
    """The largest result kept in its row (larger ones go to the object store):
    ``inline_bytes`` or the default, never above the largest result allowed."""
    return min(DEFAULT_INLINE_BYTES if inline_bytes is None else inline_bytes, max_result_bytes)
