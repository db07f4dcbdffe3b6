"""RetryJob of a job that failed (or was cancelled) waiting for its fan-out's
children: only the children that did not succeed run again (ADR-0047).

In RetryJob's transaction, with the job locked: each child whose edge
recorded an end other than SUCCEEDED gets a new attempt (the RETRY
transition of the same child row: its id, item and place are kept), its
edge is opened again, and the job waits (REJOIN) for those and for any
child still running. The children that succeeded keep their results and
are not run again. With nothing to wait for, the join is due at once.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.errors import JobNotRetryable, ParentWaiting
from jobplane.ids import new_id
from jobplane.store.machine import Cause, StateMachine, Transition, state_is
from jobplane.types import JobState

# The job waiting at its fan-out stage for the children, one of them ``:id``.
_WAITING_PARENT = text(
    f"""
    SELECT p.id FROM job_dependencies d JOIN jobs p ON p.id = d.job_id
    WHERE d.depends_on = :id AND d.idx IS NOT NULL
      AND {state_is(JobState.QUEUED, column="p.state")}
      AND p.fan_stage IS NOT NULL AND p.fan_stage = p.stage
    """
)
_FANNED = text("SELECT fan_stage IS NOT NULL AND fan_stage = stage FROM jobs WHERE id = :id")
# The children of the job's last fan-out that did not succeed, locked in id order.
_NOT_SUCCEEDED = text(
    """
    SELECT x.id, x.state, x.cancel_requested_at IS NOT NULL AS cancel_requested
    FROM job_dependencies d JOIN jobs x ON x.id = d.depends_on
    WHERE d.job_id = :id AND d.idx IS NOT NULL AND d.outcome IS DISTINCT FROM 'succeeded'
    ORDER BY x.id
    FOR UPDATE OF x
    """
)
_OPEN = text(
    "UPDATE job_dependencies SET outcome = NULL, progress = 0 "
    "WHERE job_id = :id AND depends_on = ANY (CAST(:ids AS uuid[]))"
)
# The own progress of the job's children still running, summed (REJOIN's start).
_PARTIAL = text(
    "SELECT coalesce(sum(progress), 0) FROM job_dependencies "
    "WHERE job_id = :id AND idx IS NOT NULL AND outcome IS NULL"
)
_SUCCEEDED = text(
    "UPDATE job_dependencies SET outcome = 'succeeded' WHERE job_id = :id AND depends_on = :child"
)


async def refuse_while_parent_waits(conn: AsyncConnection, job_id: uuid.UUID) -> None:
    """:class:`ParentWaiting` when the job is a child its fan-out's job waits
    for: run again alone, it would end after the job counted its first end,
    and the join could run while it does."""
    parent = (await conn.execute(_WAITING_PARENT, {"id": job_id})).scalar()
    if parent is not None:
        raise ParentWaiting(
            f"jobs/{job_id} is a child of the fan-out of jobs/{parent}, which waits for its "
            "children; retry the parent once it has ended: it runs again the children that "
            "did not succeed",
            metadata={"parent": f"jobs/{parent}"},
        )


async def fanned(conn: AsyncConnection, job_id: uuid.UUID) -> bool:
    """Whether the (locked) job waits, or waited, for its fan-out stage's children."""
    return bool((await conn.execute(_FANNED, {"id": job_id})).scalar_one_or_none())


async def rejoin(
    conn: AsyncConnection, machine: StateMachine, tenant_id: uuid.UUID, job_id: uuid.UUID
) -> Any:
    """Run the job's children that did not succeed again and wait for them (the
    job is locked, FAILED or CANCELLED, and :func:`fanned`); the job's row after."""
    children = (await conn.execute(_NOT_SUCCEEDED, {"id": job_id})).mappings().all()
    stopping = sum(1 for c in children if c["state"] == "running" and c["cancel_requested"])
    if stopping:
        # Asked to cancel (by the job's cancel or its fail-fast), they end
        # CANCELLED: waiting for them would fail the job again at once.
        raise JobNotRetryable(
            f"jobs/{job_id}: {stopping} of its children were asked to cancel and have not "
            "ended; retry it once they have"
        )
    rerun: list[uuid.UUID] = []
    waiting = 0
    for child in children:
        params = {"id": child["id"], "tenant_id": tenant_id, "dispatch_id": new_id()}
        retried = await machine.apply(
            conn, Transition.RETRY, params, Cause("retry of its parent"), returning=("id",)
        )
        if retried:
            rerun.append(child["id"])
            waiting += 1
        elif child["state"] == "succeeded":
            # Retried and succeeded on its own since: it counts as it is.
            await conn.execute(_SUCCEEDED, {"id": job_id, "child": child["id"]})
        else:
            waiting += 1  # still running: its end settles the job
    await conn.execute(
        _OPEN, {"id": job_id, "ids": [c["id"] for c in children if c["state"] != "succeeded"]}
    )
    cause = Cause(f"retry requested: {len(rerun)} children run again")
    partial = float((await conn.execute(_PARTIAL, {"id": job_id})).scalar_one())
    params = {
        "id": job_id,
        "tenant_id": tenant_id,
        "waiting": waiting,
        "rerun": len(rerun),
        "partial": partial,
    }
    rows = await machine.apply(conn, Transition.REJOIN, params, cause)
    if len(rows) != 1:
        raise RuntimeError(f"jobs/{job_id}: REJOIN did not apply to a job locked in its state")
    if waiting == 0:
        joined = await machine.apply(conn, Transition.JOIN, {"ids": [job_id]})
        return joined[0] if joined else rows[0]
    return rows[0]
