"""What follows a transition: the :class:`Hook` interface and the built-in hooks.

A hook acts inside the transition's transaction, after the job row changed,
and never when the transition was refused:

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

The domain events' hook is :class:`jobplane.store.machine.lifecycle.DomainEvents`.
See ADR-0010.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.store import observers
from jobplane.store.db import Conn
from jobplane.store.machine.stages import STAGE_WRITES
from jobplane.store.machine.table import JOB_PROGRESS, RULES, Transition, state_is
from jobplane.store.rows import CANCEL_CHANNEL, EVENTS_CHANNEL, OUTBOX_CHANNEL, dumps
from jobplane.types import JobState

_ENDED_STATE = state_is(JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, column="x.state")

if TYPE_CHECKING:
    from jobplane.events.envelope import Event

#: A connection a transition runs on: the hot paths' asyncpg one, or SQLAlchemy's.
AnyConn = Conn | AsyncConnection
#: A changed row as either connection returns it; read by column name.
Row = Any


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
    # A fan-out stage and its failure policy (ADR-0047).
    fan_out: bool = False
    max_failures: int = 0
    fail_fast: bool = False


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
    #: The items a FAN_OUT spawns a child for, each the child's payload (ADR-0047).
    items: Sequence[Mapping[str, Any]] = ()


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


_SAYS_WHY = frozenset(
    {Transition.PARK, Transition.HOLD, Transition.RELEASE}
    | {Transition.THROTTLE, Transition.RELEASE_LIMIT}
)
# Their events say why the job ended (ADR-0045).
_SAYS_ERROR = frozenset({Transition.DEPENDENCY_FAILED, Transition.DEPENDENCY_CANCELLED})
_EVENT_COLUMNS = frozenset(
    {"id", "last_seq", "tenant_id", "state", "progress", "attempt", "stage", "stage_name"}
)
# The stage a pipeline job has just finished (p), for the event that says so.
_PREVIOUS_STAGE = "JOIN job_stages p ON p.job_id = j.id AND p.idx = j.stage - 1"
# A stage's own 0..1 as the job's progress (a plain job's base is 0, its span 1).


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
            progress = JOB_PROGRESS.format(t="j", p="p.progress")
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
        previous = _PREVIOUS_STAGE if rule.stage == "p.name" else ""
        sql = f"""
        INSERT INTO job_events
            (job_id, seq, tenant_id, type, state, progress, message, data, attempt, stage)
        SELECT j.id, j.last_seq, j.tenant_id, '{rule.event.value}', j.state, j.progress,
               {rule.message}, {rule.data}, j.attempt, {rule.stage}
        FROM {{j}} AS j {previous}"""
        # The park's, the hold's and the release's events say why it waits.
        extra = {"waiting_reason"} if transition in _SAYS_WHY else set()
        if transition is Transition.UNPARK:
            extra = {"type"}
        if transition in (Transition.FAN_OUT, Transition.JOIN):
            extra = {"fan_size", "deps_failed"}
        if transition is Transition.DEADLINE:
            extra = {"error_code", "error_message", "deadline"}
        elif transition in _SAYS_ERROR:
            extra = {"error_code", "error_message"}
        return [Write(sql, notify, _EVENT_COLUMNS | extra)]

    def binds(self, transition: Transition, cause: Cause) -> Mapping[str, Any]:
        rule = RULES[transition]
        if rule.event is None or ":event_message" not in rule.message:
            return {}
        return {"event_message": cause.message, "event_data": dumps(dict(cause.data))}


class Dispatches(Hook):
    """The job's next dispatch: an outbox row whose id the job's ``dispatch_id`` names.

    Due at the job's ``next_attempt_time`` (now when unset), and never before
    its ``schedule_time`` (a delayed job: GREATEST skips the NULL of a job
    without one), whichever transition dispatches it; it names the job's
    queue, whose credit the relay spends on it (ADR-0042). A QUEUED job
    cancelled, or ended by its deadline, drops its pending (re)dispatch, so
    nothing is published.
    """

    def writes(self, transition: Transition) -> Sequence[Write]:
        if RULES[transition].dispatch:
            return [
                Write(
                    f"""
        INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id, available_at,
                            headers, queue)
        SELECT j.dispatch_id, j.tenant_id, j.id, j.type, j.correlation_id,
               greatest(coalesce(j.next_attempt_time, now()), j.schedule_time),
               {_trace_headers(transition)}, j.queue
        FROM {{j}} AS j
        WHERE j.dispatch_id IS NOT NULL""",
                    f"pg_notify('{OUTBOX_CHANNEL}', '')",
                    frozenset(
                        {"dispatch_id", "tenant_id", "id", "type", "correlation_id", "queue"}
                        | {"next_attempt_time", "schedule_time"}
                    ),
                )
            ]
        if transition in (Transition.CANCEL, Transition.DEADLINE):
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
        return observers.trace_binds() if RULES[transition].dispatch else {}


# Transitions with no span of their own to carry (the sweeper's, an operator's
# re-dispatch, a worker starting): with tracing on, their dispatch keeps the
# trace context of the job's previous one.
_INHERITS_TRACE = frozenset(
    {Transition.EXPIRE_LEASE, Transition.REDISPATCH, Transition.UNPARK, Transition.HAND_BACK}
    | {Transition.RELEASE, Transition.THROTTLE, Transition.RELEASE_LIMIT}
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
        found = STAGE_WRITES.get(transition)
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
            "stage_fan_outs": [st.fan_out for _, _, st in rows],
            "stage_max_failures": [st.max_failures for _, _, st in rows],
            "stage_fail_fasts": [st.fail_fast for _, _, st in rows],
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


class Dependencies(Hook):
    """A new job's edges to the jobs it runs after: rows of ``job_dependencies``,
    in the submit's statement (ADR-0045). An edge to a job that has already
    ended carries its outcome: it counted at submit."""

    def writes(self, transition: Transition) -> Sequence[Write]:
        if transition is not Transition.SUBMIT:
            return ()
        sql = f"""
        INSERT INTO job_dependencies (job_id, depends_on, tenant_id, outcome)
        SELECT j.id, x.id, j.tenant_id,
               CASE WHEN {_ENDED_STATE} THEN x.state END
        FROM {{j}} AS j
        JOIN jobs x ON x.id = ANY (j.after_ids) AND x.tenant_id = j.tenant_id
        WHERE j.after_ids IS NOT NULL"""
        return [Write(sql, columns=frozenset({"id", "tenant_id", "after_ids"}))]


class CancelSignal(Hook):
    """Wakes the worker that runs a job whose cancellation was requested, or
    whose deadline ended it while RUNNING (ADR-0044): it stops the handler."""

    def writes(self, transition: Transition) -> Sequence[Write]:
        if transition is Transition.REQUEST_CANCEL:
            notify = f"pg_notify('{CANCEL_CHANNEL}', j.id::text)"
            return [Write(notify=notify, columns=frozenset({"id"}))]
        if transition is Transition.DEADLINE:
            # A QUEUED job has no attempt to stop: no signal for it.
            signal = f"pg_notify('{CANCEL_CHANNEL}', j.id::text)"
            notify = f"CASE WHEN j.from_state = 'running' THEN {signal} END"
            return [Write(notify=notify, columns=frozenset({"id", "from_state"}))]
        return ()
