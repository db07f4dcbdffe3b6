"""Dependencies in the machine: a job that runs after other jobs (ADR-0045).

A job submitted with ``after`` names jobs of its tenant that exist. Its
edges are rows of ``job_dependencies`` (the job, the job it waits for, the
outcome that one ended with, once it did); the job carries two counts,
``deps_waiting`` (of the jobs it waits for, those not ended yet) and
``deps_failed`` (those ended other than SUCCEEDED, the first named by
``deps_failed_on``), and its policy, ``after_failure``.

- At submit the jobs it names are marked (:data:`MARK`: ``has_dependents``,
  an UPDATE that takes their row locks in id order, to the submit's commit),
  and read: a job that already ended counts at once. A job with one still to
  end starts QUEUED without a dispatch, ``waiting_code`` DEPENDENCIES.
- Every transition that ends a job (:data:`~jobplane.store.machine.table.ENDS`)
  returns ``has_dependents``; the machine then settles its dependents on the
  same connection, in the same transaction (:func:`settle`): :data:`RECORD`
  writes the edges' outcomes (each edge once: a job ended, retried and ended
  again counts its first end) and the counts, and the dependents the counts
  decide go through one statement (:func:`resolve`) that chooses between
  DEPENDENCIES_MET (a dispatch), DEPENDENCY_FAILED and DEPENDENCY_CANCELLED.
  Those two end jobs, whose own dependents are settled in turn.
- The mark is what makes a submit and an end exclude each other: an end that
  waited for a submit's lock returns the mark the submit wrote (an UPDATE
  re-reads the row it waited for), and its next statement sees the edge; a
  submit that waited for an end reads the job ended.
- The sweeper settles what a bug or a crash could leave (:data:`OPEN_EDGES`,
  :data:`DECIDED`): nothing strands.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from jobplane.store.machine.table import (
    DEPS_CANCEL,
    DEPS_FAIL,
    DEPS_MET,
    RULES,
    WAITS_FOR_DEPS,
    Transition,
    state_is,
    where_sources,
)
from jobplane.store.rows import EVENTS_CHANNEL, JOB_FIELDS
from jobplane.types import JobState

if TYPE_CHECKING:
    from jobplane.store.machine.core import StateMachine
    from jobplane.store.machine.hooks import AnyConn

_ENDED = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
#: The most names a waiting reason lists.
REASON_NAMES = 10

#: The jobs a new job runs after, marked and locked (in id order) to the
#: submit's commit: ``(id, state)`` of those of the tenant that exist.
MARK = text(
    """
    WITH p AS (
        SELECT id FROM jobs
        WHERE tenant_id = :tenant_id AND id = ANY (CAST(:ids AS uuid[]))
        ORDER BY id
        FOR UPDATE
    )
    UPDATE jobs SET has_dependents = true
    FROM p WHERE jobs.id = p.id
    RETURNING jobs.id, jobs.state
    """
)


def reason(names: str) -> str:
    """SQL: the waiting reason of a job that waits for the jobs ``names`` (SQL
    text; NULL when ``names`` is)."""
    return f"('waiting for ' || {names} || ' to end (it runs after them)')"


# The names of the jobs ``jobs`` still waits for, but the edges ``e`` just ended.
_STILL_AWAITED = f"""(
    SELECT string_agg('jobs/' || o.depends_on, ', ' ORDER BY o.depends_on) FROM (
        SELECT o.depends_on FROM job_dependencies o
        WHERE o.job_id = jobs.id AND o.outcome IS NULL
          AND NOT EXISTS (SELECT 1 FROM e WHERE e.job_id = o.job_id
                          AND e.depends_on = o.depends_on)
        ORDER BY o.depends_on LIMIT {REASON_NAMES}) o)"""
_WAITING = f"{state_is(JobState.QUEUED, column='jobs.state')} AND jobs.{WAITS_FOR_DEPS}"

# A fan-out's job (ADR-0047) waits for its children at its fan-out stage.
_FANNED = "jobs.fan_stage IS NOT NULL AND jobs.fan_stage = jobs.stage"
# ... and its progress is the stage's share of its children's: 1 for each
# ended, its own for each running (``fan_progress``: the partial ones' sum,
# kept by the progress statement); never less than it was.
_FAN_PROGRESS = (
    "greatest(jobs.progress, least(1.0, jobs.stage_base + jobs.stage_span * least(1.0, "
    "(jobs.fan_size - greatest(jobs.deps_waiting - c.n, 0) + jobs.fan_progress - c.partial) "
    "/ greatest(jobs.fan_size, 1))))"
)

#: The jobs of ``:ended`` that ended: their edges' outcomes, once each, and
#: their dependents' counts. The dependents the counts now decide (``decided``)
#: go to :func:`resolve`. Not a transition: no dependent changes state here;
#: a job waiting for a fan-out's children gets a progress event (its share of
#: them ended), under its row lock like every event.
RECORD = text(
    f"""
    WITH e AS (
        UPDATE job_dependencies d SET outcome = x.state
        FROM jobs x
        WHERE d.depends_on = ANY (CAST(:ended AS uuid[])) AND d.outcome IS NULL
          AND x.id = d.depends_on AND {state_is(*_ENDED, column="x.state")}
        RETURNING d.job_id, d.depends_on, d.outcome, d.progress
    ), c AS (
        SELECT job_id, count(*) AS n, sum(progress) AS partial,
               count(*) FILTER (WHERE outcome <> '{JobState.SUCCEEDED.value}') AS bad,
               (array_agg(depends_on ORDER BY depends_on)
                   FILTER (WHERE outcome <> '{JobState.SUCCEEDED.value}'))[1] AS first_bad
        FROM e GROUP BY job_id
    ), p AS (
        SELECT jobs.id FROM jobs JOIN c ON c.job_id = jobs.id
        ORDER BY jobs.id
        FOR UPDATE OF jobs
    ), u AS (
        UPDATE jobs SET deps_waiting = jobs.deps_waiting - c.n,
                        deps_failed = jobs.deps_failed + c.bad,
                        deps_failed_on = coalesce(jobs.deps_failed_on, c.first_bad),
                        waiting_reason = CASE
                            WHEN {_WAITING} AND {_FANNED} AND jobs.deps_waiting > c.n
                            THEN format('waiting for %s of its %s children of stage %s to end',
                                        jobs.deps_waiting - c.n, jobs.fan_size, jobs.stage_name)
                            WHEN {_WAITING} AND jobs.deps_waiting > c.n
                            THEN coalesce({reason(_STILL_AWAITED)}, jobs.waiting_reason)
                            ELSE jobs.waiting_reason END,
                        progress = CASE WHEN {_WAITING} AND {_FANNED} THEN {_FAN_PROGRESS}
                                        ELSE jobs.progress END,
                        fan_progress = greatest(jobs.fan_progress - c.partial, 0),
                        last_seq = jobs.last_seq + CASE WHEN {_WAITING} AND {_FANNED}
                                                        THEN 1 ELSE 0 END
        FROM c, p
        WHERE jobs.id = c.job_id AND p.id = c.job_id
        RETURNING jobs.id, jobs.tenant_id, jobs.last_seq, jobs.state, jobs.progress,
                  jobs.attempt, jobs.stage_name, jobs.deps_waiting, jobs.fan_size,
                  ({_WAITING} AND {_FANNED}) AS fanned,
                  ({_WAITING} AND ({DEPS_FAIL.replace("deps_", "jobs.deps_")}
                        OR {DEPS_CANCEL.replace("deps_", "jobs.deps_")}
                        OR {DEPS_MET.replace("deps_", "jobs.deps_")})) AS decided
    ), ev AS (
        INSERT INTO job_events
            (job_id, seq, tenant_id, type, state, progress, message, data, attempt, stage)
        SELECT u.id, u.last_seq, u.tenant_id, 'progress', u.state, u.progress,
               format('%s of %s children ended', u.fan_size - u.deps_waiting, u.fan_size),
               jsonb_build_object('children', u.fan_size,
                                  'ended', u.fan_size - u.deps_waiting),
               u.attempt, u.stage_name
        FROM u WHERE u.fanned
    )
    SELECT u.id, u.decided,
           CASE WHEN u.fanned THEN pg_notify('{EVENTS_CHANNEL}', u.id::text) END AS notified
    FROM u
    """
)

#: The sweeper's repair: jobs that ended with edges whose outcome is not
#: written (an end a bug or a crash did not settle), up to ``:limit``.
OPEN_EDGES = text(
    f"""
    SELECT DISTINCT d.depends_on FROM job_dependencies d JOIN jobs x ON x.id = d.depends_on
    WHERE d.outcome IS NULL AND {state_is(*_ENDED, column="x.state")}
    LIMIT :limit
    """
)
#: ... and waiting jobs their counts decide, up to ``:limit``.
DECIDED = text(
    f"""
    SELECT id FROM jobs
    WHERE {state_is(JobState.QUEUED)} AND {WAITS_FOR_DEPS}
      AND ({DEPS_FAIL} OR {DEPS_CANCEL} OR {DEPS_MET})
    LIMIT :limit
    """
)
#: The group :func:`resolve` decides between.
RESOLUTIONS = (
    Transition.DEPENDENCIES_MET,
    Transition.DEPENDENCY_FAILED,
    Transition.DEPENDENCY_CANCELLED,
    Transition.JOIN,
)
# What JOIN moves a fan-out's job to: the stage after its fan-out stage (s).
_JOIN_STAGE = (
    ("type", "s.type"),
    ("queue", "s.queue"),
    ("stage", "s.idx"),
    ("stage_name", "s.name"),
    ("max_attempts", "s.max_attempts"),
    ("timeout_seconds", "s.timeout_seconds"),
    ("stage_base", "s.base"),
    ("stage_span", "s.span"),
    ("progress", "s.base"),
    ("progress_message", "''"),
    ("retry_base", "jobs.attempt"),
)


def _columns(needs: set[str], extra: Sequence[str]) -> str:
    known = set(JOB_FIELDS) | set(extra)
    return ", ".join(f"jobs.{c}" for c in sorted(needs) if c in known) or "jobs.id"


def _qualified(condition: str) -> str:
    return condition.replace("deps_", "jobs.deps_").replace("after_", "jobs.after_")


# long: one statement, its four outcomes spelled side by side
def resolve(needs: set[str], extra: Sequence[str]) -> str:
    """The statement of DEPENDENCIES_MET, DEPENDENCY_FAILED, DEPENDENCY_CANCELLED
    and JOIN: the waiting jobs of ``:ids`` their counts decide, locked in id order.

    The counts are read from the row the UPDATE changes (the latest, under
    its lock), so two ends settling one job at once decide it once. A job
    waiting for a fan-out's children (ADR-0047) joins: it moves to the
    stage after the fan-out stage (``s``), dispatched; a plain dependent's
    ``s`` is NULL.
    """
    met, failed, cancelled, join = (RULES[t] for t in RESOLUTIONS)
    assert met.sources == failed.sources == cancelled.sources == join.sources
    sources = where_sources(Transition.DEPENDENCIES_MET, "jobs")
    fails, cancels, meets = (_qualified(c) for c in (DEPS_FAIL, DEPS_CANCEL, DEPS_MET))
    ends = f"({fails}) OR ({cancels})"
    joins = f"s.idx IS NOT NULL AND NOT ({ends})"
    dependency = (
        "CASE WHEN s.idx IS NOT NULL THEN format('%s of its %s children of stage %s ended "
        "without succeeding (%s tolerated)', jobs.deps_failed, jobs.fan_size, jobs.stage_name, "
        "jobs.deps_tolerate) ELSE "
        "format('jobs/%s, which it runs after, ended %s', jobs.deps_failed_on, "
        "coalesce((SELECT upper(d.outcome) FROM job_dependencies d WHERE d.job_id = jobs.id "
        "AND d.depends_on = jobs.deps_failed_on), 'without succeeding')) END"
    )
    moves = ", ".join(
        f"{column} = CASE WHEN {joins} THEN {value} ELSE jobs.{column} END"
        for column, value in _JOIN_STAGE
    )
    return f"""
        WITH p AS (
            SELECT id, stage, fan_stage FROM jobs
            WHERE id = ANY (CAST(:ids AS uuid[])) AND {where_sources(Transition.DEPENDENCIES_MET)}
              AND {WAITS_FOR_DEPS}
            ORDER BY id
            FOR UPDATE
        )
        UPDATE jobs SET
            state = CASE WHEN {fails} THEN '{failed.target.value}'
                         WHEN {cancels} THEN '{cancelled.target.value}'
                         ELSE '{met.target.value}' END,
            {moves},
            dispatch_id = CASE WHEN {ends} THEN NULL ELSE gen_random_uuid() END,
            error_code = CASE WHEN {fails} AND s.idx IS NOT NULL THEN 'CHILDREN_FAILED'
                              WHEN {fails} THEN 'DEPENDENCY_FAILED'
                              WHEN {cancels} THEN 'CANCELLED' END,
            error_message = CASE WHEN {ends} THEN {dependency} END,
            error_retryable = false,
            end_time = CASE WHEN {ends} THEN now() END,
            next_attempt_time = NULL, waiting_reason = NULL, waiting_code = NULL, flow_key = NULL,
            lifecycle_cause = CASE WHEN ({ends}) OR {joins} THEN jobs.lifecycle_seq
                                   ELSE jobs.lifecycle_cause END,
            lifecycle_seq = CASE WHEN ({ends}) OR {joins} THEN jobs.last_seq + 1
                                 ELSE jobs.lifecycle_seq END,
            last_seq = jobs.last_seq + 1, update_time = now()
        FROM p LEFT JOIN job_stages s
            ON s.job_id = p.id AND p.fan_stage = p.stage AND s.idx = p.stage + 1
        WHERE jobs.id = p.id AND {sources} AND jobs.{WAITS_FOR_DEPS.replace(" AND ", " AND jobs.")}
          AND (({fails}) OR ({cancels}) OR ({meets}))
        RETURNING {_columns(needs, extra)},
                  CAST(CASE WHEN {state_is(JobState.FAILED, column="jobs.state")}
                            THEN '{Transition.DEPENDENCY_FAILED}'
                            WHEN {state_is(JobState.CANCELLED, column="jobs.state")}
                            THEN '{Transition.DEPENDENCY_CANCELLED}'
                            WHEN s.idx IS NOT NULL THEN '{Transition.JOIN}'
                            ELSE '{Transition.DEPENDENCIES_MET}' END AS text) AS transition,
                  CAST('queued' AS text) AS from_state
    """


#: The most rounds of :func:`settle`: a chain of jobs, each after the one
#: before, ended by the first one's failure, settles a round per job.
MAX_ROUNDS = 10_000


async def settle(machine: StateMachine, conn: AnyConn, ended: Sequence[Any]) -> int:
    """Settle the dependents of the jobs ``ended`` (which ended in ``conn``'s
    transaction): their counts, then those the counts decide; and so on for
    the dependents that decided ends (a policy failed or cancelled them).
    How many jobs were decided. The machine calls it after every end of a job
    that has dependents."""
    from jobplane.store.machine.core import fetch_rows
    from jobplane.store.machine.fanout import cancel_children

    decided_total = 0
    rounds = 0
    while ended and rounds < MAX_ROUNDS:
        rounds += 1
        rows = await fetch_rows(conn, RECORD, {"ended": list(ended)})
        decided = [row["id"] for row in rows if row["decided"]]
        if not decided:
            break
        changed = await machine.apply(
            conn,
            Transition.DEPENDENCIES_MET,
            {"ids": decided},
            returning=("id", "fan_stage", "stage"),
            settles=False,
        )
        decided_total += len(changed)
        ends = [row for row in changed if row["transition"] not in _GOES_ON]
        # A fan-out's job its children failed cancels those still running
        # (fail fast: the others are not awaited; ADR-0047).
        failed_fans = [row["id"] for row in ends if _fanned(row)]
        if failed_fans:
            await cancel_children(machine, conn, failed_fans)
        ended = [row["id"] for row in ends if row["has_dependents"]]
    return decided_total


def _fanned(row: Any) -> bool:
    return row["fan_stage"] is not None and row["fan_stage"] == row["stage"]


# The resolutions after which the job goes on to run (not ends).
_GOES_ON = frozenset({Transition.DEPENDENCIES_MET, Transition.JOIN})


__all__ = [
    "DECIDED",
    "MARK",
    "OPEN_EDGES",
    "RECORD",
    "RESOLUTIONS",
    "reason",
    "resolve",
    "settle",
]
