"""The metric families of a process's :class:`~jobplane.observe.metrics.Metrics`,
declared by the part of jobplane that counts them: the jobs' lifecycle, the
server, the store (outbox, waiting jobs, database pool), the relay and the
sweeper, the worker, the broker's queues, and the scrape itself.

Names, labels and help texts are what operators' dashboards and alerts read
(docs/operations.md lists them): a change here is a change of the interface.
prometheus-client is imported only when a :class:`Metrics` is built (ADR-0033).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

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

#: The attribute of every family, for what stands in for them all (NO_METRICS).
FAMILIES = (
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
    "dispatch_waiting",
    "outbox_oldest",
    "outbox_scheduled",
    "jobs_waiting",
    "schedule_lag",
    "relay_published",
    "relay_confirm",
    "relay_dispatch",
    "sweeper_repairs",
    "worker_slots",
    "worker_groups",
    "throttled_starts",
    "submit_groups",
    "failed_queue",
    "queue_messages",
    "queue_consumers",
    "db_pool",
    "scrape_errors",
)


class MetricFamilies:
    """The families of :data:`FAMILIES` as attributes, declared in a registry by area."""

    def _declare(self, registry: CollectorRegistry) -> None:
        """Every family, in ``registry``."""
        self._declare_jobs(registry)
        self._declare_server(registry)
        self._declare_store(registry)
        self._declare_relay(registry)
        self._declare_worker(registry)
        self._declare_broker(registry)
        self._declare_scrape(registry)

    def _declare_jobs(self, registry: CollectorRegistry) -> None:
        """A job's lifecycle: submitted, attempts, how they ended, waits and run times."""
        from prometheus_client import Counter, Histogram

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

    def _declare_server(self, registry: CollectorRegistry) -> None:
        """The server's streams and grouped submits."""
        from prometheus_client import Gauge, Histogram

        self.watch_streams = Gauge(
            "jobplane_watch_streams_open",
            "WatchJob and SubscribeEvents streams open on this server.",
            registry=registry,
        )
        self.submit_groups = Histogram(
            "jobplane_submit_group_size",
            "Concurrent SubmitJob calls a server wrote in one statement (ADR-0030).",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )

    def _declare_store(self, registry: CollectorRegistry) -> None:
        """What the database holds (read at scrape time): the outbox, waiting jobs, the pool."""
        from prometheus_client import Gauge

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
        self.dispatch_waiting = Gauge(
            "jobplane_dispatch_waiting_rows",
            "Job dispatches due and not published yet, by queue (read at scrape time): with "
            "fair dispatch, those beyond the queue's credit wait here (docs/flow-control.md).",
            ("queue",),
            registry=registry,
        )
        self.schedule_lag = Gauge(
            "jobplane_schedule_lag_seconds",
            "How long the most overdue recurring schedule's run has been due; 0 when none "
            "is (read at scrape time).",
            registry=registry,
        )
        self.jobs_waiting = Gauge(
            "jobplane_jobs_waiting",
            "QUEUED jobs that wait for a known reason, by its code (e.g. UNROUTABLE: the "
            "broker has no route for their dispatch), read at scrape time.",
            ("code",),
            registry=registry,
        )
        self.db_pool = Gauge(
            "jobplane_db_pool_connections",
            "Database pool connections: in use, idle, and the pool's size.",
            ("state",),
            registry=registry,
        )

    def _declare_relay(self, registry: CollectorRegistry) -> None:
        """The relay's publishes and confirms, and the sweeper's repairs."""
        from prometheus_client import Counter, Histogram

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

    def _declare_worker(self, registry: CollectorRegistry) -> None:
        """A worker's slots, grouped writes and claims a limit refused."""
        from prometheus_client import Counter, Gauge, Histogram

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
        self.throttled_starts = Counter(
            "jobplane_throttled_starts_total",
            "Claims a flow limit refused (the job waits QUEUED), by the limit (a rate "
            "limit's name, queue/{queue} for a per-tenant limit, concurrency_key) and job type.",
            ("limit", "type"),
            registry=registry,
        )

    def _declare_broker(self, registry: CollectorRegistry) -> None:
        """The broker's queues (read at scrape time)."""
        from prometheus_client import Gauge

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

    def _declare_scrape(self, registry: CollectorRegistry) -> None:
        """The scrape's own failures."""
        from prometheus_client import Counter

        self.scrape_errors = Counter(
            "jobplane_scrape_errors_total",
            "Scrape-time reads that failed or timed out (their gauges keep the last value).",
            ("source",),
            registry=registry,
        )
