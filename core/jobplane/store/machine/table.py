"""The transition table: every way a job changes, and the states each may start from.

:data:`RULES` maps each :class:`Transition` to its :class:`Rule`. The SQL that
says which states a transition may start from is derived from it
(:func:`where_sources`), so nothing else in the store spells a job state by
hand. See ADR-0010.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from jobplane.store.machine.admission import (
    ADMITS,
    FLOW_SLOTS,
    GROUP_ADMITS,
    KEY_FREE,
    KEY_FULL,
)
from jobplane.store.machine.terms import Lifecycle, Phase, Rule, Transition
from jobplane.types import EventType, JobState, WaitingCode

__all__ = ["Lifecycle", "Phase", "Rule", "Transition"]


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
# Never a fan-out stage: its handler runs in the children, not on the job.
NAMED_STAGE = "s.job_id = jobs.id AND s.idx = :stage AND NOT s.fan_out"
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
NOT_WAITING_FOR_JOBS = (
    f"(waiting_code IS DISTINCT FROM '{WaitingCode.DEPENDENCIES}' OR dispatch_id IS NOT NULL)"
)
# A fan-out's children (ADR-0047) count the same way, with the stage's policy:
# deps_tolerate failures are tolerated, and with deps_wait_all a failure
# decides only once every child has ended (0 and false for ``after``).
_TOO_MANY = "deps_failed > deps_tolerate AND (deps_waiting <= 0 OR NOT deps_wait_all)"
DEPS_FAIL = f"{_TOO_MANY} AND coalesce(after_failure, 'fail') = 'fail'"
DEPS_CANCEL = f"{_TOO_MANY} AND after_failure = 'cancel'"
DEPS_MET = "deps_waiting <= 0 AND (deps_failed <= deps_tolerate OR after_failure = 'run_anyway')"
# How many children a FAN_OUT spawns; how many a REJOIN waits for.
_CHILDREN = "CAST(:children AS int)"
_WAITS = "CAST(:waiting AS int)"
# The job waits for the children of its fan-out stage (not for ``after``).
FANNED = "fan_stage IS NOT NULL AND fan_stage = stage"
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
        # A job waiting for others (its dependencies, its fan-out's children)
        # is theirs to dispatch: run now, it would run early, or run its
        # fan-out stage's handler on its own payload.
        guard=NOT_WAITING_FOR_JOBS,
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
    # Fan-out and join (ADR-0047), FAN_OUT's children written by the FanOut
    # hook (store/machine/fanout.py), JOIN decided with the dependencies.
    Transition.FAN_OUT: Rule(
        _LIVE,
        JobState.QUEUED,
        ATTEMPT_FENCE,
        EventType.STAGE_SUCCEEDED,
        guard=f"{NEXT_STAGE} AND s.fan_out",
        # At the fan-out stage, waiting for its children like a dependent:
        # no dispatch until the last of them settles it.
        sets=f"{_AT_STAGE}, retry_base = jobs.attempt, dispatch_id = NULL, "
        "lease_token = NULL, lease_expires_at = NULL, next_attempt_time = NULL, "
        "error_code = NULL, error_message = NULL, error_retryable = false, "
        "cancel_requested_at = NULL, cancel_reason = NULL, handbacks = 0, "
        f"waiting_code = '{WaitingCode.DEPENDENCIES}', waiting_reason = format('waiting for "
        f"its %s children of stage %s to end', {_CHILDREN}, s.name), fan_stage = s.idx, "
        f"fan_size = {_CHILDREN}, deps_waiting = {_CHILDREN}, deps_failed = 0, fan_progress = 0, "
        "deps_failed_on = NULL, after_failure = 'fail', deps_tolerate = s.max_failures, "
        "deps_wait_all = NOT s.fail_fast",
        message="format('stage %s succeeded; %s children run stage %s', p.name, "
        "j.fan_size, j.stage_name)",
        data="jsonb_build_object('stage', p.name, 'next_stage', j.stage_name, "
        "'children', j.fan_size)",
        lifecycle=Lifecycle.STAGE_SUCCEEDED,
        stage="p.name",
        using="job_stages s",
    ),
    Transition.JOIN: Rule(
        frozenset({Phase.QUEUED}),
        JobState.QUEUED,
        "id = ANY (:ids), locked in id order",
        EventType.STAGE_SUCCEEDED,
        dispatch=True,
        guard=f"{FANNED} AND {WAITS_FOR_DEPS} AND {DEPS_MET}",
        sets=f"the stage after: {_AT_STAGE}, retry_base = attempt, dispatch_id = "
        f"gen_random_uuid(), next_attempt_time = NULL, {NOT_WAITING}",
        message="format('stage %s: its %s children ended (%s failed); %s is next', p.name, "
        "j.fan_size, j.deps_failed, j.stage_name)",
        data="jsonb_build_object('stage', p.name, 'next_stage', j.stage_name, "
        "'children', j.fan_size, 'failed', j.deps_failed)",
        lifecycle=Lifecycle.STAGE_SUCCEEDED,
        stage="p.name",
    ),
    Transition.REJOIN: Rule(
        frozenset({Phase.FAILED, Phase.CANCELLED}),
        JobState.QUEUED,
        BY_ID,
        EventType.QUEUED,
        guard=FANNED,
        # Its children that did not succeed run again (RETRY, each): it waits
        # for them and for those still running, as after FAN_OUT.
        sets="retry_base = attempt, error_code = NULL, error_message = NULL, "
        "error_retryable = false, progress = greatest(stage_base, progress), "
        "cancel_requested_at = NULL, cancel_reason = NULL, end_time = NULL, "
        f"waiting_code = '{WaitingCode.DEPENDENCIES}', waiting_reason = format('waiting for "
        f"%s of its children of stage %s to end (run again: %s)', {_WAITS}, stage_name, "
        f"CAST(:rerun AS int)), deps_waiting = {_WAITS}, deps_failed = 0, deps_failed_on = NULL, "
        "fan_progress = CAST(:partial AS float8), "
        f"handbacks = 0, {KEEP_DEADLINE_AHEAD}",
        message=":event_message",
        lifecycle=Lifecycle.QUEUED,
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
