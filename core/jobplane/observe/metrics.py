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
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, cast

import structlog

# The outcomes of an attempt (the ``outcome`` label), named where attempts end.
from jobplane.attempt_end import ADVANCED, RETRY
from jobplane.observe.metric_families import FAMILIES, MetricFamilies
from jobplane.observe.metric_interceptors import RelayMetrics, WorkerMetrics
from jobplane.observe.metric_scrapes import FailedQueueDepth, watch_outbox

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.topology import Topology

__all__ = [
    "CONCURRENCY_KEY",
    "MAX_TYPE_LABELS",
    "NO_METRICS",
    "OTHER_TYPE",
    "REFRESH_TIMEOUT",
    "FailedQueueDepth",
    "Metrics",
    "Refresher",
    "RelayMetrics",
    "WorkerMetrics",
    "watch_outbox",
]


log = structlog.get_logger("jobplane.metrics")


#: How long one scrape waits for a refresher (a database or broker read).
REFRESH_TIMEOUT = 2.0

Refresher = Callable[[], Awaitable[None]]

#: The most job types a process labels its metrics with; later ones are OTHER_TYPE.
MAX_TYPE_LABELS = 500
#: The ``type`` label of a job type this process does not know.
OTHER_TYPE = "other"
#: The ``limit`` label of a claim refused by its concurrency key (never the key itself).
CONCURRENCY_KEY = "concurrency_key"


def _exact(pattern: str) -> bool:
    """A binding that names one type (no AMQP wildcard word)."""
    return all(word not in ("*", "#") for word in pattern.split("."))


class Metrics(MetricFamilies):
    """The metrics of one process and the registry they are in (its families:
    :mod:`~jobplane.observe.metric_families`)."""

    enabled = True

    def __init__(self) -> None:
        # Imported here: a worker without the metrics extra (ADR-0033) uses
        # NO_METRICS and never builds one.
        from prometheus_client import CollectorRegistry

        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=True)
        self._refreshers: list[tuple[str, Refresher]] = []
        self._slots: list[Callable[[], tuple[int, int]]] = []
        self._streams: list[Callable[[], int]] = []
        self._pools: list[AsyncEngine] = []
        self._started: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._ended: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._children: dict[tuple[str, str, str], Any] = {}
        self._types: set[str] = set()
        self._declare(self.registry)

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

    def submitted(self, job_type: str, queue: str, count: int = 1) -> None:
        """``count`` jobs were created: by SubmitJob, or by a worker (children)."""
        label = self.type_label(job_type)
        key = ("submitted", label, queue)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.jobs_submitted.labels(label, queue)
        child.inc(count)

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

    def throttled(self, limit: str, job_type: str) -> None:
        """A claim of a ``job_type`` job was refused by ``limit`` (a rate limit's name, or
        ``queue/{queue}`` for a queue's per-tenant limit; '' for a concurrency key, whose
        keys are no label): the job waits QUEUED (a ClaimResult's HELD)."""
        label = self.type_label(job_type)
        key = ("throttled", limit or CONCURRENCY_KEY, label)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.throttled_starts.labels(key[1], label)
        child.inc()

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
        for name in FAMILIES:
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

    def submitted(self, job_type: str, queue: str, count: int = 1) -> None:
        pass

    def relayed(self, kind: str, outcome: str, count: int = 1) -> None:
        pass

    def grouped(self, kind: str, size: int) -> None:
        pass

    def submit_grouped(self, size: int) -> None:
        pass

    def throttled(self, limit: str, job_type: str) -> None:
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
