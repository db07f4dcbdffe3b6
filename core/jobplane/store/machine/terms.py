"""The words of the transition table: :class:`Transition`, :class:`Phase`,
:class:`Lifecycle` and :class:`Rule` (the table itself is
:mod:`jobplane.store.machine.table`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from jobplane.types import EventType, JobState


class Phase(enum.Enum):
    """A state a transition may start from: a :class:`JobState`, with RUNNING split by its lease."""

    QUEUED = "queued"
    RUNNING = "running"  # its lease is live
    RUNNING_EXPIRED = "running_expired"  # its lease ran out: the attempt is presumed dead
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def state(self) -> JobState:
        """The job state of this phase."""
        return JobState.RUNNING if self is Phase.RUNNING_EXPIRED else JobState(self.value)


class Transition(enum.StrEnum):
    """Every way a job changes."""

    SUBMIT = "submit"  # a new job, QUEUED, with its first dispatch
    CLAIM = "claim"  # a worker starts the attempt its message dispatches
    EXHAUST = "exhaust"  # a claim finds no attempt left: FAILED
    PROGRESS = "progress"  # a running attempt reports (many reports, many jobs, per statement)
    SUCCEED = "succeed"
    ADVANCE = "advance"  # a pipeline's stage succeeded: QUEUED for the next stage, dispatched
    FAIL = "fail"
    CANCELLED = "cancelled"  # the running attempt acknowledges a cancel request
    SCHEDULE_RETRY = "schedule_retry"  # the attempt failed retryably: QUEUED, due later
    HAND_BACK = "hand_back"  # a worker without the handler gives it back; a live one has it
    PARK = "park"  # ... and no live worker has it: QUEUED without a dispatch
    UNPARK = "unpark"  # a worker that has it started: a parked job is dispatched again
    CANCEL = "cancel"  # CancelJob of a QUEUED job
    REQUEST_CANCEL = "request_cancel"  # CancelJob of a RUNNING job: its attempt is asked
    RETRY = "retry"  # RetryJob: a new attempt budget for a FAILED or CANCELLED job
    RESTART = "restart"  # RetryJob from a named stage of a FAILED or CANCELLED pipeline job
    EXPIRE_LEASE = "expire_lease"  # the sweeper finds a dead attempt: a new one, due later
    EXPIRE_LAST_LEASE = "expire_last_lease"  # ... and no attempt is left: FAILED
    REDISPATCH = "redispatch"  # an operator dispatches a waiting job again
    RELAY_FAIL = "relay_fail"  # the relay can never publish the job's dispatch: FAILED
    WAIT = "wait"  # the relay says why a job's dispatch waits (or that it no longer does)
    # Concurrency keys (ADR-0040): a claim its key refused holds the job
    # without a dispatch; a slot freed makes the oldest held jobs due again.
    HOLD = "hold"
    RELEASE = "release"
    # Flow limits (ADR-0043): a claim its start rate refused waits for the start
    # it reserved (a dispatch due then); a slot of a RUNNING limit freed makes
    # the oldest jobs held for it due again. HOLD also holds for a RUNNING limit.
    THROTTLE = "throttle"
    RELEASE_LIMIT = "release_limit"
    # Deadlines (ADR-0044): a job not ended past its deadline ends FAILED,
    # whatever its stage or attempt; a running attempt is fenced out.
    DEADLINE = "deadline"
    # Dependencies (ADR-0045): a job submitted with ``after`` waits QUEUED
    # without a dispatch; when the jobs it waits for have ended, one statement
    # decides between these three (its policy says what a failure does).
    DEPENDENCIES_MET = "dependencies_met"
    DEPENDENCY_FAILED = "dependency_failed"
    DEPENDENCY_CANCELLED = "dependency_cancelled"
    # Fan-out and join (ADR-0047): a stage before a fan-out stage succeeds by
    # spawning one child per item of its result; the job waits for them at
    # the fan-out stage like a dependent, and their ends decide between JOIN
    # (the join stage dispatched) and DEPENDENCY_FAILED. RetryJob of a job
    # that failed there runs its failed children again and waits again.
    FAN_OUT = "fan_out"
    JOIN = "join"
    REJOIN = "rejoin"


class Lifecycle(enum.StrEnum):
    """The domain events job transitions publish (docs/events.md, "Lifecycle events")."""

    QUEUED = "job.queued"
    STARTED = "job.started"
    RETRY_SCHEDULED = "job.retry_scheduled"
    CANCEL_REQUESTED = "job.cancel_requested"
    SUCCEEDED = "job.succeeded"
    STAGE_SUCCEEDED = "job.stage_succeeded"
    FAILED = "job.failed"
    CANCELLED = "job.cancelled"


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the table: what a transition may start from and what it does."""

    sources: frozenset[Phase]  # empty: the job is new
    target: JobState
    match: str  # the fence: which row, and whose
    event: EventType | None  # the event it appends (None: none, and last_seq stays)
    dispatch: bool = False  # it writes the job's next dispatch (an outbox row)
    guard: str = ""  # a condition beyond the state (SQL, or prose for the hand-back)
    sets: str = ""  # what it sets besides state, last_seq and update_time
    # The event's message and data, as SQL over j (the changed rows).
    message: str = ":event_message"
    data: str = "CAST(:event_data AS jsonb)"
    # The domain event it publishes (None: none; progress is too frequent,
    # the hand-back, park and unpark leave the job QUEUED as it was).
    lifecycle: Lifecycle | None = None
    # The stage its event belongs to, as SQL over j (NULL for a plain job).
    stage: str = "j.stage_name"
    # Rows the statement reads besides the job's (a FROM clause; the guard
    # joins them), so its columns are qualified.
    using: str = ""
    # The guard when applied to many rows in one statement ("": guard's).
    many_guard: str = ""

    def __post_init__(self) -> None:
        if self.lifecycle is not None and self.event is None:
            raise ValueError("a lifecycle event takes the seq of the job's event")
