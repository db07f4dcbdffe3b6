"""The public data types of jobplane: plain Python, no protobuf."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

JSONObject = dict[str, Any]


class JobState(enum.Enum):
    """Lifecycle of a job."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """True for SUCCEEDED, FAILED and CANCELLED."""
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class EventType(enum.Enum):
    """What a job event records."""

    QUEUED = "queued"
    STARTED = "started"
    PROGRESS = "progress"
    RETRY_SCHEDULED = "retry_scheduled"
    CANCEL_REQUESTED = "cancel_requested"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    #: A pipeline's stage succeeded and the next one is queued.
    STAGE_SUCCEEDED = "stage_succeeded"

    @property
    def terminal(self) -> bool:
        """True for the events that end a job."""
        return self in (EventType.SUCCEEDED, EventType.FAILED, EventType.CANCELLED)


class WaitingCode(enum.StrEnum):
    """Why a QUEUED job has not started: :attr:`Job.waiting_code`'s known values.

    A code is stable; the message beside it (:attr:`Job.waiting_reason`) is
    for people. A newer server may send a code this SDK does not list yet:
    ``Job.waiting_code`` stays a plain string.
    """

    #: No live worker handles the job's type on its queue: it waits, parked,
    #: for one to start.
    NO_LIVE_WORKER = "NO_LIVE_WORKER"
    #: Workers without its handler gave it back; a live one that has it exists.
    HANDED_BACK = "HANDED_BACK"
    #: The broker returned its dispatch: no queue is bound for its type on
    #: the jobs exchange (the broker's topology lacks the route). Retried;
    #: fixed by applying the topology.
    UNROUTABLE = "UNROUTABLE"
    #: Its ``schedule_time`` has not come yet: its dispatch is due then
    #: (docs/scheduling.md).
    SCHEDULED = "SCHEDULED"
    #: Its concurrency key has as many jobs RUNNING as its limit allows, or
    #: older jobs of the key wait ahead of it: the reason names the job it
    #: waits for (docs/flow-control.md).
    CONCURRENCY_LIMIT = "CONCURRENCY_LIMIT"
    #: A ``[[rate_limits]]`` entry of the topology holds it: its starts per
    #: second (its dispatch is due at the start it reserved) or its
    #: ``max_running`` (held until a RUNNING job of the limit ends). The
    #: reason names the limit (docs/flow-control.md).
    RATE_LIMITED = "RATE_LIMITED"
    #: Its tenant has its queue's ``max_running_per_tenant`` jobs RUNNING:
    #: held until one of them ends (docs/flow-control.md).
    TENANT_LIMIT = "TENANT_LIMIT"
    #: It was submitted to run after other jobs (``after``) and some of them
    #: have not ended yet: the reason names them (docs/workflows.md).
    DEPENDENCIES = "DEPENDENCIES"


class ConcurrencyMode(enum.StrEnum):
    """What a job does when its concurrency key is full (docs/flow-control.md)."""

    #: It waits QUEUED, first in first out among its key's jobs.
    QUEUE = "queue"
    #: The submit is refused (:class:`jobplane.errors.ConcurrencyLimitReached`).
    REJECT = "reject"


class DependencyFailurePolicy(enum.StrEnum):
    """What a job submitted with ``after`` does when one of those jobs does not
    succeed (docs/workflows.md)."""

    #: It ends FAILED, error code DEPENDENCY_FAILED naming the job (the default).
    FAIL = "fail"
    #: It ends CANCELLED.
    CANCEL = "cancel"
    #: It runs once all of them have ended, whatever their outcome.
    RUN_ANYWAY = "run_anyway"


@dataclass(frozen=True, slots=True)
class JobError:
    """Why a job failed or was cancelled."""

    code: str
    message: str
    retryable: bool = False


class StageState(enum.Enum):
    """Where one stage of a pipeline job stands."""

    PENDING = "pending"  # an earlier stage has not succeeded yet
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"  # the job was cancelled before the stage ran


@dataclass(frozen=True, slots=True)
class Stage:
    """One stage of a pipeline job: what it runs and how it went."""

    name: str
    type: str
    version: str
    state: StageState
    attempts: int
    max_attempts: int
    timeout: timedelta
    start_time: datetime | None = None
    end_time: datetime | None = None
    error: JobError | None = None
    result: JSONObject | None = None
    #: A fan-out stage (ADR-0047): one child job per item of the stage
    #: before's result; the stage after joins them.
    fan_out: bool = False
    #: Children that may fail while the join still runs.
    max_failures: int = 0
    #: A failure past ``max_failures`` fails the job at once.
    fail_fast: bool = False


@dataclass(frozen=True, slots=True)
class FanOut:
    """A pipeline job's last fan-out: its stage, how many children, and how many
    have ended and failed so far (ADR-0047)."""

    stage: str
    children: int
    ended: int
    failed: int


@dataclass(frozen=True, slots=True)
class Blob:
    """A stored blob (BlobService): ``blobs/{sha256}``, its size and content type."""

    name: str
    sha256: str
    size: int
    content_type: str = ""
    create_time: datetime | None = None


@dataclass(frozen=True, slots=True)
class BlobPage:
    """One page of ``list_blobs``; ``next_page_token`` is empty on the last."""

    blobs: list[Blob]
    next_page_token: str


@dataclass(frozen=True, slots=True)
class BlobRef:
    """A blob holding a job's payload or result as JSON: ``blobs/{sha256}``, its size."""

    name: str
    sha256: str
    size: int


@dataclass(frozen=True, slots=True)
class Job:
    """A job as the server last stored it."""

    name: str
    type: str
    state: JobState
    payload: JSONObject
    result: JSONObject | None
    error: JobError | None
    progress: float
    progress_message: str
    attempt: int
    max_attempts: int
    request_id: str
    correlation_id: str
    labels: dict[str, str]
    create_time: datetime
    update_time: datetime
    start_time: datetime | None = None
    end_time: datetime | None = None
    next_attempt_time: datetime | None = None
    cancel_requested: bool = False
    last_seq: int = 0
    timeout: timedelta = timedelta(hours=1)
    #: Why a QUEUED job has not started yet, when known (e.g. no live worker
    #: handles its type), and what fixes it; empty otherwise.
    waiting_reason: str = ""
    #: Attempts counted against ``max_attempts`` since submit or the last
    #: retry (``attempt`` counts every attempt ever started).
    attempts_used: int = 0
    #: A pipeline job's stage that runs or waits now ("" for a plain job);
    #: ``attempt``, ``max_attempts`` and ``timeout`` are that stage's.
    stage: str = ""
    #: A pipeline job's stages in order (empty for a plain job, and in lists).
    stages: tuple[Stage, ...] = ()
    #: The pipeline's version, as the topology declared it at submit.
    pipeline_version: str = ""
    #: The blob holding the payload when it was submitted by reference
    #: (``payload`` is then ``{}`` unless the SDK read it back).
    payload_blob: BlobRef | None = None
    #: The blob holding the result when the worker offloaded it (``result``
    #: is then ``{}`` unless the SDK read it back).
    result_blob: BlobRef | None = None
    #: The stable code of ``waiting_reason`` (a :class:`WaitingCode` value,
    #: e.g. ``UNROUTABLE``); empty when the job is not waiting for a known reason.
    waiting_code: str = ""
    # Delayed jobs (docs/scheduling.md).
    #: When the job may first start, as submitted; None for a job submitted
    #: without a schedule_time or schedule_delay.
    schedule_time: datetime | None = None
    # Concurrency keys (docs/flow-control.md).
    #: The job's concurrency key ("" for none): at most ``concurrency_limit``
    #: jobs of the tenant with this key run at once.
    concurrency_key: str = ""
    #: The key's limit the job was submitted with (0 without a key).
    concurrency_limit: int = 0
    # Deadlines (docs/scheduling.md#deadlines).
    #: The time by which the job must have ended; None for a job submitted
    #: without one. Past it, a job not ended ends FAILED, DEADLINE_EXCEEDED.
    deadline: datetime | None = None
    #: The jobs it runs after (``jobs/{id}``), as submitted; empty for none.
    after: tuple[str, ...] = ()
    #: What it does when one of those does not succeed.
    after_failure: DependencyFailurePolicy = DependencyFailurePolicy.FAIL
    # Child jobs (docs/workflows.md).
    #: ``jobs/{id}`` of the job whose handler submitted this one ("" for none).
    parent: str = ""
    #: The children of its last fan-out stage, counted (None: it never fanned out).
    fan_out: FanOut | None = None

    @property
    def id(self) -> str:
        """The id part of ``name`` (``jobs/{id}``)."""
        return self.name.partition("/")[2]


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One event of a job's stream, in seq order."""

    name: str
    seq: int
    type: EventType
    state: JobState
    progress: float
    message: str
    event_time: datetime
    attempt: int = 0
    data: JSONObject = field(default_factory=dict)
    #: The pipeline stage the event belongs to ("" for a plain job).
    stage: str = ""

    @property
    def terminal(self) -> bool:
        """True for the event that ended the job."""
        return self.type.terminal


@dataclass(frozen=True, slots=True)
class JobPage:
    """One page of :meth:`list`; ``next_page_token`` is empty on the last."""

    jobs: list[Job]
    next_page_token: str
