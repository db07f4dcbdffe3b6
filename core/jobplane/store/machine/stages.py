"""The stage machine: what each job transition does to a pipeline job's stages.

A pipeline job's stages are rows of ``job_stages``, each in a
:class:`StageState`. The job's transitions move them, and :data:`STAGE_STEPS`
is the one table of how: for each transition, which stages it touches
(relative to the job's stage after the transition) and what each becomes.
The ``UPDATE job_stages`` each transition folds into its statement is built
from its step (:func:`stage_writes`), so no stage state is spelled elsewhere.

A plain job (``stage`` NULL) matches no stage row. See ADR-0017 and ADR-0036.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from jobplane.store.machine.table import Transition


class StageState(enum.StrEnum):
    """A stage's state (``job_stages.state``)."""

    PENDING = "pending"  # a later stage: not yet its turn
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"  # a later stage of a cancelled job


class Which(enum.Enum):
    """Stages relative to the job's stage after the transition (``j.stage``)."""

    PREVIOUS = "s.idx = j.stage - 1"
    CURRENT = "s.idx = j.stage"
    LATER = "s.idx > j.stage"


@dataclass(frozen=True, slots=True)
class Becomes:
    """What the stages of one :class:`Which` become: a state, and columns set with it.

    ``sets`` maps a column to SQL over ``s`` (the stage) and ``j`` (the job
    after the transition); a column another :class:`Becomes` of the step sets
    and this one does not keeps its value here.
    """

    state: StageState
    sets: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StageStep:
    """One row of the stage table: what a job transition does to the job's stages."""

    becomes: Mapping[Which, Becomes]
    columns: frozenset[str]  # the columns of j it reads
    # States a touched stage keeps (a cancel does not undo a finished stage).
    keeps: frozenset[StageState] = frozenset()


#: A new pipeline job's first stage, and every stage after it.
FIRST_STAGE = StageState.QUEUED
LATER_STAGES = StageState.PENDING

_ERROR = {"error_code": "j.error_code", "error_message": "j.error_message"}
_NO_ERROR = {"error_code": "NULL", "error_message": "NULL"}
_ERROR_COLUMNS = frozenset({"id", "stage", "error_code", "error_message"})
_AT_STAGE = frozenset({"id", "stage"})
# Where the job ends FAILED at its stage.
_FAILED = StageStep(
    {Which.CURRENT: Becomes(StageState.FAILED, {**_ERROR, "end_time": "now()"})}, _ERROR_COLUMNS
)
# Where the stage waits for another attempt.
_WAITS = StageStep({Which.CURRENT: Becomes(StageState.QUEUED, _ERROR)}, _ERROR_COLUMNS)
# The job's stage ends cancelled, and every later stage is skipped.
_CANCELLED = StageStep(
    {
        Which.CURRENT: Becomes(StageState.CANCELLED, {"end_time": "now()"}),
        Which.LATER: Becomes(StageState.SKIPPED, {"end_time": "NULL"}),
    },
    _AT_STAGE,
    keeps=frozenset({StageState.SUCCEEDED, StageState.FAILED}),
)
# Resuming at the job's stage (RetryJob, or a restart from a named stage): it
# waits again, keeping its attempts and first start, and every later stage is
# to run again, from nothing.
_CLEARED = {"result": "NULL", **_NO_ERROR, "end_time": "NULL"}
_RESUMED = StageStep(
    {
        Which.CURRENT: Becomes(StageState.QUEUED, _CLEARED),
        Which.LATER: Becomes(
            StageState.PENDING, {**_CLEARED, "attempts": "0", "start_time": "NULL"}
        ),
    },
    _AT_STAGE,
)

#: What each transition does to a pipeline job's stages (none: nothing). Submit
#: writes them (:data:`FIRST_STAGE`, then :data:`LATER_STAGES`).
STAGE_STEPS: Mapping[Transition, StageStep] = {
    Transition.CLAIM: StageStep(
        {
            Which.CURRENT: Becomes(
                StageState.RUNNING,
                {
                    "attempts": "s.attempts + 1",
                    "start_time": "coalesce(s.start_time, now())",
                    "end_time": "NULL",
                },
            )
        },
        _AT_STAGE,
    ),
    # The stage that succeeded, and the next one, which now waits.
    Transition.ADVANCE: StageStep(
        {
            Which.CURRENT: Becomes(
                StageState.QUEUED, {"result": "NULL", **_NO_ERROR, "end_time": "NULL"}
            ),
            Which.PREVIOUS: Becomes(
                StageState.SUCCEEDED,
                {"result": "CAST(:result AS jsonb)", **_NO_ERROR, "end_time": "now()"},
            ),
        },
        _AT_STAGE,
    ),
    # The stage that returned the items succeeded; the fan-out stage runs
    # in its children (ADR-0047).
    Transition.FAN_OUT: StageStep(
        {
            Which.CURRENT: Becomes(
                StageState.RUNNING,
                {"result": "NULL", **_NO_ERROR, "start_time": "now()", "end_time": "NULL"},
            ),
            Which.PREVIOUS: Becomes(
                StageState.SUCCEEDED,
                {"result": "CAST(:result AS jsonb)", **_NO_ERROR, "end_time": "now()"},
            ),
        },
        _AT_STAGE,
    ),
    # The fan-out stage's children ended: it succeeded (its result counts
    # them), and the join stage waits.
    Transition.JOIN: StageStep(
        {
            Which.CURRENT: Becomes(
                StageState.QUEUED, {"result": "NULL", **_NO_ERROR, "end_time": "NULL"}
            ),
            Which.PREVIOUS: Becomes(
                StageState.SUCCEEDED,
                {
                    "result": "jsonb_build_object('children', j.fan_size, 'failed', j.deps_failed)",
                    **_NO_ERROR,
                    "end_time": "now()",
                },
            ),
        },
        frozenset({"id", "stage", "fan_size", "deps_failed"}),
    ),
    # RetryJob of a job its children failed: the fan-out stage runs again
    # (in the children run again), every later stage is to run again.
    Transition.REJOIN: StageStep(
        {
            Which.CURRENT: Becomes(StageState.RUNNING, _CLEARED),
            Which.LATER: Becomes(
                StageState.PENDING, {**_CLEARED, "attempts": "0", "start_time": "NULL"}
            ),
        },
        _AT_STAGE,
    ),
    Transition.SUCCEED: StageStep(
        {
            Which.CURRENT: Becomes(
                StageState.SUCCEEDED, {"result": "j.result", **_NO_ERROR, "end_time": "now()"}
            )
        },
        frozenset({"id", "stage", "result"}),
    ),
    Transition.FAIL: _FAILED,
    Transition.EXHAUST: _FAILED,
    Transition.EXPIRE_LAST_LEASE: _FAILED,
    Transition.RELAY_FAIL: _FAILED,
    Transition.DEADLINE: _FAILED,
    Transition.DEPENDENCY_FAILED: _FAILED,
    Transition.SCHEDULE_RETRY: _WAITS,
    Transition.EXPIRE_LEASE: _WAITS,
    Transition.CANCEL: _CANCELLED,
    Transition.CANCELLED: _CANCELLED,
    Transition.DEPENDENCY_CANCELLED: _CANCELLED,
    Transition.RETRY: _RESUMED,
    Transition.RESTART: _RESUMED,
}


def _where(step: StageStep) -> str:
    """SQL: the stages ``step`` touches."""
    which = set(step.becomes)
    if which == {Which.CURRENT}:
        where = Which.CURRENT.value
    elif which == {Which.CURRENT, Which.LATER}:
        where = "s.idx >= j.stage"
    elif which == {Which.PREVIOUS, Which.CURRENT}:
        where = "s.idx IN (j.stage - 1, j.stage)"
    else:
        raise ValueError(f"no SQL for the stages {sorted(w.name for w in which)}")
    if step.keeps:
        kept = ", ".join(f"'{s}'" for s in sorted(step.keeps, key=list(StageState).index))
        where += f" AND s.state NOT IN ({kept})"
    return where


def _value(step: StageStep, column: str) -> str:
    """SQL: what ``column`` becomes, the job's stage's value or the others'."""

    def of(becomes: Becomes) -> str:
        if column == "state":
            return f"'{becomes.state}'"
        return becomes.sets.get(column, f"s.{column}")

    current = of(step.becomes[Which.CURRENT])
    others = {of(b) for w, b in step.becomes.items() if w is not Which.CURRENT}
    if not others or others == {current}:
        return current
    if len(others) > 1:
        raise ValueError(f"{column}: the stages besides the job's differ")
    (other,) = others
    if other == "NULL":
        return f"CASE WHEN {Which.CURRENT.value} THEN {current} END"
    return f"CASE WHEN {Which.CURRENT.value} THEN {current} ELSE {other} END"


def stage_update(step: StageStep) -> str:
    """The ``UPDATE job_stages`` of ``step``, over the changed jobs ``{j}``."""
    columns = ["state"]
    for becomes in (step.becomes[Which.CURRENT], *step.becomes.values()):
        columns.extend(c for c in becomes.sets if c not in columns)
    sets = ", ".join(f"{c} = {_value(step, c)}" for c in columns)
    return f"""
        UPDATE job_stages s SET {sets}, update_time = now()
        FROM {{j}} AS j
        WHERE s.job_id = j.id AND {_where(step)}"""


# Each new job's stages (s.job_id), for the jobs the insert created.
_SUBMIT = f"""
        INSERT INTO job_stages (job_id, idx, tenant_id, name, type, queue, version,
                                max_attempts, timeout_seconds, base, span, fan_out,
                                max_failures, fail_fast, state)
        SELECT j.id, s.idx, j.tenant_id, s.name, s.type, s.queue, s.version,
               s.max_attempts, s.timeout_seconds, s.base, s.span, s.fan_out,
               s.max_failures, s.fail_fast,
               CASE WHEN s.idx = 0 THEN '{FIRST_STAGE}' ELSE '{LATER_STAGES}' END
        FROM {{j}} AS j
        JOIN unnest(CAST(:stage_jobs AS uuid[]), CAST(:stage_idxs AS int[]),
                    CAST(:stage_names AS text[]), CAST(:stage_types AS text[]),
                    CAST(:stage_queues AS text[]), CAST(:stage_versions AS text[]),
                    CAST(:stage_max_attempts AS int[]), CAST(:stage_timeouts AS float8[]),
                    CAST(:stage_bases AS float8[]), CAST(:stage_spans AS float8[]),
                    CAST(:stage_fan_outs AS boolean[]), CAST(:stage_max_failures AS int[]),
                    CAST(:stage_fail_fasts AS boolean[]))
                 AS s(job_id, idx, name, type, queue, version, max_attempts,
                      timeout_seconds, base, span, fan_out, max_failures, fail_fast)
          ON s.job_id = j.id"""

#: The SQL each transition writes to the stages, and the columns of j it reads.
STAGE_WRITES: Mapping[Transition, tuple[str, frozenset[str]]] = {
    Transition.SUBMIT: (_SUBMIT, frozenset({"id", "tenant_id"})),
    **{t: (stage_update(step), step.columns) for t, step in STAGE_STEPS.items()},
}
