"""The job state machine: every transition of a job, its table, and its hook.

A job changes only through a named :class:`Transition`. :data:`RULES` is the
one table of them: the states each may start from, the state it ends in, the
row it matches (its fence), the guard beyond the state, the columns it sets,
the event it appends and whether it writes the job's next dispatch. The SQL
of every transition is built from its rule: the ``WHERE`` that says which
states it may start from is :func:`where_sources`, the ``SET state`` is the
rule's target, so nothing else in the store spells a job state by hand
(``tests/unit/test_machine.py`` holds the store to that).

What follows a transition — the WatchJob event, the next dispatch, the signal
to a running attempt that it is cancelled, and later lifecycle events,
pipeline stages and metrics — is a :class:`Hook`, registered on the
:class:`StateMachine`. A hook acts inside the transition's transaction, after
the job row changed, and never when the transition was refused:

- :meth:`Hook.writes` adds SQL to the transition's own statement: one
  data-modifying CTE over ``j``, the rows the transition changed (every
  column of ``jobs`` it asks for, plus ``transition`` and ``from_state``).
  This costs no round trip, so the hot paths (submit, claim, progress, the
  outcome) stay one statement each (ADR-0005). A write also commits only
  with the fence: a fenced-out attempt changes no row, so ``j`` is empty.
- :meth:`Hook.after` runs Python with the connection, once per changed row,
  after the statement and before the commit: ``(conn, Change(transition,
  row, from_state, cause))``. A transition with such a hook runs in a
  transaction (not autocommit); it must do no I/O outside the database.

See ADR-0010.
"""

from __future__ import annotations

import enum
import os
import re
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.observe import tracing
from jobplane.store.db import Conn, Database
from jobplane.store.rows import (
    CANCEL_CHANNEL,
    DOMAIN_EVENTS_CHANNEL,
    EVENTS_CHANNEL,
    JOB_FIELDS,
    OUTBOX_CHANNEL,
    dumps,
)
from jobplane.types import EventType, JobState, WaitingCode

if TYPE_CHECKING:
    from jobplane.events.envelope import Event

#: A connection a transition runs on: the hot paths' asyncpg one, or SQLAlchemy's.
AnyConn = Conn | AsyncConnection
#: A changed row as either connection returns it; read by column name.
Row = Any


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
PARKED = "dispatch_id IS NULL"
# The next stage's row exists (``s``: the statement's ``using``).
NEXT_STAGE = "s.job_id = jobs.id AND s.idx = jobs.stage + 1"
# ... the stage of the given index does (RetryJob from a named stage).
NAMED_STAGE = "s.job_id = jobs.id AND s.idx = :stage"
CANCEL_NOT_REQUESTED = "cancel_requested_at IS NULL"
# A job that stops waiting (claimed, ended, dispatched anew) has no reason to
# wait: only a QUEUED job ever has one.
NOT_WAITING = "waiting_reason = NULL, waiting_code = NULL"
# A reason noted again as it is changes nothing (no update_time, no row version).
CHANGES_REASON = (
    "(waiting_code IS DISTINCT FROM :waiting_code "
    "OR waiting_reason IS DISTINCT FROM :waiting_reason)"
)
# Said by the hand-back statement itself, which decides between the two.
LIVE_WORKER = "a live worker handles the job's type on its queue"
NO_LIVE_WORKER = "no live worker handles the job's type on its queue"

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
        guard=ATTEMPTS_LEFT,
        sets="attempt = attempt + 1, lease_token = :lease_token, "
        "lease_expires_at = now() + make_interval(secs => :lease_seconds), "
        "start_time = now(), next_attempt_time = NULL, cancel_requested_at = NULL, "
        # A new attempt starts from nothing: its STARTED event must not carry
        # the last attempt's progress.
        "cancel_reason = NULL, progress = stage_base, progress_message = '', "
        f"{NOT_WAITING}, handbacks = 0",
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
        "handbacks = 0",
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
        f"end_time = NULL, {NOT_WAITING}, handbacks = 0",
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
}


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


# Not a transition: the attempt's lease is extended, the job stays as it is
# and nothing is appended. Fenced like every write of an attempt.
HEARTBEAT = text(
    f"""
    UPDATE jobs SET lease_expires_at = now() + make_interval(secs => :lease_seconds)
    WHERE {ATTEMPT_FENCE} AND {where_sources(Transition.PROGRESS)}
    RETURNING cancel_requested_at IS NOT NULL AS cancel_requested
    """
)


@dataclass(frozen=True, slots=True)
class Emitted:
    """An event a handler emitted, committed only with its attempt's winning outcome.

    Made by :func:`jobplane.store.events.emitted`: the event, its body exactly
    as published and its idempotency fingerprint, all computed before the
    outcome's statement so that the statement only inserts them.
    """

    event: Event
    body: bytes
    request_hash: bytes

    @property
    def event_type(self) -> str:
        """The event's type."""
        return self.event.event_type

    @property
    def payload(self) -> Mapping[str, Any]:
        """The event's payload."""
        return self.event.payload


@dataclass(frozen=True, slots=True)
class NewStage:
    """One stage of a pipeline job, as submitted: its row of ``job_stages``."""

    name: str
    type: str
    queue: str
    version: str
    max_attempts: int
    timeout_seconds: float
    base: float  # the job's progress when the stage starts
    span: float  # the stage's share of the job's progress


@dataclass(frozen=True, slots=True)
class Cause:
    """Why a transition runs: what its event says, and what came with it.

    ``message`` and ``data`` are the job event's; ``emitted`` are the
    handler's events that must commit only if this transition applies;
    ``causation_id`` names the event that caused it, when one did;
    ``stages`` are new pipeline jobs' stages, by job id (submit only);
    ``blobs`` the blobs new jobs reference beyond their payloads' names, by
    job id (submit only). A submit creates many jobs in one statement: each
    job's stages and references go with it, and only a job the statement
    created (not one whose request_id was taken) gets them.
    """

    message: str = ""
    data: Mapping[str, Any] = field(default_factory=dict)
    emitted: Sequence[Emitted] = ()
    causation_id: uuid.UUID | None = None
    stages: Sequence[tuple[uuid.UUID, Sequence[NewStage]]] = ()
    #: Digests of blobs new jobs reference besides the names in their payloads
    #: (which the jobs table's trigger records), by job id: submit only.
    blobs: Sequence[tuple[uuid.UUID, Sequence[str]]] = ()


@dataclass(frozen=True, slots=True)
class Change:
    """A transition that applied to one job: what :meth:`Hook.after` receives."""

    transition: Transition
    row: Row  # the job after it: every column of ``jobs``
    from_state: JobState | None  # None for a new job
    cause: Cause


@dataclass(frozen=True, slots=True)
class Write:
    """SQL a hook adds to a transition's statement.

    ``sql`` is one data-modifying statement reading the changed rows as
    ``{j}`` (write ``FROM {j} AS j``); ``notify`` a ``pg_notify(...)``
    expression over ``j`` evaluated for each changed row (either may be
    empty); ``columns`` the columns of ``j`` they read.
    """

    sql: str = ""
    notify: str = ""
    columns: frozenset[str] = frozenset()
    #: The CTE's name, for a later write of the same hook to read its rows
    #: (``sql`` may then be a plain SELECT); unique within the statement.
    name: str = ""


class Hook:
    """What follows a transition, inside its transaction. Override either part."""

    def writes(self, transition: Transition) -> Sequence[Write]:
        """SQL folded into ``transition``'s statement; compiled once per machine."""
        return ()

    def binds(self, transition: Transition, cause: Cause) -> Mapping[str, Any]:
        """The bind values :meth:`writes` use, for one application."""
        return {}

    def writes_many(self, transition: Transition) -> Sequence[Write]:
        """:meth:`writes` for the statement that applies ``transition`` to many rows at once.

        The machine reads each row's scalar binds from ``j`` (``:name``
        becomes ``j.b_name``), so the single-row SQL serves as it is. A list
        bind (an array, e.g. the emitted events) arrives as all the rows'
        lists end to end, with ``:name_k`` (each element's row, ``j.k``) and
        ``:name_ord`` (its place in its row's list, from 1): a hook that binds
        lists overrides this to join on them.
        """
        return self.writes(transition)

    def follows(self, transition: Transition) -> bool:
        """Whether :meth:`after` runs for ``transition``."""
        return False

    async def after(self, conn: AnyConn, change: Change) -> None:
        """Python after the statement, for each changed row, before the commit.

        ``conn`` is the transition's own: a :class:`~jobplane.store.db.Conn`
        on the hot paths, SQLAlchemy's ``AsyncConnection`` elsewhere.
        """


AfterFn = Callable[["AnyConn", Change], Awaitable[None]]


class _After(Hook):
    def __init__(self, fn: AfterFn, transitions: frozenset[Transition]) -> None:
        self._fn = fn
        self._transitions = transitions

    def follows(self, transition: Transition) -> bool:
        return transition in self._transitions

    async def after(self, conn: AnyConn, change: Change) -> None:
        await self._fn(conn, change)


_EVENT_COLUMNS = frozenset(
    {"id", "last_seq", "tenant_id", "state", "progress", "attempt", "stage", "stage_name"}
)
# The stage a pipeline job has just finished (p), for the event that says so.
_PREVIOUS_STAGE = "JOIN job_stages p ON p.job_id = j.id AND p.idx = j.stage - 1"
# A stage's own 0..1 as the job's progress (a plain job's base is 0, its span 1).
_JOB_PROGRESS = "least(1.0, {t}.stage_base + {t}.stage_span * {p})"


class JobEvents(Hook):
    """The job's own event (what WatchJob streams), under the row lock the UPDATE took.

    The UPDATE bumps ``last_seq``; the event gets that seq, so seqs are
    gap-free and in commit order for each job. The NOTIFY is a hint for
    watchers, sent at commit.
    """

    def writes(self, transition: Transition) -> Sequence[Write]:
        rule = RULES[transition]
        if rule.event is None:
            return ()
        # Nobody watches a job before it exists: no hint for a new one.
        notify = (
            "" if transition is Transition.SUBMIT else f"pg_notify('{EVENTS_CHANNEL}', j.id::text)"
        )
        if transition is Transition.PROGRESS:
            # One event per report of the batch, after the row's last seq.
            progress = _JOB_PROGRESS.format(t="j", p="p.progress")
            sql = f"""
        INSERT INTO job_events
            (job_id, seq, tenant_id, type, state, progress, message, data, attempt, stage)
        SELECT j.id, j.last_seq - j.n + p.ord, j.tenant_id, 'progress', j.state, {progress},
               p.message, CAST(p.data AS jsonb), j.attempt, j.stage_name
        FROM unnest(CAST(:ks AS bigint[]), CAST(:ords AS int[]), CAST(:progresses AS float8[]),
                    CAST(:messages AS text[]), CAST(:datas AS text[]))
            AS p(k, ord, progress, message, data)
        JOIN {{j}} AS j ON j.k = p.k"""
            return [Write(sql, notify, _EVENT_COLUMNS | {"n", "k", "stage_base", "stage_span"})]
        previous = _PREVIOUS_STAGE if transition is Transition.ADVANCE else ""
        sql = f"""
        INSERT INTO job_events
            (job_id, seq, tenant_id, type, state, progress, message, data, attempt, stage)
        SELECT j.id, j.last_seq, j.tenant_id, '{rule.event.value}', j.state, j.progress,
               {rule.message}, {rule.data}, j.attempt, {rule.stage}
        FROM {{j}} AS j {previous}"""
        extra = {"waiting_reason"} if transition is Transition.PARK else set()
        if transition is Transition.UNPARK:
            extra = {"type"}
        return [Write(sql, notify, _EVENT_COLUMNS | extra)]

    def binds(self, transition: Transition, cause: Cause) -> Mapping[str, Any]:
        rule = RULES[transition]
        if rule.event is None or ":event_message" not in rule.message:
            return {}
        return {"event_message": cause.message, "event_data": dumps(dict(cause.data))}


class Dispatches(Hook):
    """The job's next dispatch: an outbox row whose id the job's ``dispatch_id`` names.

    Due at the job's ``next_attempt_time`` (now when unset). A QUEUED job
    cancelled drops its pending (re)dispatch, so nothing is published.
    """

    def writes(self, transition: Transition) -> Sequence[Write]:
        if RULES[transition].dispatch:
            return [
                Write(
                    f"""
        INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id, available_at,
                            headers)
        SELECT j.dispatch_id, j.tenant_id, j.id, j.type, j.correlation_id,
               coalesce(j.next_attempt_time, now()), {_trace_headers(transition)}
        FROM {{j}} AS j""",
                    f"pg_notify('{OUTBOX_CHANNEL}', '')",
                    frozenset(
                        {"dispatch_id", "tenant_id", "id", "type", "correlation_id"}
                        | {"next_attempt_time"}
                    ),
                )
            ]
        if transition is Transition.CANCEL:
            return [
                Write(
                    """
        DELETE FROM outbox o USING {j} AS j
        WHERE o.job_id = j.id AND o.tenant_id = j.tenant_id AND o.published_at IS NULL""",
                    columns=frozenset({"id", "tenant_id"}),
                )
            ]
        return ()

    def binds(self, transition: Transition, cause: Cause) -> Mapping[str, Any]:
        return tracing.trace_binds() if RULES[transition].dispatch else {}


# Transitions with no span of their own to carry (the sweeper's, an operator's
# re-dispatch, a worker starting): with tracing on, their dispatch keeps the
# trace context of the job's previous one.
_INHERITS_TRACE = frozenset(
    {Transition.EXPIRE_LEASE, Transition.REDISPATCH, Transition.UNPARK, Transition.HAND_BACK}
)


def _trace_headers(transition: Transition) -> str:
    """SQL over j: a dispatch's headers, the W3C trace context (docs/tracing.md)."""
    inherit = (
        "WHEN CAST(:trace_inherit AS boolean) THEN coalesce((SELECT o.headers FROM outbox o "
        "WHERE o.job_id = j.id AND o.kind = 'job.dispatch' ORDER BY o.available_at DESC "
        "LIMIT 1), '{}'::jsonb) "
        if transition in _INHERITS_TRACE
        else ""
    )
    return (
        "CASE WHEN CAST(:trace_parent AS text) IS NOT NULL THEN jsonb_strip_nulls("
        "jsonb_build_object('traceparent', CAST(:trace_parent AS text), "
        f"'tracestate', CAST(:trace_state AS text))) {inherit}ELSE '{{}}'::jsonb END"
    )


def _stage_update(sets: str, which: str = "s.idx = j.stage") -> str:
    return f"""
        UPDATE job_stages s SET {sets}, update_time = now()
        FROM {{j}} AS j
        WHERE s.job_id = j.id AND {which}"""


_STAGE_ENDED = "end_time = now()"
_STAGE_ERROR = "error_code = j.error_code, error_message = j.error_message"
_STAGE_CLEAR = "result = NULL, error_code = NULL, error_message = NULL, end_time = NULL"
_STAGE_FAILED = _stage_update(f"state = 'failed', {_STAGE_ERROR}, {_STAGE_ENDED}")
_STAGE_WAITS = _stage_update(f"state = 'queued', {_STAGE_ERROR}")
_STAGE_CANCELLED = _stage_update(
    "state = CASE WHEN s.idx = j.stage THEN 'cancelled' ELSE 'skipped' END, "
    "end_time = CASE WHEN s.idx = j.stage THEN now() END",
    "s.idx >= j.stage AND s.state NOT IN ('succeeded', 'failed')",
)
# Resuming at the job's stage (RetryJob, or a restart from a named stage):
# it waits again, and every later stage is to run again.
_STAGE_RESUMED = _stage_update(
    f"state = CASE WHEN s.idx = j.stage THEN 'queued' ELSE 'pending' END, {_STAGE_CLEAR}, "
    "attempts = CASE WHEN s.idx = j.stage THEN s.attempts ELSE 0 END, "
    "start_time = CASE WHEN s.idx = j.stage THEN s.start_time END",
    "s.idx >= j.stage",
)
_STAGE_ERROR_COLUMNS = frozenset({"id", "stage", "error_code", "error_message"})
# Where the job ends FAILED at its stage, and where the stage waits for another attempt.
_STAGE_FAILS = (
    Transition.FAIL,
    Transition.EXHAUST,
    Transition.EXPIRE_LAST_LEASE,
    Transition.RELAY_FAIL,
)
_STAGE_RETRIES = (Transition.SCHEDULE_RETRY, Transition.EXPIRE_LEASE)
_STAGE_WRITES: Mapping[Transition, tuple[str, frozenset[str]]] = {
    Transition.SUBMIT: (
        # Each new job's stages (s.job_id), for the jobs the insert created.
        """
        INSERT INTO job_stages (job_id, idx, tenant_id, name, type, queue, version,
                                max_attempts, timeout_seconds, base, span, state)
        SELECT j.id, s.idx, j.tenant_id, s.name, s.type, s.queue, s.version,
               s.max_attempts, s.timeout_seconds, s.base, s.span,
               CASE WHEN s.idx = 0 THEN 'queued' ELSE 'pending' END
        FROM {j} AS j
        JOIN unnest(CAST(:stage_jobs AS uuid[]), CAST(:stage_idxs AS int[]),
                    CAST(:stage_names AS text[]), CAST(:stage_types AS text[]),
                    CAST(:stage_queues AS text[]), CAST(:stage_versions AS text[]),
                    CAST(:stage_max_attempts AS int[]), CAST(:stage_timeouts AS float8[]),
                    CAST(:stage_bases AS float8[]), CAST(:stage_spans AS float8[]))
                 AS s(job_id, idx, name, type, queue, version, max_attempts,
                      timeout_seconds, base, span)
          ON s.job_id = j.id""",
        frozenset({"id", "tenant_id"}),
    ),
    Transition.CLAIM: (
        _stage_update(
            "state = 'running', attempts = s.attempts + 1, "
            "start_time = coalesce(s.start_time, now()), end_time = NULL"
        ),
        frozenset({"id", "stage"}),
    ),
    Transition.ADVANCE: (
        _stage_update(
            "state = CASE WHEN s.idx = j.stage THEN 'queued' ELSE 'succeeded' END, "
            "result = CASE WHEN s.idx = j.stage THEN NULL ELSE CAST(:result AS jsonb) END, "
            "error_code = NULL, error_message = NULL, "
            "end_time = CASE WHEN s.idx = j.stage THEN NULL ELSE now() END",
            "s.idx IN (j.stage - 1, j.stage)",
        ),
        frozenset({"id", "stage"}),
    ),
    Transition.SUCCEED: (
        _stage_update(
            "state = 'succeeded', result = j.result, error_code = NULL, error_message = NULL, "
            f"{_STAGE_ENDED}"
        ),
        frozenset({"id", "stage", "result"}),
    ),
    **{t: (_STAGE_FAILED, _STAGE_ERROR_COLUMNS) for t in _STAGE_FAILS},
    **{t: (_STAGE_WAITS, _STAGE_ERROR_COLUMNS) for t in _STAGE_RETRIES},
    Transition.CANCEL: (_STAGE_CANCELLED, frozenset({"id", "stage"})),
    Transition.CANCELLED: (_STAGE_CANCELLED, frozenset({"id", "stage"})),
    Transition.RETRY: (_STAGE_RESUMED, frozenset({"id", "stage"})),
    Transition.RESTART: (_STAGE_RESUMED, frozenset({"id", "stage"})),
}


class Stages(Hook):
    """A pipeline job's stages: their rows in ``job_stages``, kept with each transition.

    Written in the transition's own statement (no round trip); a plain job
    (``stage`` NULL) matches no row. The stages are written with the job;
    after that each transition records what it did to the stage that runs:
    its state, attempts, timings, last error, and on success its result,
    keyed by (job, stage, version). A cancel skips every later stage; a
    retry or restart makes the stage wait again and every later one pending.
    """

    def writes(self, transition: Transition) -> Sequence[Write]:
        found = _STAGE_WRITES.get(transition)
        if found is None:
            return ()
        sql, columns = found
        return [Write(sql, columns=columns)]

    def binds(self, transition: Transition, cause: Cause) -> Mapping[str, Any]:
        if transition is not Transition.SUBMIT:
            return {}
        rows = [(job, idx, st) for job, stages in cause.stages for idx, st in enumerate(stages)]
        return {
            "stage_jobs": [job for job, _, _ in rows],
            "stage_idxs": [idx for _, idx, _ in rows],
            "stage_names": [st.name for _, _, st in rows],
            "stage_types": [st.type for _, _, st in rows],
            "stage_queues": [st.queue for _, _, st in rows],
            "stage_versions": [st.version for _, _, st in rows],
            "stage_max_attempts": [st.max_attempts for _, _, st in rows],
            "stage_timeouts": [st.timeout_seconds for _, _, st in rows],
            "stage_bases": [st.base for _, _, st in rows],
            "stage_spans": [st.span for _, _, st in rows],
        }


class BlobReferences(Hook):
    """A new job's references to blobs its payload does not name (those inside an
    offloaded payload), as ``input`` rows of ``job_blobs``, in the submit's statement.

    The names in the payload itself are recorded by the ``jobs`` table's
    trigger (migration 0013), whoever inserts the job.
    """

    def writes(self, transition: Transition) -> Sequence[Write]:
        if transition is not Transition.SUBMIT:
            return ()
        sql = """
        INSERT INTO job_blobs (tenant_id, job_id, digest, role)
        SELECT j.tenant_id, j.id, b.digest, 'input'
        FROM {j} AS j
        JOIN unnest(CAST(:input_blob_jobs AS uuid[]), CAST(:input_blobs AS text[]))
            AS b(job_id, digest) ON b.job_id = j.id
        ON CONFLICT DO NOTHING"""
        return [Write(sql, columns=frozenset({"id", "tenant_id"}))]

    def binds(self, transition: Transition, cause: Cause) -> Mapping[str, Any]:
        if transition is not Transition.SUBMIT:
            return {}
        rows = [(job, digest) for job, digests in cause.blobs for digest in digests]
        return {
            "input_blob_jobs": [job for job, _ in rows],
            "input_blobs": [digest for _, digest in rows],
        }


class CancelSignal(Hook):
    """Wakes the worker that runs a job whose cancellation was requested."""

    def writes(self, transition: Transition) -> Sequence[Write]:
        if transition is Transition.REQUEST_CANCEL:
            notify = f"pg_notify('{CANCEL_CHANNEL}', j.id::text)"
            return [Write(notify=notify, columns=frozenset({"id"}))]
        return ()


#: The variable that turns lifecycle events off (``0``); they are on by default.
LIFECYCLE_ENV = "JOBPLANE_LIFECYCLE_EVENTS"
#: Events a handler may emit in one attempt, and their encoded bytes in all.
MAX_EMITTED_EVENTS = 100
MAX_EMITTED_BYTES = 1024 * 1024
# Where each event of a transition sits among the job's events: emitted events
# first (1..MAX_EMITTED_EVENTS), its lifecycle event last. The events rows are
# inserted in this order, so their seq (the feed's order within a
# transaction) follows it.
_ORDER_SLOTS = 1024
_LIFECYCLE_ORD = _ORDER_SLOTS - 1


def lifecycle_events_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``JOBPLANE_LIFECYCLE_EVENTS`` leaves lifecycle events on (all but 0/false/off)."""
    value = (os.environ if env is None else env).get(LIFECYCLE_ENV, "").strip().lower()
    return value not in {"0", "false", "no", "off"}


def lifecycle_event_id(job_id: uuid.UUID, seq: int) -> uuid.UUID:
    """The event_id of a job's lifecycle event that took the job's event seq ``seq``.

    A name-based UUID (version 3: MD5 of the job id's 16 bytes and the seq
    in decimal), so SQL computes it too (:func:`_event_id_sql`) and a
    transition names its cause without reading it back.
    """
    return uuid.uuid3(job_id, str(seq))


def _event_id_sql(job_id: str, seq: str) -> str:
    """SQL: :func:`lifecycle_event_id` of the uuid ``job_id`` and the integer ``seq``."""
    digest = f"decode(md5(uuid_send({job_id}) || convert_to(CAST({seq} AS text), 'UTF8')), 'hex')"
    return (
        f"CAST(encode(set_byte(set_byte({digest}, 6, (get_byte({digest}, 6) & 15) | 48), "
        f"8, (get_byte({digest}, 8) & 63) | 128), 'hex') AS uuid)"
    )


# RFC 3339 in UTC with microseconds, as jobplane.events.format_timestamp
# writes it ('#' for ':', which text() would take for a bind's start).
_TIME_TEXT = (
    "replace(to_char({t} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24#MI#SS.US\"Z\"'), '#', ':')"
)


def _lifecycle_payload(lifecycle: Lifecycle) -> str:
    """SQL over j: a lifecycle event's payload, as jsonb."""
    pairs = [
        ("name", "'jobs/' || j.id"),
        ("job_id", "CAST(j.id AS text)"),
        ("type", "coalesce(j.pipeline, j.type)"),
        ("queue", "j.queue"),
        ("state", "CAST(j.state AS text)"),
        ("attempt", "j.attempt"),
        ("max_attempts", "j.max_attempts"),
        ("labels", "coalesce(j.labels, '{}')"),
    ]
    if lifecycle in (Lifecycle.FAILED, Lifecycle.CANCELLED, Lifecycle.RETRY_SCHEDULED):
        error = (
            "jsonb_build_object('code', j.error_code, 'message', j.error_message, "
            "'retryable', coalesce(j.error_retryable, false))"
        )
        pairs.append(("error", error))
    if lifecycle is Lifecycle.RETRY_SCHEDULED:
        pairs.append(("next_attempt_time", _TIME_TEXT.format(t="j.next_attempt_time")))
    if lifecycle is Lifecycle.CANCEL_REQUESTED:
        pairs.append(("reason", "coalesce(j.cancel_reason, '')"))
    payload = "jsonb_build_object(" + ", ".join(f"'{key}', {value}" for key, value in pairs) + ")"
    # A pipeline job's events say where in the pipeline it is; a plain job's
    # payload is as it always was.
    stage = "j.stage_name"
    extra = ""
    if lifecycle is Lifecycle.STAGE_SUCCEEDED:
        stage = "(SELECT p.name FROM job_stages p WHERE p.job_id = j.id AND p.idx = j.stage - 1)"
        extra = ", 'next_stage', j.stage_name"
    return (
        f"({payload} || CASE WHEN j.pipeline IS NULL THEN '{{}}'::jsonb ELSE jsonb_build_object("
        f"'pipeline', j.pipeline, 'pipeline_version', coalesce(j.pipeline_version, ''), "
        f"'stage', {stage}, 'stage_type', j.type{extra}) END)"
    )


_LIFECYCLE_COLUMNS = frozenset(
    {"id", "tenant_id", "type", "queue", "state", "attempt", "max_attempts", "labels"}
    | {"correlation_id", "error_code", "error_message", "error_retryable", "last_seq"}
    | {"lifecycle_seq", "lifecycle_cause", "next_attempt_time", "cancel_reason"}
    | {"pipeline", "pipeline_version", "stage", "stage_name"}
)


# The trace context of the span the transition applied under: the events'
# traceparent, as PublishEvent stores the caller's (docs/tracing.md).
_TRACE_COLUMNS = (
    "CAST(:trace_parent AS text) AS traceparent, CAST(:trace_state AS text) AS tracestate"
)

# A handler's emitted events commit with its attempt's success: the job's, or its stage's.
_WITH_EMITTED = frozenset({Transition.SUCCEED, Transition.ADVANCE})


class DomainEvents(Hook):
    """Domain events of a transition: its lifecycle event, and the handler's emitted events.

    Both are rows of ``events`` written in the transition's own statement,
    as :func:`jobplane.store.events.append` writes them, so they commit only
    with the transition and add no round trip; the relays publish them from
    there in commit order (ADR-0016). A lifecycle event's id is
    :func:`lifecycle_event_id` of the job and the seq of its job event; its
    causation is the job's lifecycle event before it (``lifecycle_cause``),
    its correlation the job's correlation id (its id when it has none).
    Emitted events come with a succeeding attempt only (``Cause.emitted``),
    inserted before its ``job.succeeded``, so the feed's commit order puts
    them in front of it.

    An event_id stored already (a publisher took it first) is not written
    again: the stored event stands.
    """

    def __init__(self, *, lifecycle: bool = True) -> None:
        self.lifecycle = lifecycle

    def writes(self, transition: Transition) -> Sequence[Write]:
        return self._writes(transition, many=False)

    def writes_many(self, transition: Transition) -> Sequence[Write]:
        return self._writes(transition, many=True)

    def _writes(self, transition: Transition, *, many: bool) -> Sequence[Write]:
        rule = RULES[transition]
        selects = []
        if self.lifecycle and rule.lifecycle is not None:
            # The job's correlation id, or its id when it has none (or one
            # no envelope can carry: only a row written around the checks).
            correlation = (
                "CASE WHEN octet_length(j.correlation_id) BETWEEN 1 AND 255 AND j.correlation_id "
                "!~ ('[' || chr(1) || '-' || chr(31) || chr(127) || ']') "
                "THEN j.correlation_id ELSE CAST(j.id AS text) END"
            )
            cause = _event_id_sql("j.id", "j.lifecycle_cause")
            selects.append(
                f"""
            SELECT {_event_id_sql("j.id", "j.lifecycle_seq")} AS event_id,
                   CAST('{rule.lifecycle.value}' AS text) AS event_type,
                   clock_timestamp() AS event_time, j.tenant_id, {correlation} AS correlation_id,
                   CAST(NULL AS text) AS project_id,
                   CASE WHEN j.lifecycle_cause IS NOT NULL THEN CAST({cause} AS text) END
                       AS causation_id,
                   {_lifecycle_payload(rule.lifecycle)} AS payload,
                   CAST('' AS bytea) AS request_hash,
                   j.id AS job_id, CAST(j.last_seq AS bigint) * {_ORDER_SLOTS} + {_LIFECYCLE_ORD}
                       AS order_seq, {_TRACE_COLUMNS}
            FROM {{j}} AS j"""
            )
        if transition in _WITH_EMITTED:
            # Many rows: each row's events are its slice of the lists (their
            # row in :emitted_ids_k, their place in it in :emitted_ids_ord).
            arrays = (
                "CAST(:emitted_ids AS uuid[]), CAST(:emitted_types AS text[]),\n"
                "                        CAST(:emitted_times AS timestamptz[]),\n"
                "                        CAST(:emitted_correlations AS text[]),\n"
                "                        CAST(:emitted_projects AS text[]),\n"
                "                        CAST(:emitted_causations AS text[]), "
                "CAST(:emitted_payloads AS text[]),\n"
                "                        CAST(:emitted_hashes AS bytea[])"
            )
            columns = (
                "event_id, event_type, event_time, correlation_id, project_id, causation_id, "
                "payload, "
            )
            if many:
                events = (
                    f"unnest({arrays}, CAST(:emitted_ids_k AS bigint[]), "
                    f"CAST(:emitted_ids_ord AS bigint[]))\n"
                    f"                     AS m({columns}request_hash, k, ord)"
                )
                match = "\n            WHERE m.k = j.k"
            else:
                events = (
                    f"unnest({arrays})\n"
                    f"                     WITH ORDINALITY AS m({columns}request_hash, ord)"
                )
                match = ""
            selects.append(
                f"""
            SELECT m.event_id, m.event_type, m.event_time, j.tenant_id, m.correlation_id,
                   m.project_id, m.causation_id, CAST(m.payload AS jsonb) AS payload,
                   m.request_hash,
                   j.id AS job_id, CAST(j.last_seq AS bigint) * {_ORDER_SLOTS} + m.ord AS order_seq,
                   {_TRACE_COLUMNS}
            FROM {{j}} AS j,
                 {events}{match}"""
            )
        if not selects:
            return ()
        union = "\n            UNION ALL".join(selects)
        # Inserted in order_seq order: a transition's events take their seq
        # (the feed's order within its transaction) in the order they happened.
        # A lifecycle event has no fingerprint (an empty one): nothing
        # publishes it again but a PublishEvent taking its id, which is then
        # compared by value.
        return [
            Write(
                f"""
        INSERT INTO events (tenant_id, event_id, event_type, event_time, correlation_id,
                            project_id, causation_id, payload, request_hash, job_id,
                            traceparent, tracestate)
        SELECT tenant_id, event_id, event_type, event_time, correlation_id, project_id,
               causation_id, payload, request_hash, job_id, traceparent, tracestate
        FROM ({union}
        ) AS x
        ORDER BY order_seq
        ON CONFLICT (tenant_id, event_id) DO NOTHING""",
                columns=_LIFECYCLE_COLUMNS,
            ),
            Write(
                notify=f"pg_notify('{DOMAIN_EVENTS_CHANNEL}', CAST(j.tenant_id AS text))",
                columns=frozenset({"tenant_id"}),
            ),
        ]

    def binds(self, transition: Transition, cause: Cause) -> Mapping[str, Any]:
        if transition not in _WITH_EMITTED:
            return tracing.trace_binds()
        emitted = cause.emitted
        return {
            **tracing.trace_binds(),
            "emitted_ids": [e.event.event_id for e in emitted],
            "emitted_types": [e.event.event_type for e in emitted],
            "emitted_times": [e.event.timestamp for e in emitted],
            "emitted_correlations": [e.event.correlation_id for e in emitted],
            "emitted_projects": [e.event.project_id for e in emitted],
            "emitted_causations": [e.event.causation_id for e in emitted],
            "emitted_payloads": [dumps(e.event.payload) for e in emitted],
            "emitted_hashes": [e.request_hash for e in emitted],
        }


def builtin_hooks(*, lifecycle: bool | None = None) -> list[Hook]:
    """What every transition writes: its event, its dispatch, its signal, its domain events.

    ``lifecycle``: whether transitions publish their lifecycle events (None:
    as ``JOBPLANE_LIFECYCLE_EVENTS`` says, on unless it is ``0``).
    """
    if lifecycle is None:
        lifecycle = lifecycle_events_enabled()
    return [
        JobEvents(),
        Dispatches(),
        CancelSignal(),
        Stages(),
        BlobReferences(),
        DomainEvents(lifecycle=lifecycle),
    ]


# What a caller wants back from a statement: columns of j (job columns, plus
# those a special statement adds: see each one).
Returning = tuple[str, ...]
ALL: Returning = JOB_FIELDS


@dataclass(frozen=True, slots=True)
class _Compiled:
    statement: TextClause
    hooks: tuple[Hook, ...]  # whose binds it needs
    after: tuple[Hook, ...]  # whose after() runs


class StateMachine:
    """Compiles each transition's statement with its hooks' writes, and applies it."""

    def __init__(
        self, hooks: Iterable[Hook] | None = None, *, lifecycle: bool | None = None
    ) -> None:
        self._hooks: list[Hook] = (
            builtin_hooks(lifecycle=lifecycle) if hooks is None else list(hooks)
        )
        self._compiled: dict[tuple[Transition, Returning], _Compiled] = {}
        self._many: dict[
            tuple[Transition, Returning, str], tuple[TextClause, tuple[str, ...], tuple[str, ...]]
        ] = {}

    def register(self, hook: Hook) -> Hook:
        """Add ``hook`` after those registered; statements are compiled anew."""
        self._hooks.append(hook)
        self._compiled.clear()
        self._many.clear()
        return hook

    def set_lifecycle_events(self, enabled: bool) -> None:
        """Turn the transitions' lifecycle events on or off (emitted events stay)."""
        for hook in self._hooks:
            if isinstance(hook, DomainEvents):
                hook.lifecycle = enabled
        self._compiled.clear()
        self._many.clear()

    def on(self, transitions: Iterable[Transition], fn: AfterFn) -> Hook:
        """Run ``fn(conn, change)`` after each of ``transitions``, in its transaction."""
        return self.register(_After(fn, frozenset(transitions)))

    def in_transaction(self, *transitions: Transition) -> bool:
        """Whether ``transitions`` must run in a transaction (a hook runs after them)."""
        return any(h.follows(t) for h in self._hooks for t in transitions)

    def connect(
        self, engine: AsyncEngine, auto: AsyncEngine, *transitions: Transition, many: bool = False
    ) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for ``transitions``: autocommit when they are one statement.

        ``many``: the caller runs more than one statement in it.
        """
        if many or self.in_transaction(*transitions):
            return engine.begin()
        return auto.connect()

    def session(
        self, db: Database, *transitions: Transition, many: bool = False
    ) -> AbstractAsyncContextManager[Conn]:
        """:meth:`connect` on the hot paths' :class:`~jobplane.store.db.Database`."""
        if many or self.in_transaction(*transitions):
            return db.begin()
        return db.connect()

    def statement(self, transition: Transition, returning: Returning = ALL) -> TextClause:
        """The statement of ``transition`` (or of its group, for the hand-back)."""
        return self._compile(transition, returning).statement

    async def apply(
        self,
        conn: AnyConn,
        transition: Transition,
        params: Mapping[str, Any],
        cause: Cause = Cause(),
        *,
        returning: Returning = ALL,
    ) -> Sequence[Row]:
        """Run ``transition``; the changed rows (none when it was refused).

        Hooks' writes ran in the statement; their :meth:`Hook.after` run now,
        for each changed row, on ``conn`` (which must be in a transaction
        when any does: see :meth:`connect`).
        """
        compiled = self._compile(transition, returning)
        binds = dict(params)
        for t in _group(transition):
            for hook in compiled.hooks:
                binds.update(hook.binds(t, cause))
        rows = await fetch_rows(conn, compiled.statement, binds)
        if tracing.ENABLED and rows:
            tracing.applied(transition)
        if compiled.after:
            for row in rows:
                done = Transition(row["transition"])
                from_state = None if row["from_state"] is None else JobState(row["from_state"])
                change = Change(done, row, from_state, cause)
                for hook in compiled.after:
                    if hook.follows(done):
                        await hook.after(conn, change)
        return rows

    def prepare(
        self, transition: Transition, params: Mapping[str, Any], cause: Cause = Cause()
    ) -> dict[str, Any]:
        """The binds of one application of ``transition``: ``params`` and its hooks' binds.

        Taken where the application is asked for, so what a hook reads from
        the caller's context (its trace span) is the caller's, even when the
        row is applied later with others (:meth:`apply_many`).
        """
        binds = dict(params)
        for t in _group(transition):
            for hook in self._hooks:
                binds.update(hook.binds(t, cause))
        return binds

    def groupable(self, transition: Transition) -> bool:
        """Whether :meth:`apply_many` can apply ``transition``: one fenced ``UPDATE``
        built from its rule, with no :meth:`Hook.after` (which runs per row in a
        transaction)."""
        return transition not in _WRITTEN_OUT and not self.in_transaction(transition)

    async def apply_many(
        self,
        conn: AnyConn,
        transition: Transition,
        rows: Sequence[Mapping[str, Any]],
        *,
        returning: Returning = ALL,
    ) -> list[Row | None]:
        """Apply ``transition`` to many jobs in one statement; for each of ``rows``
        (binds from :meth:`prepare`), in order, its changed row or None (refused).

        Each row is fenced by its own binds exactly as :meth:`apply` fences
        one, the jobs are locked in id order (two such statements never
        deadlock), and the hooks' writes apply to each changed row as they
        would alone. Two rows for one job change it once (either of them).
        """
        if not self.groupable(transition):
            raise ValueError(f"{transition} cannot be applied to many rows in one statement")
        if not rows:
            return []
        statement, scalars, lists = self._compile_many(transition, returning)
        binds: dict[str, Any] = {name: [row[name] for row in rows] for name in scalars}
        for name in lists:
            values: list[Any] = []
            ks: list[int] = []
            ords: list[int] = []
            for k, row in enumerate(rows, start=1):
                items = list(row[name])
                values.extend(items)
                ks.extend([k] * len(items))
                ords.extend(range(1, len(items) + 1))
            binds[name], binds[f"{name}_k"], binds[f"{name}_ord"] = values, ks, ords
        changed: list[Row | None] = [None] * len(rows)
        for found in await fetch_rows(conn, statement, binds):
            changed[int(found["k"]) - 1] = found
        return changed

    def _compile_many(
        self, transition: Transition, returning: Returning
    ) -> tuple[TextClause, tuple[str, ...], tuple[str, ...]]:
        key = (transition, returning, "many")
        found = self._many.get(key)
        if found is not None:
            return found
        writes = [w for h in self._hooks for w in h.writes_many(transition)]
        needs = set(returning)
        for w in writes:
            needs |= w.columns
        rule = RULES[transition]
        raw = " ".join([rule.match, rule.sets, rule.guard, *(w.sql for w in writes)])
        names = [n for n in dict.fromkeys(_BIND.findall(raw)) if not n.endswith(("_k", "_ord"))]
        unknown = [n for n in names if n not in BIND_TYPES]
        if unknown:
            raise ValueError(f"{transition}: no SQL type for the binds {unknown} (BIND_TYPES)")
        scalars = tuple(n for n in names if not BIND_TYPES[n].endswith("[]"))
        lists = tuple(n for n in names if BIND_TYPES[n].endswith("[]"))
        ctes = _changes_many(transition, needs, scalars)
        notifies = []
        for n, w in enumerate(writes):
            if w.sql:
                sql = _BIND.sub(
                    lambda m: (
                        m[0] if m[1] in lists or m[1].endswith(("_k", "_ord")) else f"j.b_{m[1]}"
                    ),
                    w.sql,
                )
                ctes.append(f"{w.name or f'w{n}'} AS ({sql.replace('{j}', 'j')}\n    )")
            if w.notify:
                notifies.append(f"{w.notify} AS n{n}")
        wanted = [*returning, "transition", "from_state", "k"]
        select = ", ".join([*(f"j.{c}" for c in dict.fromkeys(wanted)), *notifies])
        sql = "WITH " + ",\n".join(ctes) + f"\nSELECT {select} FROM j"
        compiled = (text(sql), scalars, lists)
        self._many[key] = compiled
        return compiled

    def _compile(self, transition: Transition, returning: Returning) -> _Compiled:
        key = (transition, returning)
        found = self._compiled.get(key)
        if found is not None:
            return found
        group = _group(transition)
        after = tuple(h for h in self._hooks if any(h.follows(t) for t in group))
        writes = [(t, w) for t in group for h in self._hooks for w in h.writes(t)]
        needs = set(returning)
        for _, w in writes:
            needs |= w.columns
        # Every row says which transition changed it, and from which state
        # (NULL unless a hook asks for it: it can cost a lookup).
        wanted = [*returning, "transition", "from_state"]
        if after:
            needs |= set(JOB_FIELDS) | {"from_state"}
            wanted = [*JOB_FIELDS, *wanted]
        ctes = [f"j AS ({_changes(transition, needs)})"]
        notifies = []
        for n, (t, w) in enumerate(writes):
            rows = "j" if len(group) == 1 else f"(SELECT * FROM j WHERE transition = '{t}')"
            if w.sql:
                ctes.append(f"{w.name or f'w{n}'} AS ({w.sql.replace('{j}', rows)}\n    )")
            if w.notify:
                expr = w.notify
                if len(group) > 1:
                    expr = f"CASE WHEN j.transition = '{t}' THEN {expr} END"
                notifies.append(f"{expr} AS n{n}")
        select = ", ".join([*(f"j.{c}" for c in dict.fromkeys(wanted)), *notifies])
        sql = "WITH " + ",\n".join(ctes) + f"\nSELECT {select} FROM j"
        hooks = tuple(h for h in self._hooks if any(h.writes(t) for t in group))
        compiled = _Compiled(text(sql), hooks, after)
        self._compiled[key] = compiled
        return compiled


async def fetch_rows(
    conn: AnyConn, statement: TextClause, binds: Mapping[str, Any]
) -> Sequence[Row]:
    """``statement``'s rows on either kind of connection, read by column name."""
    if isinstance(conn, Conn):
        return await conn.fetch(statement, binds)
    return (await conn.execute(statement, binds)).mappings().all()


def _group(transition: Transition) -> tuple[Transition, ...]:
    # The hand-back and the park are one statement: it decides between them.
    if transition in (Transition.HAND_BACK, Transition.PARK):
        return (Transition.HAND_BACK, Transition.PARK)
    return (transition,)


# Columns of jobs a hook may read besides JOB_FIELDS (which the API's reads use).
_HOOK_FIELDS = (*JOB_FIELDS, "lifecycle_seq", "lifecycle_cause", "cancel_reason")


def _returning(columns: Iterable[str], table: str, known: Iterable[str] = _HOOK_FIELDS) -> str:
    fields = set(known)
    return ", ".join(f"{table}.{c}" for c in sorted(columns) if c in fields)


def _from_state(transition: Transition, needs: set[str]) -> tuple[str, str, str]:
    """(FROM clause, WHERE terms, select expression) of the state before the change.

    One source: a constant. Several: the row as this statement's snapshot
    saw it, and the UPDATE applies only while the row is still in that state
    (a row changed meanwhile is re-checked by Postgres against the same
    snapshot row), so the state named is the state changed.
    """
    sources = {p.state for p in RULES[transition].sources}
    if not sources:
        return "", "", "CAST(NULL AS text)"
    if len(sources) == 1:
        return "", "", f"CAST('{next(iter(sources)).value}' AS text)"
    if "from_state" not in needs:
        return "", "", "CAST(NULL AS text)"
    if "id = :id" not in RULES[transition].match:
        raise ValueError(f"{transition}: several sources need a match by :id")
    return (
        "FROM (SELECT id AS o_id, state AS o_state FROM jobs WHERE id = :id) AS o",
        " AND jobs.id = o.o_id AND jobs.state = o.o_state",
        "o.o_state",
    )


def _changes(transition: Transition, needs: set[str]) -> str:
    """The data-modifying statement that changes the rows: ``j``'s body.

    Built from the rule, but for submit (an insert), the progress and unpark
    batches and the hand-back (which decides between two transitions in
    SQL): those are written out below, their state conditions still taken
    from the table.
    """
    if transition is Transition.SUBMIT:
        return _submit(needs)
    if transition is Transition.PROGRESS:
        return _progress(needs)
    if transition in (Transition.HAND_BACK, Transition.PARK):
        return _hand_back(needs)
    if transition is Transition.UNPARK:
        return _unpark(needs)
    rule = RULES[transition]
    source_from, source_where, from_expr = _from_state(transition, needs)
    sources = where_sources(transition)
    if rule.using:
        source_from = f"{source_from}, {rule.using}" if source_from else f"FROM {rule.using}"
        sources = where_sources(transition, "jobs")
    seq = "last_seq = jobs.last_seq + 1, " if rule.event is not None else ""
    if rule.lifecycle is not None:
        # The seq of the job's lifecycle event, and of the one before it
        # (its cause): the right-hand sides read the row as it was.
        seq += "lifecycle_cause = jobs.lifecycle_seq, lifecycle_seq = jobs.last_seq + 1, "
    guard = f" AND {rule.guard}" if rule.guard else ""
    return f"""
        UPDATE jobs SET state = '{rule.target.value}', {rule.sets}, {seq}update_time = now()
        {source_from}
        WHERE {rule.match} AND {sources}{guard}{source_where}
        RETURNING {_returning(needs, "jobs") or "jobs.id"},
                  CAST('{transition}' AS text) AS transition, {from_expr} AS from_state
    """


# Statements written out rather than built from their rule (see _changes).
_WRITTEN_OUT = frozenset(
    {Transition.SUBMIT, Transition.PROGRESS, Transition.HAND_BACK, Transition.PARK}
    | {Transition.UNPARK}
)
# A bind in a text() statement, as SQLAlchemy finds them (not a ``::`` cast).
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?![:\w])")
#: The SQL type of each bind a transition applied to many rows may use: its
#: rows' values go into one array of it (``…[]``: a list per row, end to end).
BIND_TYPES: Mapping[str, str] = {
    "id": "uuid",
    "tenant_id": "uuid",
    "dispatch_id": "uuid",
    "lease_token": "uuid",
    "attempt": "int",
    "refund": "int",
    "type": "text",
    "lease_seconds": "float8",
    "delay": "float8",
    "result": "text",
    "result_blob": "text",
    "result_blob_size": "bigint",
    "error_code": "text",
    "error_message": "text",
    "retryable": "boolean",
    "event_message": "text",
    "event_data": "text",
    "trace_parent": "text",
    "trace_state": "text",
    "trace_inherit": "boolean",
    "waiting_code": "text",
    "waiting_reason": "text",
    "emitted_ids": "uuid[]",
    "emitted_types": "text[]",
    "emitted_times": "timestamptz[]",
    "emitted_correlations": "text[]",
    "emitted_projects": "text[]",
    "emitted_causations": "text[]",
    "emitted_payloads": "text[]",
    "emitted_hashes": "bytea[]",
}


def _changes_many(transition: Transition, needs: set[str], binds: Sequence[str]) -> list[str]:
    """The CTEs that apply ``transition`` to many rows: ``i`` (each row's binds,
    ``b_<name>``, and its index ``k``), ``locked`` (the jobs that pass their
    row's fence, locked in id order) and ``j`` (the rows changed, with ``i``'s
    columns). The fence, guard and sets are the rule's, reading ``i``."""
    rule = RULES[transition]
    if "from_state" in needs and len({p.state for p in rule.sources}) > 1:
        raise ValueError(f"{transition}: from_state of many rows is not supported")
    _, _, from_expr = _from_state(transition, needs)

    def per_row(sql: str) -> str:
        return _BIND.sub(lambda m: f"i.b_{m[1]}", sql)

    arrays = ", ".join(f"CAST(:{n} AS {BIND_TYPES[n]}[])" for n in binds)
    columns = ", ".join(f"b_{n}" for n in binds)
    using = f", {rule.using}" if rule.using else ""
    guard = f" AND {per_row(rule.guard)}" if rule.guard else ""
    fence = f"{per_row(rule.match)} AND {where_sources(transition, 'jobs')}{guard}"
    seq = "last_seq = jobs.last_seq + 1, " if rule.event is not None else ""
    if rule.lifecycle is not None:
        seq += "lifecycle_cause = jobs.lifecycle_seq, lifecycle_seq = jobs.last_seq + 1, "
    # The rows are locked by id alone, through the primary key, and fenced by
    # the UPDATE that follows (which sees the locked version). Locked by the
    # fence, a prepared statement's generic plan, made while the table was
    # small, reached them through a partial index on their state instead: every
    # queued or running job, and every dead entry left by those passed through,
    # read for each group (34 ms a claim behind a backlog of 20,000 jobs).
    if "id" in binds:
        lock = """SELECT jobs.id AS l_id FROM jobs
        WHERE jobs.id = ANY(CAST(:id AS uuid[]))"""
    else:
        lock = f"""SELECT jobs.id AS l_id FROM jobs, i{using}
        WHERE {fence}"""
    return [
        f"i AS (SELECT * FROM unnest({arrays}) WITH ORDINALITY AS i({columns}, k))",
        f"""locked AS MATERIALIZED (
        {lock}
        ORDER BY jobs.id
        FOR UPDATE OF jobs
    )""",
        f"""j AS (
        UPDATE jobs SET state = '{rule.target.value}', {per_row(rule.sets)},
                        {seq}update_time = now()
        FROM i, locked{using}
        WHERE jobs.id = locked.l_id AND {fence}
        RETURNING {_returning(needs, "jobs") or "jobs.id"}, i.*,
                  CAST('{transition}' AS text) AS transition, {from_expr} AS from_state
    )""",
    ]


#: The columns of new jobs a submit binds, each as an array of one element a
#: job: column ``c`` of jobs is bound as ``:new_c`` (see :func:`_submit`).
SUBMIT_COLUMNS: Mapping[str, str] = {
    "id": "uuid",
    "type": "text",
    "queue": "text",
    "payload": "text",
    "max_attempts": "int",
    "request_id": "text",
    "request_hash": "bytea",
    "correlation_id": "text",
    "labels": "text",
    "dispatch_id": "uuid",
    "timeout_seconds": "float8",
    "pipeline": "text",
    "pipeline_version": "text",
    "stage": "int",
    "stage_name": "text",
    "stage_base": "float8",
    "stage_span": "float8",
    "payload_blob": "text",
    "payload_blob_size": "bigint",
}


def _submit(needs: set[str]) -> str:
    # The jobs, and with the hooks their first events and dispatch intents,
    # in one statement: one transaction, so a job exists iff its outbox row
    # does. Binds: :tenant_id and the arrays of SUBMIT_COLUMNS, one element a
    # job (SubmitJob binds one, BatchSubmitJobs up to 1,000). Rows are
    # inserted in array order, which the store sorts by request_id: two
    # batches that share request_ids take their unique-index entries in the
    # same order, so one waits for the other instead of deadlocking. A job
    # whose request_id conflicts is not written and no row comes back for it.
    arrays = ", ".join(f"CAST(:new_{name} AS {kind}[])" for name, kind in SUBMIT_COLUMNS.items())
    return f"""
        INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts, request_id,
                          request_hash, correlation_id, labels, dispatch_id, last_seq,
                          timeout_seconds, lifecycle_seq, pipeline, pipeline_version, stage,
                          stage_name, stage_base, stage_span,
                          payload_blob, payload_blob_size)
        SELECT n.id, CAST(:tenant_id AS uuid), n.type, n.queue,
               '{RULES[Transition.SUBMIT].target.value}', CAST(n.payload AS jsonb),
               n.max_attempts, n.request_id, n.request_hash, n.correlation_id,
               CAST(n.labels AS jsonb), n.dispatch_id, 1, n.timeout_seconds, 1, n.pipeline,
               n.pipeline_version, n.stage, n.stage_name, n.stage_base, n.stage_span,
               n.payload_blob, n.payload_blob_size
        FROM unnest({arrays})
            WITH ORDINALITY AS n({", ".join(SUBMIT_COLUMNS)}, ord)
        ORDER BY n.ord
        ON CONFLICT (tenant_id, request_id) DO NOTHING
        RETURNING {_returning(needs, "jobs") or "jobs.id"},
                  CAST('{Transition.SUBMIT}' AS text) AS transition,
                  CAST(NULL AS text) AS from_state
    """


def _progress(needs: set[str]) -> str:
    # The queued progress of many attempts in one statement: each attempt's
    # row is updated under its fence (locked in id order, so two batches
    # never deadlock) and its events get the seqs after the row's last_seq.
    # Attempts fenced out are missing from the result. Binds: per attempt
    # (index k) :ids, :attempts, :tokens, :ns, :last_progress, :last_message;
    # per report :ks, :ords, :progresses, :messages, :datas. Adds to j: k (the
    # attempt's index), n (its reports), cancel_requested.
    fence = (
        "jobs.attempt = i.attempt AND jobs.lease_token = i.lease_token "
        f"AND {where_sources(Transition.PROGRESS, 'jobs')}"
    )
    columns = _returning(needs, "jobs")
    return f"""
        WITH i AS (
            SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS int[]),
                                 CAST(:tokens AS uuid[]), CAST(:ns AS int[]),
                                 CAST(:last_progress AS float8[]), CAST(:last_message AS text[]))
                WITH ORDINALITY AS i(id, attempt, lease_token, n, last_progress, last_message, k)
        ), locked AS (
            SELECT jobs.id FROM jobs
            WHERE jobs.id = ANY(CAST(:ids AS uuid[]))
            ORDER BY jobs.id
            FOR UPDATE OF jobs
        )
        UPDATE jobs SET progress = {_JOB_PROGRESS.format(t="jobs", p="i.last_progress")},
                        progress_message = i.last_message,
                        last_seq = jobs.last_seq + i.n, update_time = now()
        FROM i, locked
        WHERE jobs.id = locked.id AND jobs.id = i.id AND {fence}
        RETURNING {columns + ", " if columns else ""}i.n, i.k,
                  jobs.cancel_requested_at IS NOT NULL AS cancel_requested,
                  CAST('{Transition.PROGRESS}' AS text) AS transition,
                  CAST('running' AS text) AS from_state
    """


def _hand_back(needs: set[str]) -> str:
    # A worker without the job's handler gives the job back without claiming
    # it, fenced on the message's dispatch: when a live worker handles the
    # job's type on its queue, a new dispatch is due after a jittered delay
    # that doubles with each hand-back (HAND_BACK, no event: hand-backs are
    # noise); otherwise the job is parked, with no dispatch at all (PARK, one
    # event saying why). Neither counts as an attempt. Adds to j: handled.
    rule = RULES[Transition.HAND_BACK]
    assert rule.sources == RULES[Transition.PARK].sources
    return f"""
        WITH cur AS (
            SELECT id, type, queue, handbacks FROM jobs
            WHERE {rule.match} AND {where_sources(Transition.HAND_BACK)}
            FOR UPDATE
        ), live AS (
            SELECT cur.id,
                   EXISTS (
                       SELECT 1 FROM workers w
                       WHERE w.stop_time IS NULL AND w.expire_time > now()
                         AND cur.type = ANY (w.types) AND cur.queue = ANY (w.queues)
                   ) AS handled,
                   least(CAST(:max_delay AS float8),
                         CAST(:base_delay AS float8) * power(2, least(cur.handbacks, 30)))
                       * (0.5 + random()) AS delay
            FROM cur
        )
        UPDATE jobs SET
            dispatch_id = CASE WHEN live.handled THEN CAST(:new_dispatch_id AS uuid) END,
            next_attempt_time = CASE WHEN live.handled
                THEN now() + make_interval(secs => live.delay) END,
            handbacks = jobs.handbacks + 1,
            waiting_reason = CASE WHEN live.handled
                THEN format('waiting for a worker that handles %s (handed back %s times by '
                            'workers without its handler)', jobs.type, jobs.handbacks + 1)
                ELSE format('no live worker handles type %s on queue %s', jobs.type, jobs.queue)
                END,
            waiting_code = CASE WHEN live.handled THEN '{WaitingCode.HANDED_BACK}'
                ELSE '{WaitingCode.NO_LIVE_WORKER}' END,
            last_seq = jobs.last_seq + CASE WHEN live.handled THEN 0 ELSE 1 END,
            update_time = now()
        FROM live
        WHERE jobs.id = live.id
        RETURNING {_returning(needs, "jobs") or "jobs.id"}, live.handled,
                  CAST(CASE WHEN live.handled THEN '{Transition.HAND_BACK}'
                       ELSE '{Transition.PARK}' END AS text) AS transition,
                  CAST('queued' AS text) AS from_state
    """


def _unpark(needs: set[str]) -> str:
    # Parked jobs of the given types and queues get a new dispatch (a worker
    # that runs them is live now), with one event each.
    rule = RULES[Transition.UNPARK]
    # p has no column but id: the job's columns need no table name.
    where = f"{where_sources(Transition.UNPARK)} AND {rule.guard}"
    return f"""
        WITH p AS (
            SELECT id FROM jobs
            WHERE {where}
              AND type = ANY (CAST(:types AS text[])) AND queue = ANY (CAST(:queues AS text[]))
            ORDER BY id
            LIMIT :limit
            FOR UPDATE SKIP LOCKED
        )
        UPDATE jobs SET {rule.sets}, last_seq = jobs.last_seq + 1, update_time = now()
        FROM p
        WHERE jobs.id = p.id AND {where}
        RETURNING {_returning(needs, "jobs") or "jobs.id"},
                  CAST('{Transition.UNPARK}' AS text) AS transition,
                  CAST('queued' AS text) AS from_state
    """


#: The machine every store uses unless given another.
MACHINE = StateMachine()
