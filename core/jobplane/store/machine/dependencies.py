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
from jobplane.store.rows import JOB_FIELDS
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

#: The jobs of ``:ended`` that ended: their edges' outcomes, once each, and
#: their dependents' counts. The dependents the counts now decide (``decided``)
#: go to :func:`resolve`. Not a transition: no dependent changes state here.
RECORD = text(
    f"""
    WITH e AS (
        UPDATE job_dependencies d SET outcome = x.state
        FROM jobs x
        WHERE d.depends_on = ANY (CAST(:ended AS uuid[])) AND d.outcome IS NULL
          AND x.id = d.depends_on AND {state_is(*_ENDED, column="x.state")}
        RETURNING d.job_id, d.depends_on, d.outcome
    ), c AS (
        SELECT job_id, count(*) AS n,
               count(*) FILTER (WHERE outcome <> '{JobState.SUCCEEDED.value}') AS bad,
               (array_agg(depends_on ORDER BY depends_on)
                   FILTER (WHERE outcome <> '{JobState.SUCCEEDED.value}'))[1] AS first_bad
        FROM e GROUP BY job_id
    ), p AS (
        SELECT jobs.id FROM jobs JOIN c ON c.job_id = jobs.id
        ORDER BY jobs.id
        FOR UPDATE OF jobs
    )
    UPDATE jobs SET deps_waiting = jobs.deps_waiting - c.n,
                    deps_failed = jobs.deps_failed + c.bad,
                    deps_failed_on = coalesce(jobs.deps_failed_on, c.first_bad),
                    waiting_reason = CASE WHEN {_WAITING} AND jobs.deps_waiting > c.n
                        THEN coalesce({reason(_STILL_AWAITED)}, jobs.waiting_reason)
                        ELSE jobs.waiting_reason END
    FROM c, p
    WHERE jobs.id = c.job_id AND p.id = c.job_id
    RETURNING jobs.id, ({_WAITING} AND ({DEPS_FAIL.replace("deps_", "jobs.deps_")}
                        OR {DEPS_CANCEL.replace("deps_", "jobs.deps_")}
                        OR {DEPS_MET.replace("deps_", "jobs.deps_")})) AS decided
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
)


def _columns(needs: set[str], extra: Sequence[str]) -> str:
    known = set(JOB_FIELDS) | set(extra)
    return ", ".join(f"jobs.{c}" for c in sorted(needs) if c in known) or "jobs.id"


def resolve(needs: set[str], extra: Sequence[str]) -> str:
    """The statement of DEPENDENCIES_MET, DEPENDENCY_FAILED and DEPENDENCY_CANCELLED:
    the waiting jobs of ``:ids`` their counts decide, locked in id order.

    The counts are read from the row the UPDATE changes (the latest, under
    its lock), so two ends settling one job at once decide it once.
    """
    met, failed, cancelled = (RULES[t] for t in RESOLUTIONS)
    assert met.sources == failed.sources == cancelled.sources
    sources = where_sources(Transition.DEPENDENCIES_MET, "jobs")
    fails = DEPS_FAIL.replace("deps_", "jobs.deps_").replace("after_", "jobs.after_")
    cancels = DEPS_CANCEL.replace("deps_", "jobs.deps_").replace("after_", "jobs.after_")
    meets = DEPS_MET.replace("deps_", "jobs.deps_").replace("after_", "jobs.after_")
    ends = f"({fails}) OR ({cancels})"
    dependency = (
        "format('jobs/%s, which it runs after, ended %s', jobs.deps_failed_on, "
        "coalesce((SELECT upper(d.outcome) FROM job_dependencies d WHERE d.job_id = jobs.id "
        "AND d.depends_on = jobs.deps_failed_on), 'without succeeding'))"
    )
    return f"""
        WITH p AS (
            SELECT id FROM jobs
            WHERE id = ANY (CAST(:ids AS uuid[])) AND {where_sources(Transition.DEPENDENCIES_MET)}
              AND {WAITS_FOR_DEPS}
            ORDER BY id
            FOR UPDATE
        )
        UPDATE jobs SET
            state = CASE WHEN {fails} THEN '{failed.target.value}'
                         WHEN {cancels} THEN '{cancelled.target.value}'
                         ELSE '{met.target.value}' END,
            dispatch_id = CASE WHEN {ends} THEN NULL ELSE gen_random_uuid() END,
            error_code = CASE WHEN {fails} THEN 'DEPENDENCY_FAILED'
                              WHEN {cancels} THEN 'CANCELLED' END,
            error_message = CASE WHEN {ends} THEN {dependency} END,
            error_retryable = false,
            end_time = CASE WHEN {ends} THEN now() END,
            next_attempt_time = NULL, waiting_reason = NULL, waiting_code = NULL, flow_key = NULL,
            lifecycle_cause = CASE WHEN {ends} THEN jobs.lifecycle_seq
                                   ELSE jobs.lifecycle_cause END,
            lifecycle_seq = CASE WHEN {ends} THEN jobs.last_seq + 1 ELSE jobs.lifecycle_seq END,
            last_seq = jobs.last_seq + 1, update_time = now()
        FROM p
        WHERE jobs.id = p.id AND {sources} AND jobs.{WAITS_FOR_DEPS.replace(" AND ", " AND jobs.")}
          AND (({fails}) OR ({cancels}) OR ({meets}))
        RETURNING {_columns(needs, extra)},
                  CAST(CASE WHEN {state_is(JobState.FAILED, column="jobs.state")}
                            THEN '{Transition.DEPENDENCY_FAILED}'
                            WHEN {state_is(JobState.CANCELLED, column="jobs.state")}
                            THEN '{Transition.DEPENDENCY_CANCELLED}'
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

    decided_total = 0
    rounds = 0
    while ended and rounds < MAX_ROUNDS:
        rounds += 1
        rows = await fetch_rows(conn, RECORD, {"ended": list(ended)})
        decided = [row["id"] for row in rows if row["decided"]]
        if not decided:
            break
        changed = await machine.apply(
            conn, Transition.DEPENDENCIES_MET, {"ids": decided}, returning=("id",), settles=False
        )
        decided_total += len(changed)
        ended = [
            row["id"]
            for row in changed
            if row["has_dependents"] and row["transition"] != Transition.DEPENDENCIES_MET
        ]
    return decided_total


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
