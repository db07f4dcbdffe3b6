"""The transition table: every way a job changes, and the states each may start from.

:data:`RULES` maps each :class:`Transition` to its :class:`Rule`. The SQL that
says which states a transition may start from is derived from it
(:func:`where_sources`), so nothing else in the store spells a job state by
hand. See ADR-0010.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from jobplane.store.machine.admission import (
    ADMITS,
    FLOW_SLOTS,
    GROUP_ADMITS,
    KEY_FREE,
    KEY_FULL,
)
from jobplane.types import EventType, JobState, WaitingCode


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


# Guards: conditions beyond the state, named so the table reads as prose.
ATTEMPTS_LEFT = "attempt - retry_base < max_attempts"
NO_ATTEMPTS_LEFT = "attempt - retry_base >= max_attempts"
# A job held by its concurrency key has no dispatch either, but waits for a
# slot of its key, not for a worker (ADR-0040).
# So is one held for a RUNNING slot of a flow limit (ADR-0043).
# So is one waiting for the jobs it runs after (ADR-0045).
HELD_CODES = (
    WaitingCode.CONCURRENCY_LIMIT,
    WaitingCode.RATE_LIMITED,
    WaitingCode.TENANT_LIMIT,
    WaitingCode.DEPENDENCIES,
)
PARKED = (
    "dispatch_id IS NULL AND (waiting_code IS NULL OR waiting_code NOT IN ("
    + ", ".join(f"'{c}'" for c in HELD_CODES)
    + "))"
)
# The next stage's row exists (``s``: the statement's ``using``).
NEXT_STAGE = "s.job_id = jobs.id AND s.idx = jobs.stage + 1"
# ... the stage of the given index does (RetryJob from a named stage).
NAMED_STAGE = "s.job_id = jobs.id AND s.idx = :stage"
CANCEL_NOT_REQUESTED = "cancel_requested_at IS NULL"
# Deadlines (ADR-0044): the job's deadline has come; a claim starts no attempt
# of a job past it (the claim ends it instead).
PAST_DEADLINE = "deadline <= now()"
BEFORE_DEADLINE = "(deadline IS NULL OR deadline > now())"
# A job that stops waiting (claimed, ended, dispatched anew) has no reason to
# wait: only a QUEUED job ever has one.
NOT_WAITING = "waiting_reason = NULL, waiting_code = NULL, flow_key = NULL"
# A reason noted again as it is changes nothing (no update_time, no row version).
CHANGES_REASON = (
    "(waiting_code IS DISTINCT FROM :waiting_code "
    "OR waiting_reason IS DISTINCT FROM :waiting_reason)"
)

# Dependencies (ADR-0045), read by the resolution statement under the row
# lock: the counts the ends of the jobs it runs after keep (deps_waiting: not
# ended yet; deps_failed: ended other than SUCCEEDED) and its policy.
DEPS_FAIL = "deps_failed > 0 AND coalesce(after_failure, 'fail') = 'fail'"
DEPS_CANCEL = "deps_failed > 0 AND after_failure = 'cancel'"
DEPS_MET = "deps_waiting <= 0 AND (deps_failed = 0 OR after_failure = 'run_anyway')"
WAITS_FOR_DEPS = f"waiting_code = '{WaitingCode.DEPENDENCIES}' AND dispatch_id IS NULL"

# Said by the hand-back statement itself, which decides between the two.
LIVE_WORKER = "a live worker handles the job's type on its queue"
NO_LIVE_WORKER = "no live worker handles the job's type on its queue"

# RetryJob of a job keeps a deadline still ahead (it bounds the retry too) and
# drops one that passed: the retry of a job that ended DEADLINE_EXCEEDED runs
# without one (ADR-0044).
KEEP_DEADLINE_AHEAD = "deadline = CASE WHEN jobs.deadline > now() THEN jobs.deadline END"

# Fences: which row a transition is for, and whose it is to change.
ATTEMPT_FENCE = "id = :id AND attempt = :attempt AND lease_token = :lease_token"
BY_DISPATCH = "id = :id AND tenant_id = :tenant_id AND dispatch_id = :dispatch_id"
BY_ID = "id = :id AND tenant_id = :tenant_id"

# The job runs the stage ``s`` next: its type, queue, budget and share of progress.
_AT_STAGE = (
    "type = s.type, queue = s.queue, stage = s.idx, stage_name = s.name, "
    "max_attempts = s.max_attempts, timeout_seconds = s.timeout_seconds, "
    "stage_base = s.base, stage_span = s.span, progress = s.base, progress_message = ''"
)
_END = "lease_token = NULL, lease_expires_at = NULL, next_attempt_time = NULL, end_time = now()"
_LIVE = frozenset({Phase.RUNNING, Phase.RUNNING_EXPIRED})
_WAITING = frozenset({Phase.QUEUED, Phase.RUNNING_EXPIRED})


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


RULES: Mapping[Transition, Rule] = {
    Transition.SUBMIT: Rule(
        frozenset(),
        JobState.QUEUED,
        "a new id; (tenant_id, request_id) unique",
        EventType.QUEUED,
        dispatch=True,
        lifecycle=Lifecycle.QUEUED,
    ),
    Transition.CLAIM: Rule(
        _WAITING,
        JobState.RUNNING,
        # The message's type must be the job's: the worker chose its handler
        # by the message before it read the job.
        f"{BY_DISPATCH} AND type = :type",
        EventType.STARTED,
        guard=f"{ATTEMPTS_LEFT} AND {BEFORE_DEADLINE} AND {ADMITS}",
        many_guard=f"{ATTEMPTS_LEFT} AND {BEFORE_DEADLINE} AND {GROUP_ADMITS}",
        sets="attempt = attempt + 1, lease_token = :lease_token, "
        "lease_expires_at = now() + make_interval(secs => :lease_seconds), "
        "start_time = now(), next_attempt_time = NULL, cancel_requested_at = NULL, "
        # A new attempt starts from nothing: its STARTED event must not carry
        # the last attempt's progress.
        "cancel_reason = NULL, progress = stage_base, progress_message = '', "
        f"{NOT_WAITING}, handbacks = 0, flow_slots = {FLOW_SLOTS}",
        lifecycle=Lifecycle.STARTED,
    ),
    Transition.EXHAUST: Rule(
        _WAITING,
        JobState.FAILED,
        BY_DISPATCH,
        EventType.FAILED,
        guard=NO_ATTEMPTS_LEFT,
        sets="end_time = now(), error_code = 'ATTEMPTS_EXHAUSTED', "
        "error_message = 'no attempts left (max_attempts reached)', error_retryable = false, "
        "lease_token = NULL, lease_expires_at = NULL, dispatch_id = NULL, "
        f"next_attempt_time = NULL, {NOT_WAITING}",
        lifecycle=Lifecycle.FAILED,
    ),
    Transition.PROGRESS: Rule(
        _LIVE,
        JobState.RUNNING,
        f"{ATTEMPT_FENCE}, for each attempt of the batch",
        EventType.PROGRESS,
        sets="progress, progress_message (the batch's last report)",
    ),
    Transition.SUCCEED: Rule(
        _LIVE,
        JobState.SUCCEEDED,
        ATTEMPT_FENCE,
        EventType.SUCCEEDED,
        sets="result = CAST(:result AS jsonb), result_blob = CAST(:result_blob AS text), "
        "result_blob_size = CAST(:result_blob_size AS bigint), progress = 1, error_code = NULL, "
        f"error_message = NULL, error_retryable = false, {_END}",
        lifecycle=Lifecycle.SUCCEEDED,
    ),
    Transition.ADVANCE: Rule(
        _LIVE,
        JobState.QUEUED,
        ATTEMPT_FENCE,
        EventType.STAGE_SUCCEEDED,
        dispatch=True,
        guard=NEXT_STAGE,
        # The next stage's row (written with the job) says what runs next.
        sets=f"{_AT_STAGE}, retry_base = jobs.attempt, dispatch_id = :dispatch_id, "
        "lease_token = NULL, lease_expires_at = NULL, next_attempt_time = NULL, error_code = NULL, "
        "error_message = NULL, error_retryable = false, cancel_requested_at = NULL, "
        f"cancel_reason = NULL, {NOT_WAITING}, handbacks = 0",
        message="format('stage %s succeeded; %s is next', p.name, j.stage_name)",
        data="jsonb_build_object('stage', p.name, 'next_stage', j.stage_name)",
        lifecycle=Lifecycle.STAGE_SUCCEEDED,
        # The event is the finished stage's.
        stage="p.name",
        using="job_stages s",
    ),
    Transition.FAIL: Rule(
        _LIVE,
        JobState.FAILED,
        ATTEMPT_FENCE,
        EventType.FAILED,
        sets="error_code = :error_code, error_message = :error_message, "
        f"error_retryable = :retryable, {_END}",
        lifecycle=Lifecycle.FAILED,
    ),
    Transition.CANCELLED: Rule(
        _LIVE,
        JobState.CANCELLED,
        ATTEMPT_FENCE,
        EventType.CANCELLED,
        sets="error_code = 'CANCELLED', error_message = coalesce(cancel_reason, 'cancelled'), "
        f"error_retryable = false, {_END}",
        lifecycle=Lifecycle.CANCELLED,
    ),
    Transition.SCHEDULE_RETRY: Rule(
        _LIVE,
        JobState.QUEUED,
        ATTEMPT_FENCE,
        EventType.RETRY_SCHEDULED,
        dispatch=True,
        sets="error_code = :error_code, error_message = :error_message, "
        "error_retryable = true, lease_token = NULL, lease_expires_at = NULL, "
        "dispatch_id = :dispatch_id, retry_base = retry_base + :refund, "
        "next_attempt_time = now() + make_interval(secs => :delay)",
        lifecycle=Lifecycle.RETRY_SCHEDULED,
    ),
    Transition.HAND_BACK: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        BY_DISPATCH,
        None,  # hand-backs are noise in a job's history
        dispatch=True,
        guard=LIVE_WORKER,
        sets="dispatch_id = :new_dispatch_id, next_attempt_time = now() + a jittered "
        "delay doubling with each hand-back, handbacks + 1, waiting_reason, waiting_code",
    ),
    Transition.PARK: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        BY_DISPATCH,
        EventType.QUEUED,
        guard=NO_LIVE_WORKER,
        sets="dispatch_id = NULL, next_attempt_time = NULL, handbacks + 1, waiting_reason, "
        "waiting_code",
        message="j.waiting_reason",
        data="jsonb_build_object('waiting_reason', j.waiting_reason)",
    ),
    Transition.UNPARK: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        "type = ANY (:types) AND queue = ANY (:queues), up to :limit jobs",
        EventType.QUEUED,
        dispatch=True,
        guard=PARKED,
        sets=f"dispatch_id = gen_random_uuid(), {NOT_WAITING}, "
        "handbacks = 0, next_attempt_time = NULL",
        message="format('dispatched again: a worker that handles %s is live', j.type)",
        data="'{}'::jsonb",
    ),
    Transition.CANCEL: Rule(
        frozenset({Phase.QUEUED}),
        JobState.CANCELLED,
        BY_ID,
        EventType.CANCELLED,
        sets="end_time = now(), error_code = 'CANCELLED', error_message = :reason, "
        f"error_retryable = false, dispatch_id = NULL, next_attempt_time = NULL, {NOT_WAITING}",
        lifecycle=Lifecycle.CANCELLED,
    ),
    Transition.REQUEST_CANCEL: Rule(
        _LIVE,
        JobState.RUNNING,
        BY_ID,
        EventType.CANCEL_REQUESTED,
        guard=CANCEL_NOT_REQUESTED,
        sets="cancel_requested_at = now(), cancel_reason = :reason",
        lifecycle=Lifecycle.CANCEL_REQUESTED,
    ),
    Transition.RETRY: Rule(
        frozenset({Phase.FAILED, Phase.CANCELLED}),
        JobState.QUEUED,
        BY_ID,
        EventType.QUEUED,
        dispatch=True,
        sets="retry_base = attempt, dispatch_id = :dispatch_id, result = NULL, "
        "result_blob = NULL, result_blob_size = NULL, error_code = NULL, error_message = NULL, "
        "error_retryable = false, "
        "progress = stage_base, progress_message = '', cancel_requested_at = NULL, "
        "cancel_reason = NULL, "
        "lease_token = NULL, lease_expires_at = NULL, next_attempt_time = NULL, "
        f"start_time = NULL, end_time = NULL, {NOT_WAITING}, "
        f"handbacks = 0, {KEEP_DEADLINE_AHEAD}",
        lifecycle=Lifecycle.QUEUED,
    ),
    Transition.RESTART: Rule(
        frozenset({Phase.FAILED, Phase.CANCELLED}),
        JobState.QUEUED,
        # Qualified: the stage's row has a tenant too.
        "jobs.id = :id AND jobs.tenant_id = :tenant_id",
        EventType.QUEUED,
        dispatch=True,
        guard=NAMED_STAGE,
        sets=f"{_AT_STAGE}, retry_base = jobs.attempt, dispatch_id = :dispatch_id, "
        "result = NULL, result_blob = NULL, result_blob_size = NULL, error_code = NULL, "
        "error_message = NULL, error_retryable = false, "
        "cancel_requested_at = NULL, cancel_reason = NULL, lease_token = NULL, "
        "lease_expires_at = NULL, next_attempt_time = NULL, start_time = NULL, "
        f"end_time = NULL, {NOT_WAITING}, handbacks = 0, {KEEP_DEADLINE_AHEAD}",
        lifecycle=Lifecycle.QUEUED,
        using="job_stages s",
    ),
    Transition.EXPIRE_LEASE: Rule(
        frozenset({Phase.RUNNING_EXPIRED}),
        JobState.QUEUED,
        "id = :id AND attempt = :attempt",
        EventType.RETRY_SCHEDULED,
        dispatch=True,
        guard=ATTEMPTS_LEFT,
        sets="error_code = 'LEASE_EXPIRED', error_message = :message, "
        "error_retryable = true, lease_token = NULL, lease_expires_at = NULL, "
        "dispatch_id = :dispatch_id, next_attempt_time = now() + make_interval(secs => :delay)",
        lifecycle=Lifecycle.RETRY_SCHEDULED,
    ),
    Transition.EXPIRE_LAST_LEASE: Rule(
        frozenset({Phase.RUNNING_EXPIRED}),
        JobState.FAILED,
        "id = :id AND attempt = :attempt",
        EventType.FAILED,
        # No attempts are left: the job is not going to be retried.
        guard=NO_ATTEMPTS_LEFT,
        sets="error_code = 'LEASE_EXPIRED', error_message = :message, "
        "error_retryable = false, lease_token = NULL, lease_expires_at = NULL, "
        "dispatch_id = NULL, next_attempt_time = NULL, end_time = now()",
        lifecycle=Lifecycle.FAILED,
    ),
    Transition.REDISPATCH: Rule(
        _WAITING,
        JobState.QUEUED,
        BY_ID,
        EventType.QUEUED,
        dispatch=True,
        # A parked job dispatched by an operator waits for no worker now.
        sets="dispatch_id = :dispatch_id, lease_token = NULL, lease_expires_at = NULL, "
        f"next_attempt_time = NULL, {NOT_WAITING}",
        lifecycle=Lifecycle.QUEUED,
    ),
    Transition.RELAY_FAIL: Rule(
        frozenset({Phase.QUEUED}),
        JobState.FAILED,
        "id = :job_id AND dispatch_id = :dispatch_id",
        EventType.FAILED,
        sets="error_code = :code, error_message = :message, error_retryable = false, "
        "dispatch_id = NULL, next_attempt_time = NULL, lease_token = NULL, "
        f"lease_expires_at = NULL, end_time = now(), {NOT_WAITING}",
        lifecycle=Lifecycle.FAILED,
    ),
    Transition.WAIT: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        # Fenced on the dispatch the relay holds: a job that moved on (another
        # dispatch, parked) has its own reason, or none.
        "id = :id AND dispatch_id = :dispatch_id",
        None,  # a reason is a fact about now, not history: WatchJob sees no event
        guard=CHANGES_REASON,
        sets="waiting_code = :waiting_code, waiting_reason = :waiting_reason",
    ),
    # Concurrency keys (ADR-0040).
    Transition.HOLD: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        # The delivery its key refused: acked, and no dispatch until a slot frees.
        f"{BY_DISPATCH} AND type = :type",
        EventType.QUEUED,
        guard=f"{ATTEMPTS_LEFT} AND {KEY_FULL}",
        # Written out (machine/flow.py), with THROTTLE: it decides between them.
        sets="dispatch_id = NULL, next_attempt_time = NULL, waiting_code = "
        f"'{WaitingCode.CONCURRENCY_LIMIT}' and waiting_reason 'waiting for jobs/…: concurrency "
        "key … allows N running at once', or the flow limit's code, reason and flow_key",
        message="j.waiting_reason",
        data="jsonb_build_object('waiting_reason', j.waiting_reason)",
    ),
    Transition.RELEASE: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        "tenant_id = :tenant_id AND concurrency_key = :key",
        EventType.QUEUED,
        dispatch=True,
        guard=KEY_FREE,
        # Still waiting for the key (its place in line is kept) until its claim.
        sets="dispatch_id = gen_random_uuid(), next_attempt_time = NULL, waiting_reason = "
        "format('a slot of concurrency key %s is free: dispatched', concurrency_key)",
        message="j.waiting_reason",
        data="'{}'::jsonb",
    ),
    # Flow limits (ADR-0043).
    Transition.THROTTLE: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        f"{BY_DISPATCH} AND type = :type",
        EventType.QUEUED,
        dispatch=True,
        guard=f"{ATTEMPTS_LEFT} AND its start rate refuses it now (the statement decides)",
        sets="dispatch_id = gen_random_uuid(), next_attempt_time = the start it reserved, "
        f"waiting_code = '{WaitingCode.RATE_LIMITED}', waiting_reason naming the limit and "
        "the time, flow_key = the rate's key || '@rate'",
        message="j.waiting_reason",
        data="jsonb_build_object('waiting_reason', j.waiting_reason)",
    ),
    Transition.RELEASE_LIMIT: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        "flow_key = :key",
        EventType.QUEUED,
        dispatch=True,
        guard="held for this limit, oldest first, up to the slots free under its lock",
        sets="dispatch_id = gen_random_uuid(), next_attempt_time = NULL, waiting_reason = "
        "format('a slot of %s is free: dispatched', flow_key)",
        message="j.waiting_reason",
        data="'{}'::jsonb",
    ),
    # Deadlines (ADR-0044).
    Transition.DEADLINE: Rule(
        frozenset({Phase.QUEUED, Phase.RUNNING, Phase.RUNNING_EXPIRED}),
        JobState.FAILED,
        BY_ID,
        EventType.FAILED,
        guard=PAST_DEADLINE,
        # The attempt's fence is cleared: its outcome, progress and heartbeat
        # find no lease and land nothing. A pending dispatch is dropped (the
        # Dispatches hook), the running attempt is told to stop (CancelSignal).
        sets="error_code = 'DEADLINE_EXCEEDED', error_message = 'the job did not end by its "
        "deadline', error_retryable = false, dispatch_id = NULL, "
        f"{_END}, {NOT_WAITING}",
        message="j.error_message",
        data="jsonb_build_object('error', jsonb_build_object('code', j.error_code, "
        "'message', j.error_message, 'retryable', false), 'deadline', j.deadline)",
        lifecycle=Lifecycle.FAILED,
    ),
    # Dependencies (ADR-0045), written out in store/machine/dependencies.py.
    Transition.DEPENDENCIES_MET: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        "id = ANY (:ids), locked in id order",
        EventType.QUEUED,
        dispatch=True,
        guard=f"{WAITS_FOR_DEPS} AND {DEPS_MET}",
        sets=f"dispatch_id = gen_random_uuid(), next_attempt_time = NULL, {NOT_WAITING}",
        message="'the jobs it runs after have ended: dispatched'",
        data="'{}'::jsonb",
    ),
    Transition.DEPENDENCY_FAILED: Rule(
        frozenset({Phase.QUEUED}),
        JobState.FAILED,
        "id = ANY (:ids), locked in id order",
        EventType.FAILED,
        guard=f"{WAITS_FOR_DEPS} AND {DEPS_FAIL}",
        sets="error_code = 'DEPENDENCY_FAILED', error_message naming the job, "
        f"error_retryable = false, end_time = now(), {NOT_WAITING}",
        message="j.error_message",
        data="jsonb_build_object('error', jsonb_build_object('code', j.error_code, "
        "'retryable', false))",
        lifecycle=Lifecycle.FAILED,
    ),
    Transition.DEPENDENCY_CANCELLED: Rule(
        frozenset({Phase.QUEUED}),
        JobState.CANCELLED,
        "id = ANY (:ids), locked in id order",
        EventType.CANCELLED,
        guard=f"{WAITS_FOR_DEPS} AND {DEPS_CANCEL}",
        sets="error_code = 'CANCELLED', error_message naming the job, error_retryable = false, "
        f"end_time = now(), {NOT_WAITING}",
        message="j.error_message",
        data="'{}'::jsonb",
        lifecycle=Lifecycle.CANCELLED,
    ),
}

#: The transitions that end a job: each settles the jobs that run after it
#: in its own transaction (ADR-0045).
ENDS = frozenset(t for t, r in RULES.items() if r.target.terminal)


def state_is(*states: JobState, column: str = "state") -> str:
    """SQL: the job is in one of ``states`` (a literal, so partial indexes match)."""
    if len(states) == 1:
        return f"{column} = '{states[0].value}'"
    listed = ", ".join(f"'{s.value}'" for s in states)
    return f"{column} IN ({listed})"


def where_phases(phases: Iterable[Phase], table: str = "") -> str:
    """SQL: the job is in one of ``phases``; ``table`` qualifies the columns."""
    wanted = frozenset(phases)
    if not wanted:
        raise ValueError("no phase: a new job has no row to match")
    prefix = f"{table}." if table else ""
    column = f"{prefix}state"
    plain = [p.state for p in Phase if p in wanted and p not in _LIVE]
    terms = []
    if wanted >= _LIVE:
        plain.append(JobState.RUNNING)
    elif Phase.RUNNING_EXPIRED in wanted:
        terms.append(f"({column} = 'running' AND {prefix}lease_expires_at < now())")
    elif Phase.RUNNING in wanted:
        terms.append(f"({column} = 'running' AND {prefix}lease_expires_at >= now())")
    if plain:
        terms.insert(0, state_is(*sorted(plain, key=_order), column=column))
    return terms[0] if len(terms) == 1 else "(" + " OR ".join(terms) + ")"


def where_sources(transition: Transition, table: str = "") -> str:
    """SQL: the job is in a state ``transition`` may start from (from :data:`RULES`)."""
    return where_phases(RULES[transition].sources, table)


def _order(state: JobState) -> int:
    return list(JobState).index(state)


# A stage's own 0..1 as the job's progress (a plain job's base is 0, its span 1).
JOB_PROGRESS = "least(1.0, {t}.stage_base + {t}.stage_span * {p})"
