"""Fan-out in the machine: the children a FAN_OUT spawns, in its transaction (ADR-0047).

FAN_OUT moves a pipeline job from the stage that returned a list of items
to the fan-out stage, waiting like a dependent (``waiting_code``
DEPENDENCIES, ``deps_waiting`` the number of items). :class:`FanOut`, a
built-in hook, then writes one child job per item in the same transaction
(the SUBMIT transition: each child's first event and dispatch commit with
it) and the job's edges to them (``job_dependencies``, ``idx`` the item's
place), and marks the children ``has_dependents``: each child's end
settles the job in its own statement, as an end settles any dependent
(:mod:`jobplane.store.machine.dependencies`), and the last one JOINs it.

A FAN_OUT fenced out changes no row, so the hook never runs for it: a stale
attempt spawns nothing. A child's request_id names the job, the fan-out
stage, the attempt that spawned it and its item, so the children of one
spawn are one set, whatever retries came before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import text

from jobplane.ids import new_id
from jobplane.names import job_name
from jobplane.store.machine.hooks import AnyConn, Cause, Change, Hook, Write
from jobplane.store.machine.table import Transition, state_is
from jobplane.types import JobState

if TYPE_CHECKING:
    from jobplane.store.machine.core import StateMachine

#: The error of a job its fan-out's children failed (too many, or fail fast).
CHILDREN_FAILED = "CHILDREN_FAILED"
# The job's edges to the children of its last spawn are replaced by this one's.
_DROP_EDGES = text(
    "DELETE FROM job_dependencies WHERE job_id = :id AND idx IS NOT NULL RETURNING depends_on"
)
_EDGES = text(
    """
    WITH e AS (
        INSERT INTO job_dependencies (job_id, depends_on, tenant_id, idx)
        SELECT CAST(:id AS uuid), c.id, CAST(:tenant_id AS uuid), c.idx
        FROM unnest(CAST(:children AS uuid[])) WITH ORDINALITY AS c(id, idx)
        RETURNING depends_on
    )
    UPDATE jobs SET has_dependents = true FROM e WHERE jobs.id = e.depends_on RETURNING jobs.id
    """
)
# The children of the jobs ``:ids`` waits for that have not ended, locked in
# id order; those another transaction holds are skipped, never waited for:
# the job is locked already, and a child's end locks the child, then the job.
_LIVE_CHILDREN = text(
    f"""
    SELECT x.id, x.tenant_id, x.state, x.cancel_requested_at IS NOT NULL AS cancel_requested
    FROM job_dependencies d JOIN jobs x ON x.id = d.depends_on
    WHERE d.job_id = ANY (CAST(:ids AS uuid[])) AND d.idx IS NOT NULL AND d.outcome IS NULL
      AND {state_is(JobState.QUEUED, JobState.RUNNING, column="x.state")}
    ORDER BY x.id
    FOR UPDATE OF x SKIP LOCKED
    """
)
# Jobs its children failed at their fan-out stage (fail fast) with children
# not ended and not asked to cancel: those :func:`cancel_children` skipped
# (another transaction held them), up to ``:limit``. (A job ended by its
# deadline leaves its children to end on their own, by the same deadline.)
_FAILED_BY_CHILDREN = (
    f"{state_is(JobState.FAILED, column='p.state')} AND p.fan_stage = p.stage "
    f"AND p.error_code = '{CHILDREN_FAILED}'"
)
_LEFT_RUNNING = text(
    f"""
    SELECT DISTINCT d.job_id FROM job_dependencies d
    JOIN jobs p ON p.id = d.job_id
    JOIN jobs x ON x.id = d.depends_on
    WHERE d.outcome IS NULL AND d.idx IS NOT NULL AND {_FAILED_BY_CHILDREN}
      AND {state_is(JobState.QUEUED, JobState.RUNNING, column="x.state")}
      AND x.cancel_requested_at IS NULL
    LIMIT :limit
    """
)
# ... locked, still failed there (not retried since), skipping those held.
_LOCK_FAILED = text(
    f"""
    SELECT p.id FROM jobs p
    WHERE p.id = ANY (CAST(:ids AS uuid[])) AND {_FAILED_BY_CHILDREN}
    ORDER BY p.id
    FOR UPDATE SKIP LOCKED
    """
)


def fan_request_id(job_id: Any, stage: int, attempt: int, index: int) -> str:
    """The request_id of the child for item ``index`` of ``job_id``'s spawn at
    ``stage`` by ``attempt`` (its tenant's: unique there)."""
    return f"fan:{job_id}:{stage}:{attempt}:{index}"


class FanOut(Hook):
    """Writes a FAN_OUT's children and the job's edges to them, in its transaction."""

    def __init__(self) -> None:
        #: The machine the hook is a hook of: it submits the children.
        self.machine: StateMachine | None = None

    def follows(self, transition: Transition) -> bool:
        return transition is Transition.FAN_OUT

    async def after(self, conn: AnyConn, change: Change) -> None:
        from jobplane.store.job_submit import NewJob, insert_jobs
        from jobplane.store.machine.core import fetch_rows

        row = change.row
        items = change.cause.items
        news = [
            NewJob(
                type=row["type"],
                queue=row["queue"],
                payload=dict(item),
                request_id=fan_request_id(row["id"], row["stage"], row["attempt"], index),
                max_attempts=row["max_attempts"],
                correlation_id=row["correlation_id"] or "",
                timeout_seconds=float(row["timeout_seconds"]),
                deadline=row["deadline"],
                parent_id=row["id"],
            )
            for index, item in enumerate(items)
        ]
        # Time-ordered ids: the children list in item order.
        ids = [new_id() for _ in news]
        machine = self.machine
        assert machine is not None, "the machine binds its fan-out hook"
        params = {"id": row["id"], "tenant_id": row["tenant_id"]}
        await fetch_rows(conn, _DROP_EDGES, {"id": row["id"]})
        if news:
            written = await insert_jobs(machine, conn, row["tenant_id"], news, ids, field="items")
            if len(written) != len(news):
                raise RuntimeError(f"{job_name(row['id'])}: a child of this spawn existed")
            await fetch_rows(conn, _EDGES, {**params, "children": ids})
        else:
            # Nothing to wait for: the join is due at once.
            await machine.apply(conn, Transition.JOIN, {"ids": [row["id"]]}, settles=False)


# The running children's own progress, added to their waiting jobs' in the
# progress statement (ADR-0047): each report's change since the child's last
# (its edge keeps what was added), summed per job. A job locked by another
# transaction (its retry, its cancel, a child's end settling it) is skipped
# this time rather than waited for: the progress statement holds the
# children's locks, and those hold the job's lock first. The next report,
# or the child's end, adds what was skipped.
_FAN_EDGES = """
        SELECT e.job_id, e.depends_on, e.progress AS was,
               least(1.0, greatest(0.0, j.progress)) AS now
        FROM {j} AS j
        JOIN job_dependencies e ON e.depends_on = j.id AND e.idx IS NOT NULL
                                AND e.outcome IS NULL
        WHERE j.has_dependents"""
_FAN_JOBS = f"""
        SELECT p.id FROM jobs p
        WHERE p.id IN (SELECT job_id FROM fan_edges)
          AND {state_is(JobState.QUEUED, column="p.state")} AND p.fan_stage = p.stage
        ORDER BY p.id
        FOR UPDATE OF p SKIP LOCKED"""
_FAN_MOVED = """
        UPDATE job_dependencies e SET progress = f.now
        FROM fan_edges f JOIN fan_jobs p ON p.id = f.job_id
        WHERE e.job_id = f.job_id AND e.depends_on = f.depends_on AND f.now <> f.was
        RETURNING e.job_id, f.now - f.was AS delta"""
_FAN_PROGRESS = """
        UPDATE jobs p SET
            fan_progress = greatest(p.fan_progress + d.delta, 0),
            progress = greatest(p.progress, least(1.0, p.stage_base + p.stage_span * least(1.0,
                (p.fan_size - p.deps_waiting + greatest(p.fan_progress + d.delta, 0))
                / greatest(p.fan_size, 1)))),
            update_time = now()
        FROM (SELECT job_id, sum(delta) AS delta FROM fan_moved GROUP BY job_id) d
        WHERE p.id = d.job_id"""


class FanProgress(Hook):
    """A fan-out's job counts its running children's own progress (ADR-0047)."""

    def writes(self, transition: Transition) -> Sequence[Write]:
        if transition is not Transition.PROGRESS:
            return ()
        columns = frozenset({"id", "progress", "has_dependents"})
        return [
            Write(_FAN_EDGES, columns=columns, name="fan_edges"),
            Write(_FAN_JOBS, name="fan_jobs"),
            Write(_FAN_MOVED, name="fan_moved"),
            Write(_FAN_PROGRESS),
        ]


async def cancel_children(machine: StateMachine, conn: AnyConn, ids: Sequence[Any]) -> int:
    """Cancel the children not ended of the (locked) jobs ``ids``, which failed
    while waiting for them (a fail-fast policy), in the caller's transaction:
    QUEUED ones CANCELLED, RUNNING ones asked to cancel; how many. A child
    another transaction holds is skipped: if that is its end, it ends
    anyway; else :func:`cancel_left_running` (the sweeper's) cancels it on
    its next pass."""
    from jobplane.store.machine.core import fetch_rows

    done = 0
    for row in await fetch_rows(conn, _LIVE_CHILDREN, {"ids": list(ids)}):
        reason = "its parent's fan-out failed"
        params = {"id": row["id"], "tenant_id": row["tenant_id"], "reason": reason}
        if row["state"] == JobState.QUEUED.value:
            done += len(await machine.apply(conn, Transition.CANCEL, params, Cause(reason)))
        elif not row["cancel_requested"]:
            changed = await machine.apply(conn, Transition.REQUEST_CANCEL, params, Cause(reason))
            done += len(changed)
    return done


async def cancel_left_running(machine: StateMachine, conn: AnyConn, limit: int) -> int:
    """The sweeper's pass: cancel the children :func:`cancel_children` skipped,
    of up to ``limit`` jobs their children failed; how many."""
    from jobplane.store.machine.core import fetch_rows

    found = [row["job_id"] for row in await fetch_rows(conn, _LEFT_RUNNING, {"limit": limit})]
    if not found:
        return 0
    locked = [row["id"] for row in await fetch_rows(conn, _LOCK_FAILED, {"ids": found})]
    return await cancel_children(machine, conn, locked) if locked else 0
