"""Prometheus metrics of one process, in a registry of its own (ADR-0023).

Every part of a process (server, relay, worker, sweeper) counts into the
:class:`Metrics` it is given; ``jobplane dev`` gives all of its parts the same
one, and one ops listener (:mod:`jobplane.observe.http`) serves it. Tests make
one per stack, so nothing is registered twice and no count leaks between them.

Labels are few and bounded: job type, queue, outcome, kind, state. Never a job
id, a tenant id or an error message. A job type is a label only when this
process knows it (:meth:`Metrics.know_types`, :meth:`Metrics.know_topology`):
a type of the topology, of a registered handler or of a connected worker, at
most :data:`MAX_TYPE_LABELS` of them; any other type is counted as
:data:`OTHER_TYPE`, so tenant-chosen types cannot grow the registry.

What needs a database or broker read (the outbox backlog, the failed queue's
depth) is read at scrape time by the refreshers the parts register
(:meth:`Metrics.on_scrape`), never per job. What the process already knows
(slots, pool, open streams) is read at scrape time too, so the hot paths only
ever increment a counter or observe a histogram.

:data:`NO_METRICS` counts nothing: what a part uses when it is given none,
and what ``JOBPLANE_METRICS_LISTEN=off`` gives every part.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import structlog

# The outcomes of an attempt (the ``outcome`` label), named where attempts end.
from jobplane.attempt_end import ADVANCED, RETRY

if TYPE_CHECKING:
    from aio_pika.abc import AbstractIncomingMessage
    from prometheus_client import CollectorRegistry
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.envelope import Envelope
    from jobplane.store.attempts import Attempt, ClaimResult
    from jobplane.store.machine import Transition
    from jobplane.topology import Topology
    from jobplane.workers.sweeper import SweepReport

log = structlog.get_logger("jobplane.metrics")


#: Seconds: from a millisecond to an hour (run times, waits).
_DURATION_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)
#: Seconds: a broker's confirm, normally milliseconds.
_CONFIRM_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 10.0)
#: How long one scrape waits for a refresher (a database or broker read).
REFRESH_TIMEOUT = 2.0

Refresher = Callable[[], Awaitable[None]]

#: The most job types a process labels its metrics with; later ones are OTHER_TYPE.
MAX_TYPE_LABELS = 500
#: The ``type`` label of a job type this process does not know.
OTHER_TYPE = "other"


def _exact(pattern: str) -> bool:
    """A binding that names one type (no AMQP wildcard word)."""
    return all(word not in ("*", "#") for word in pattern.split("."))


class Metrics:
    """The metrics of one process and the registry they are in."""

    enabled = True

    def __init__(self) -> None:
        # Imported here: a worker without the metrics extra (ADR-0033) uses
        # NO_METRICS and never builds one.
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self._refreshers: list[tuple[str, Refresher]] = []
        self._slots: list[Callable[[], tuple[int, int]]] = []
        self._streams: list[Callable[[], int]] = []
        self._pools: list[AsyncEngine] = []
        self._started: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._ended: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._children: dict[tuple[str, str, str], Any] = {}
        self._types: set[str] = set()
        job = ("type", "queue")
        self.jobs_submitted = Counter(
            "jobplane_jobs_submitted_total",
            "Jobs created by SubmitJob (an idempotent repeat is not counted).",
            job,
            registry=registry,
        )
        self.jobs_started = Counter(
            "jobplane_jobs_started_total",
            "Jobs whose first attempt started.",
            job,
            registry=registry,
        )
        self.job_attempts = Counter(
            "jobplane_job_attempts_total",
            "Attempts started (first attempts and retries).",
            job,
            registry=registry,
        )
        self.job_retries = Counter(
            "jobplane_job_retries_total",
            "Attempts that ended in a scheduled retry.",
            job,
            registry=registry,
        )
        self.jobs_finished = Counter(
            "jobplane_jobs_finished_total",
            "Jobs whose attempt ended them: outcome completed, failed or cancelled.",
            (*job, "outcome"),
            registry=registry,
        )
        self.stages_advanced = Counter(
            "jobplane_stages_advanced_total",
            "Pipeline stages before the last that completed (the job runs its next stage).",
            job,
            registry=registry,
        )
        self.job_wait = Histogram(
            "jobplane_job_queue_wait_seconds",
            "From submit to the start of the first attempt.",
            job,
            buckets=_DURATION_BUCKETS,
            registry=registry,
        )
        self.job_run = Histogram(
            "jobplane_job_run_seconds",
            "Run time of an attempt's handler, by how the attempt ended.",
            (*job, "outcome"),
            buckets=_DURATION_BUCKETS,
            registry=registry,
        )
        self.watch_streams = Gauge(
            "jobplane_watch_streams_open",
            "WatchJob and SubscribeEvents streams open on this server.",
            registry=registry,
        )
        self.outbox_backlog = Gauge(
            "jobplane_outbox_backlog_rows",
            "Outbox rows due and not published yet (read at scrape time).",
            registry=registry,
        )
        self.outbox_oldest = Gauge(
            "jobplane_outbox_oldest_age_seconds",
            "How long the longest-due unpublished outbox row has been due; 0 when none is.",
            registry=registry,
        )
        self.outbox_scheduled = Gauge(
            "jobplane_outbox_scheduled_rows",
            "Outbox rows not due yet: scheduled retries (read at scrape time).",
            registry=registry,
        )
        self.jobs_waiting = Gauge(
            "jobplane_jobs_waiting",
            "QUEUED jobs that wait for a known reason, by its code (e.g. UNROUTABLE: the "
            "broker has no route for their dispatch), read at scrape time.",
            ("code",),
            registry=registry,
        )
        self.relay_published = Counter(
            "jobplane_relay_published_total",
            "Outbox rows the relay handed to the broker, by what the broker did "
            "(confirmed, failed, returned, unpublishable).",
            ("kind", "outcome"),
            registry=registry,
        )
        self.relay_confirm = Histogram(
            "jobplane_relay_confirm_seconds",
            "From a batch's publish to the broker's last confirm of it.",
            buckets=_CONFIRM_BUCKETS,
            registry=registry,
        )
        self.relay_dispatch = Histogram(
            "jobplane_relay_publish_seconds",
            "From a batch's claim to its record committed (publish, confirm, mark).",
            buckets=_CONFIRM_BUCKETS,
            registry=registry,
        )
        self.sweeper_repairs = Counter(
            "jobplane_sweeper_repairs_total",
            "What the sweeper repaired: leases requeued or failed, dispatches re-published.",
            ("kind",),
            registry=registry,
        )
        self.worker_slots = Gauge(
            "jobplane_worker_slots",
            "Handler slots of this process's workers, busy or free.",
            ("state",),
            registry=registry,
        )
        self.worker_groups = Histogram(
            "jobplane_worker_group_size",
            "Claims or outcomes a worker wrote together in one group (ADR-0028), by kind.",
            ("kind",),
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )
        self.submit_groups = Histogram(
            "jobplane_submit_group_size",
            "Concurrent SubmitJob calls a server wrote in one statement (ADR-0030).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )
        self.failed_queue = Gauge(
            "jobplane_failed_queue_messages",
            "Messages in the failed (dead-letter) queue (read at scrape time).",
            ("queue",),
            registry=registry,
        )
        self.queue_messages = Gauge(
            "jobplane_queue_messages",
            "Ready messages in each queue of the topology (read at scrape time).",
            ("queue",),
            registry=registry,
        )
        self.queue_consumers = Gauge(
            "jobplane_queue_consumers",
            "Consumers of each queue of the topology (read at scrape time).",
            ("queue",),
            registry=registry,
        )
        self.db_pool = Gauge(
            "jobplane_db_pool_connections",
            "Database pool connections: in use, idle, and the pool's size.",
            ("state",),
            registry=registry,
        )
        self.scrape_errors = Counter(
            "jobplane_scrape_errors_total",
            "Scrape-time reads that failed or timed out (their gauges keep the last value).",
            ("source",),
            registry=registry,
        )

    # -- the job types it labels with ---------------------------------------

    def know_types(self, types: Iterable[str]) -> None:
        """Label metrics with these job types (up to :data:`MAX_TYPE_LABELS` in all)."""
        known = self._types
        for job_type in types:
            if len(known) >= MAX_TYPE_LABELS:
                return
            known.add(job_type)

    def know_topology(self, topology: Topology) -> None:
        """Know the topology's pipelines, stage types and exactly bound types."""
        self.know_types(p.name for p in topology.pipelines)
        self.know_types(s.type for p in topology.pipelines for s in p.stages)
        self.know_types(b for q in topology.queues for b in q.bindings if _exact(b))

    def type_label(self, job_type: str) -> str:
        """``job_type`` when known to this process, else :data:`OTHER_TYPE`."""
        return job_type if job_type in self._types else OTHER_TYPE

    # -- what the hot paths call: one increment or observation each -----------

    def attempt_started(
        self, job_type: str, queue: str, attempt: int, submitted: datetime | None
    ) -> None:
        """An attempt started; a first one counts as the job's start (and its wait)."""
        attempts, started, wait = self._started_children(self.type_label(job_type), queue)
        attempts.inc()
        if attempt == 1:
            started.inc()
            if submitted is not None:
                wait.observe(max((datetime.now(UTC) - submitted).total_seconds(), 0.0))

    def attempt_ended(
        self, job_type: str, queue: str, outcome: str, seconds: float | None = None
    ) -> None:
        """An attempt ended: ``completed``, ``advanced`` (a pipeline stage before the
        last), ``failed``, ``cancelled`` or ``retry_scheduled``."""
        counter, run = self._ended_children(self.type_label(job_type), queue, outcome)
        counter.inc()
        if seconds is not None:
            run.observe(seconds)

    def submitted(self, job_type: str, queue: str) -> None:
        """A job was created by SubmitJob."""
        label = self.type_label(job_type)
        key = ("submitted", label, queue)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.jobs_submitted.labels(label, queue)
        child.inc()

    def grouped(self, kind: str, size: int) -> None:
        """A worker wrote a group of ``size`` claims or outcomes (``kind``) together."""
        key = ("grouped", kind, "")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.worker_groups.labels(kind)
        child.observe(size)

    def submit_grouped(self, size: int) -> None:
        """A server wrote ``size`` concurrent submits in one statement."""
        self.submit_groups.observe(size)

    def relayed(self, kind: str, outcome: str, count: int = 1) -> None:
        """``count`` outbox rows of ``kind`` handed to the broker, with ``outcome``."""
        key = ("relayed", kind, outcome)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.relay_published.labels(kind, outcome)
        child.inc(count)

    # The labelled children of the per-job metrics, looked up once per type and
    # queue (labels() takes a lock and builds a key each call). Bounded: the
    # type is a known one or OTHER_TYPE, the queue one of the topology's.
    def _started_children(self, job_type: str, queue: str) -> tuple[Any, Any, Any]:
        key = (job_type, queue)
        found = self._started.get(key)
        if found is None:
            found = self._started[key] = (
                self.job_attempts.labels(*key),
                self.jobs_started.labels(*key),
                self.job_wait.labels(*key),
            )
        return found

    def _ended_children(self, job_type: str, queue: str, outcome: str) -> tuple[Any, Any]:
        key = (job_type, queue, outcome)
        found = self._ended.get(key)
        if found is None:
            if outcome == RETRY:
                counter = self.job_retries.labels(job_type, queue)
            elif outcome == ADVANCED:
                counter = self.stages_advanced.labels(job_type, queue)
            else:
                counter = self.jobs_finished.labels(*key)
            found = self._ended[key] = (counter, self.job_run.labels(*key))
        return found

    def count_repairs(self, report: Any) -> None:
        """What a sweep (a :class:`~jobplane.workers.sweeper.SweepReport`) repaired."""
        for kind, count in (
            ("lease_requeued", report.requeued),
            ("lease_failed", report.failed),
            ("dispatch_republished", report.republished),
        ):
            if count:
                self.sweeper_repairs.labels(kind).inc(count)

    # -- what is read at scrape time ------------------------------------------

    def add_slots(self, read: Callable[[], tuple[int, int]]) -> None:
        """A worker's slots, ``read()`` = (busy, total); summed over the process's workers."""
        self._slots.append(read)

    def add_streams(self, read: Callable[[], int]) -> None:
        """A server's open watch streams; summed over the process's servers."""
        self._streams.append(read)

    def add_pool(self, engine: AsyncEngine) -> None:
        """A database engine whose pool is reported (an engine shared by parts once)."""
        if all(e is not engine for e in self._pools):
            self._pools.append(engine)

    def on_scrape(self, name: str, refresh: Refresher) -> None:
        """Run ``refresh`` before each scrape (``name`` labels its failures)."""
        if all(n != name for n, _r in self._refreshers):
            self._refreshers.append((name, refresh))

    def _read_process(self) -> None:
        busy = total = 0
        for read in self._slots:
            b, t = read()
            busy, total = busy + b, total + t
        self.worker_slots.labels("busy").set(busy)
        self.worker_slots.labels("free").set(total - busy)
        self.watch_streams.set(sum(read() for read in self._streams))
        used = idle = size = 0
        for engine in self._pools:
            pool: Any = engine.pool
            if all(hasattr(pool, m) for m in ("checkedout", "checkedin", "size")):
                used += pool.checkedout()
                idle += pool.checkedin()
                size += pool.size()
        self.db_pool.labels("in_use").set(used)
        self.db_pool.labels("idle").set(idle)
        self.db_pool.labels("size").set(size)

    async def refresh(self) -> None:
        """Read the process's own gauges, then run every refresher at once, each
        bounded by :data:`REFRESH_TIMEOUT`."""
        self._read_process()
        if not self._refreshers:
            return
        results = await asyncio.gather(
            *(asyncio.wait_for(r(), REFRESH_TIMEOUT) for _n, r in self._refreshers),
            return_exceptions=True,
        )
        for (name, _r), result in zip(self._refreshers, results, strict=False):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                self.scrape_errors.labels(name).inc()
                log.debug("metrics.refresh.failed", source=name, error=repr(result))

    async def exposition(self) -> bytes:
        """The Prometheus text of this process, refreshed."""
        from prometheus_client import generate_latest

        await self.refresh()
        return generate_latest(self.registry)


class _Null:
    """A metric that records nothing: every method is a no-op, labels() itself."""

    def labels(self, *_args: Any, **_kwargs: Any) -> _Null:
        return self

    def inc(self, *_args: Any) -> None:
        pass

    def dec(self, *_args: Any) -> None:
        pass

    def set(self, *_args: Any) -> None:
        pass

    def observe(self, *_args: Any) -> None:
        pass


class _NoMetrics(Metrics):
    """Counts nothing; serves nothing."""

    enabled = False

    def __init__(self) -> None:  # no registry: nothing is built
        null = cast("Any", _Null())
        self._refreshers, self._slots, self._streams, self._pools = [], [], [], []
        self._types = set()
        for name in (
            "jobs_submitted",
            "jobs_started",
            "job_attempts",
            "job_retries",
            "jobs_finished",
            "stages_advanced",
            "job_wait",
            "job_run",
            "watch_streams",
            "outbox_backlog",
            "outbox_oldest",
            "outbox_scheduled",
            "jobs_waiting",
            "relay_published",
            "relay_confirm",
            "relay_dispatch",
            "sweeper_repairs",
            "worker_slots",
            "worker_groups",
            "submit_groups",
            "failed_queue",
            "queue_messages",
            "queue_consumers",
            "db_pool",
            "scrape_errors",
        ):
            setattr(self, name, null)

    def attempt_started(
        self, job_type: str, queue: str, attempt: int, submitted: datetime | None
    ) -> None:
        pass

    def attempt_ended(
        self, job_type: str, queue: str, outcome: str, seconds: float | None = None
    ) -> None:
        pass

    def count_repairs(self, report: Any) -> None:
        pass

    def know_types(self, types: Iterable[str]) -> None:
        pass

    def submitted(self, job_type: str, queue: str) -> None:
        pass

    def relayed(self, kind: str, outcome: str, count: int = 1) -> None:
        pass

    def grouped(self, kind: str, size: int) -> None:
        pass

    def submit_grouped(self, size: int) -> None:
        pass

    def add_slots(self, read: Callable[[], tuple[int, int]]) -> None:
        pass

    def add_streams(self, read: Callable[[], int]) -> None:
        pass

    def add_pool(self, engine: AsyncEngine) -> None:
        pass

    def on_scrape(self, name: str, refresh: Refresher) -> None:
        pass

    async def refresh(self) -> None:
        pass


#: Counts nothing (metrics off, or a part given no metrics).
NO_METRICS: Metrics = _NoMetrics()


class WorkerMetrics:
    """A worker's :class:`~jobplane.workers.interceptors.Interceptor` that counts:
    its slots, groups and attempts into ``metrics``.

    Handed to the worker by the process that serves metrics (the CLI); the
    worker imports no metrics, and given none counts nothing.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def known(
        self, slots: Callable[[], tuple[int, int]], topology: Topology, types: Iterable[str]
    ) -> None:
        """The worker's slots as a gauge; its topology's and types' label values."""
        self.metrics.add_slots(slots)
        self.metrics.know_topology(topology)
        self.metrics.know_types(types)

    def delivered(
        self, headers: Mapping[str, Any] | None
    ) -> contextlib.AbstractContextManager[Any]:
        """Nothing to count around a delivery."""
        return _NO_BLOCK

    async def claim(
        self,
        envelope: Envelope,
        message: AbstractIncomingMessage,
        claim: Callable[[], Awaitable[ClaimResult]],
    ) -> ClaimResult:
        """The claim, uncounted (its attempt counts when it starts)."""
        return await claim()

    def applied(self, transition: Transition) -> None:
        """Nothing counts a transition."""

    def grouped(self, kind: str, size: int) -> None:
        """One group of ``size`` ``kind`` writes."""
        self.metrics.grouped(kind, size)

    def started(self, attempt: Attempt) -> None:
        """An attempt started (and, a first, the job with its wait)."""
        self.metrics.attempt_started(
            attempt.type, attempt.queue, attempt.attempt, attempt.create_time
        )

    def progress(self, progress: float) -> None:
        """Progress is not counted."""

    def outcome(self, attempt: Attempt) -> contextlib.AbstractContextManager[Any]:
        """Nothing to count around an outcome's write."""
        return _NO_BLOCK

    def ended(self, attempt: Attempt, outcome: str, seconds: float) -> None:
        """An attempt ended with ``outcome`` after ``seconds`` of its handler."""
        self.metrics.attempt_ended(attempt.type, attempt.queue, outcome, seconds)


_NO_BLOCK = contextlib.nullcontext()


class RelayMetrics:
    """A relay's and a sweeper's :class:`~jobplane.workers.interceptors.RelayInterceptor`
    that counts: messages relayed, batches' confirms and records, repairs.

    Handed to them by the process that serves metrics (the CLI); the relay and
    the sweeper import no metrics, and given none count nothing.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def publish(
        self,
        row_headers: Mapping[str, str],
        *,
        exchange: str,
        routing_key: str,
        message_id: object,
        job_id: object,
        tenant_id: object,
    ) -> contextlib.AbstractContextManager[Mapping[str, str]]:
        """Nothing to count around a publish (its outcome counts), no headers to add."""
        return _NO_HEADERS

    def trace_id(self, headers: Mapping[str, Any] | None) -> None:
        """Metrics name no trace."""

    def relayed(self, kind: str, outcome: str, count: int) -> None:
        """``count`` messages of ``kind`` relayed with ``outcome``."""
        self.metrics.relayed(kind, outcome, count)

    def confirmed(self, seconds: float) -> None:
        """A batch's publish and confirm took ``seconds``."""
        self.metrics.relay_confirm.observe(seconds)

    def batched(self, seconds: float) -> None:
        """A batch's claim to record took ``seconds``."""
        self.metrics.relay_dispatch.observe(seconds)

    def repaired(self, report: SweepReport) -> None:
        """What a sweep repaired."""
        self.metrics.count_repairs(report)


_NO_HEADERS: contextlib.AbstractContextManager[Mapping[str, str]] = contextlib.nullcontext({})


# A row is due from its available_at (a scheduled retry's is in the future);
# the outbox_due index holds exactly the unpublished, unfailed rows by it.
_OUTBOX_BACKLOG = """
    SELECT count(*) FILTER (WHERE available_at <= now()) AS rows,
           count(*) FILTER (WHERE available_at > now()) AS scheduled,
           extract(epoch FROM now() - min(available_at)) AS oldest
    FROM outbox WHERE published_at IS NULL AND failed_at IS NULL
"""
# Only a QUEUED job has a waiting code (every transition out of QUEUED clears
# it): the jobs_waiting index holds exactly them, a few rows.
_JOBS_WAITING = """
    SELECT waiting_code, count(*) AS jobs FROM jobs
    WHERE waiting_code IS NOT NULL GROUP BY waiting_code
"""


def watch_outbox(metrics: Metrics, engine: AsyncEngine) -> None:
    """Report the outbox's due rows, how long the longest-due one waits, the
    rows scheduled for later, and the jobs waiting by reason, read at each scrape."""
    from sqlalchemy import text

    from jobplane.types import WaitingCode

    statement = text(_OUTBOX_BACKLOG)
    waiting = text(_JOBS_WAITING)

    async def read() -> None:
        async with engine.connect() as conn:
            row = (await conn.execute(statement)).one()
            codes = {str(r.waiting_code): int(r.jobs) for r in await conn.execute(waiting)}
        # The known codes always have a series (0 when no job waits so); the
        # codes are the server's own, never a tenant's, so the labels stay few.
        for code in dict.fromkeys([*WaitingCode, *codes]):
            metrics.jobs_waiting.labels(str(code)).set(codes.get(code, 0))
        metrics.outbox_backlog.set(int(row.rows))
        metrics.outbox_scheduled.set(int(row.scheduled))
        # Negative when every row is scheduled for later: none is due.
        metrics.outbox_oldest.set(max(float(row.oldest or 0.0), 0.0))

    metrics.on_scrape("outbox", read)


class FailedQueueDepth:
    """Reads the failed (dead-letter) queue's depth, and each of ``queues``' ready
    messages and consumers, at each scrape, on a broker connection of its own
    (opened at the first scrape, again after a loss, closed by :meth:`close`), so
    it never shares a channel a publish or a consumer needs.

    One read at a time (a lock): overlapping scrapes share the one connection
    rather than each opening one. A read is bounded by the scrape's
    :data:`REFRESH_TIMEOUT`; cancelled while connecting, the connection is closed
    (:func:`jobplane.broker.connect` leaves nothing behind).
    """

    def __init__(
        self, metrics: Metrics, amqp_url: str, queue: str, queues: Sequence[str] = ()
    ) -> None:
        self._metrics = metrics
        self._amqp_url = amqp_url
        self._queue = queue
        self._queues = tuple(q for q in queues if q != queue)
        self._connection: Any = None
        self._lock = asyncio.Lock()
        metrics.on_scrape("failed_queue", self.read)

    async def read(self) -> None:
        """Declare each queue passively (its message and consumer counts)."""
        async with self._lock:
            await self._read()

    async def _read(self) -> None:
        import aiormq

        from jobplane import broker

        connection = self._connection
        if connection is None or connection.is_closed:
            self._connection = None
            connection = self._connection = await broker.connect(self._amqp_url)
        found: dict[str, tuple[int, int]] = {}
        missing: list[str] = []
        channel: Any = None
        try:
            try:
                for name in (self._queue, *self._queues):
                    if channel is None or channel.is_closed:
                        channel = await connection.channel()
                    try:
                        declared = await channel.declare_queue(name, passive=True)
                    except aiormq.exceptions.ChannelNotFoundEntity:
                        missing.append(name)  # not declared: the channel is closed
                        continue
                    result = declared.declaration_result
                    found[name] = (int(result.message_count or 0), int(result.consumer_count or 0))
            finally:
                if channel is not None and not channel.is_closed:
                    await channel.close()
        except Exception:
            if connection.is_closed or connection.transport is None:
                await self.close()  # reconnect next time; a channel error keeps it
            raise
        for name, (messages, consumers) in found.items():
            if name == self._queue:
                self._metrics.failed_queue.labels(name).set(messages)
            else:
                self._metrics.queue_messages.labels(name).set(messages)
                self._metrics.queue_consumers.labels(name).set(consumers)
        if missing:
            raise LookupError(f"queues not declared: {', '.join(missing)}")

    async def close(self) -> None:
        """Close its connection, if open."""
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()
