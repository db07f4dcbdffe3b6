"""The topology as jobplane holds it: queues, pipelines and their stages, and its errors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from jobplane.topics import EVENTS_EXCHANGE, LIFECYCLE_EVENT_TYPES, topic_matches

if TYPE_CHECKING:
    from pamqp.common import FieldValue


class TopologyError(ValueError):
    """The topology file is not valid."""


class TopologyMissing(TopologyError):
    """Part of the topology is missing on the broker and this account may not declare it."""


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """One quorum queue and the routing-key patterns bound to it."""

    name: str
    bindings: tuple[str, ...]
    delivery_limit: int = 5
    max_attempts: int = 3
    #: One of PRIORITIES (in parse.py): how a worker orders its slots (jobplane.workers.priority).
    priority: str = "normal"
    # Defaults for jobs of this queue: attempt timeout, and the backoff of
    # retries (exponential from retry_base_delay, capped, with jitter).
    timeout_seconds: float = 3600.0
    retry_base_delay: float = 1.0
    retry_max_delay: float = 300.0
    #: Put before the ``job.*`` log event names of this queue's jobs (``ingestion.``);
    #: empty: JOBPLANE_LOG_JOB_PREFIX's.
    log_prefix: str = ""
    #: At most this many of one tenant's jobs of this queue RUNNING at once;
    #: 0: no limit (docs/flow-control.md, "Per-tenant limits").
    max_running_per_tenant: int = 0

    def takes(self, routing_key: str) -> bool:
        """True when one of the bindings matches ``routing_key``."""
        return any(topic_matches(p, routing_key) for p in self.bindings)


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One stage of a pipeline: a job type of its own, on the queue that takes it."""

    name: str
    type: str
    queue: str
    max_attempts: int
    timeout_seconds: float
    #: The algorithm, model or configuration version of the stage; a stage's
    #: result is keyed by (job, stage, version).
    version: str = ""
    #: The stage's share of the job's progress, relative to the other stages.
    weight: float = 1.0
    #: The stage runs as one child job per item of the stage before's result
    #: (a list); the stage after it joins their results (ADR-0047).
    fan_out: bool = False
    #: Children of a fan-out stage that may end other than SUCCEEDED while
    #: the join still runs (it sees which failed).
    max_failures: int = 0
    #: A fan-out stage's failure past ``max_failures`` cancels the children
    #: still running and fails the job at once, instead of after all ended.
    fail_fast: bool = False


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    """A named, versioned, ordered chain of stages, submitted as one job (ADR-0017)."""

    name: str
    stages: tuple[StageSpec, ...]
    version: str = ""


@dataclass(frozen=True, slots=True)
class RateLimitSpec:
    """A ``[[rate_limits]]`` entry: starts per second and/or RUNNING jobs at once of
    the job types its patterns match (docs/flow-control.md, "Rate limits").

    A job type is governed by the first entry, in the file's order, one of
    whose patterns matches it.
    """

    name: str
    #: Binding-style patterns (a plain job type is a pattern that matches itself).
    types: tuple[str, ...]
    #: Starts per second; None: no rate.
    per_second: float | None = None
    #: Starts allowed at once after a quiet spell (default: one second's worth, at least 1).
    burst: float = 1.0
    #: RUNNING jobs at once; None: no such limit.
    max_running: int | None = None
    #: Each tenant its own budget (False: one budget shared by all tenants).
    per_tenant: bool = False

    def takes(self, job_type: str) -> bool:
        """True when one of the patterns matches ``job_type``."""
        return any(topic_matches(p, job_type) for p in self.types)


@dataclass(frozen=True, slots=True)
class Topology:
    """Exchange, queues, dead-letter path and pipelines of one deployment."""

    exchange: str = "jobplane.jobs"
    dead_letter_exchange: str = "jobplane.jobs.dlx"
    failed_queue: str = "jobplane.failed"
    queues: tuple[QueueSpec, ...] = field(default_factory=tuple)
    #: The topic exchange of domain events (routing key: the event type).
    events_exchange: str = EVENTS_EXCHANGE
    pipelines: tuple[PipelineSpec, ...] = field(default_factory=tuple)
    #: Rate and RUNNING limits by job type, in the file's order (the first that matches governs).
    rate_limits: tuple[RateLimitSpec, ...] = field(default_factory=tuple)
    #: ``[events] publish_lifecycle``: topic patterns over the lifecycle event
    #: types; the relay publishes a lifecycle event to the events exchange only
    #: when one matches its type (none by default; docs/events.md, ADR-0052).
    publish_lifecycle: tuple[str, ...] = ()
    #: Members of each quorum queue when it is declared (``x-quorum-initial-group-size``);
    #: None: the broker's default (every node, up to its ``quorum_cluster_size``, 3).
    quorum_group_size: int | None = None

    def quorum_arguments(self) -> dict[str, FieldValue]:
        """The arguments every quorum queue of this topology is declared with."""
        arguments: dict[str, FieldValue] = {"x-queue-type": "quorum"}
        if self.quorum_group_size is not None:
            arguments["x-quorum-initial-group-size"] = self.quorum_group_size
        return arguments

    def published_lifecycle(self) -> tuple[str, ...]:
        """The lifecycle event types ``publish_lifecycle`` sends to the events exchange."""
        return tuple(
            event_type
            for event_type in LIFECYCLE_EVENT_TYPES
            if any(topic_matches(p, event_type) for p in self.publish_lifecycle)
        )

    def rate_limit(self, job_type: str) -> RateLimitSpec | None:
        """The ``[[rate_limits]]`` entry that governs ``job_type``, or None."""
        for limit in self.rate_limits:
            if limit.takes(job_type):
                return limit
        return None

    def pipeline(self, name: str) -> PipelineSpec | None:
        """The pipeline called ``name``, or None."""
        for pipeline in self.pipelines:
            if pipeline.name == name:
                return pipeline
        return None

    def route(self, job_type: str) -> QueueSpec | None:
        """The first queue that takes ``job_type``, or None."""
        for queue in self.queues:
            if queue.takes(job_type):
                return queue
        return None

    def queue(self, name: str) -> QueueSpec:
        """The queue called ``name``."""
        for queue in self.queues:
            if queue.name == name:
                return queue
        raise TopologyError(f"no queue named {name!r} in the topology")

    @property
    def owner_queue(self) -> str:
        """The queue that records which deployment owns this topology."""
        return f"{self.exchange}.owner"

    def prefixed(self, prefix: str) -> Topology:
        """The same topology with every exchange and queue name prefixed."""
        return replace(
            self,
            exchange=prefix + self.exchange,
            dead_letter_exchange=prefix + self.dead_letter_exchange,
            failed_queue=prefix + self.failed_queue,
            queues=tuple(replace(q, name=prefix + q.name) for q in self.queues),
            events_exchange=prefix + self.events_exchange,
            pipelines=tuple(
                replace(p, stages=tuple(replace(s, queue=prefix + s.queue) for s in p.stages))
                for p in self.pipelines
            ),
        )
