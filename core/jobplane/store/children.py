"""Child jobs: the submits of a running attempt, and a parent's cancel reaching them.

A child is a job like any other, written by the machine's SUBMIT transition
with ``parent_id`` set, in a transaction that first locks the parent's row
under its running attempt's fence (job, attempt, lease token): an attempt
that lost its lease, a job that ended or was asked to cancel, submits
nothing. Its request_id is derived from (parent, key), so the tenant's
idempotency on (tenant, request_id) gives a handler that runs again after a
crash the child it made before, never a second one (ADR-0046).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.errors import ChildLimitReached, FailedPrecondition, RequestIdReused
from jobplane.ids import new_id
from jobplane.names import job_name
from jobplane.store.attempts import LeaseLost
from jobplane.store.db import Database
from jobplane.store.job_submit import NewJob, find_replays, insert_jobs, submitted
from jobplane.store.machine import MACHINE, Cause, StateMachine, Transition, state_is
from jobplane.store.rows import job_from_row
from jobplane.types import Job, JobState

#: The most children one job may have, over all its attempts (a later
#: attempt's submit of a key already used is the same child, not another).
MAX_CHILDREN = 10_000
#: The longest key a handler may give a child: the child's request_id is
#: ``child:{parent id}:{key}``, within the 256 characters of a request_id.
MAX_CHILD_KEY_LENGTH = 200

# The parent, locked under its attempt's fence while its child is written:
# a claim of a new attempt, an outcome or a cancel waits for the submit's
# commit, and the submit sees theirs.
_LOCK_PARENT = text(
    f"""
    SELECT cancel_requested_at IS NOT NULL AS cancel_requested
    FROM jobs
    WHERE id = :id AND tenant_id = :tenant_id AND attempt = :attempt
      AND lease_token = :lease_token AND {state_is(JobState.RUNNING)}
    FOR NO KEY UPDATE
    """
)
# The children counted up to the cap: at most MAX_CHILDREN entries of jobs_parent.
_COUNT_CHILDREN = text(
    """
    SELECT count(*) FROM (
        SELECT 1 FROM jobs WHERE parent_id = :id AND tenant_id = :tenant_id LIMIT :cap
    ) c
    """
)
_TAKEN = text("SELECT 1 FROM jobs WHERE tenant_id = :tenant_id AND request_id = :request_id")
# A job's descendants that have not ended, locked in id order (two cancels
# of overlapping trees lock in the same order). The walk goes through ended
# children too: a retried child may have children of its own still running.
_LIVE_DESCENDANTS = text(
    f"""
    WITH RECURSIVE tree(id) AS (
        SELECT id FROM jobs WHERE parent_id = :id AND tenant_id = :tenant_id
        UNION
        SELECT jobs.id FROM jobs JOIN tree ON jobs.parent_id = tree.id
        WHERE jobs.tenant_id = :tenant_id
    )
    SELECT jobs.id, jobs.state, jobs.cancel_requested_at IS NOT NULL AS cancel_requested,
           jobs.concurrency_key
    FROM jobs JOIN tree ON jobs.id = tree.id
    WHERE {state_is(JobState.QUEUED, JobState.RUNNING, column="jobs.state")}
    ORDER BY jobs.id
    FOR UPDATE OF jobs
    """
)


@dataclass(frozen=True, slots=True)
class ParentFence:
    """The running attempt a child is submitted by: its job, tenant, number and lease token."""

    tenant_id: uuid.UUID
    job_id: uuid.UUID
    attempt: int
    lease_token: uuid.UUID


def child_request_id(parent_id: uuid.UUID, key: str) -> str:
    """The request_id of the child of ``parent_id`` with ``key``, in the parent's tenant."""
    return f"child:{parent_id}:{key}"


class ChildStore:
    """Submits child jobs under their parent attempt's fence."""

    def __init__(self, db: Database, *, machine: StateMachine = MACHINE) -> None:
        self._db = db
        self._machine = machine

    async def submit(self, fence: ParentFence, key: str, new: NewJob) -> tuple[Job, bool]:
        """The child of ``fence``'s job with ``key``, written now unless it exists.

        Returns the child and whether it was created now. :class:`LeaseLost`
        when the attempt no longer owns the job; :class:`FailedPrecondition`
        when the job was asked to cancel; :class:`ChildLimitReached` past
        :data:`MAX_CHILDREN`; :class:`RequestIdReused` when the key's child
        was submitted with another request (type, payload, options).
        """
        request_id = child_request_id(fence.job_id, key)
        new = replace(new, request_id=request_id, parent_id=fence.job_id)
        params: dict[str, Any] = {"id": fence.job_id, "tenant_id": fence.tenant_id}
        job_id = new_id()
        async with self._db.begin() as conn:
            locked = await conn.fetchrow(
                _LOCK_PARENT,
                {**params, "attempt": fence.attempt, "lease_token": fence.lease_token},
            )
            if locked is None:
                raise LeaseLost(f"{job_name(fence.job_id)} attempt {fence.attempt}")
            if locked["cancel_requested"]:
                raise FailedPrecondition(
                    f"{job_name(fence.job_id)} was asked to cancel: it submits no more children"
                )
            count = await conn.fetchval(_COUNT_CHILDREN, {**params, "cap": MAX_CHILDREN})
            if int(count or 0) >= MAX_CHILDREN and not await conn.fetchval(
                _TAKEN, {"tenant_id": fence.tenant_id, "request_id": request_id}
            ):
                raise ChildLimitReached(
                    f"{job_name(fence.job_id)} has {MAX_CHILDREN} child jobs, as many as a "
                    "job may have",
                    metadata={"limit": "children_per_job", "max": str(MAX_CHILDREN)},
                )
            rows = await insert_jobs(
                self._machine, conn, fence.tenant_id, [new], [job_id], field="payload"
            )
            if str(job_id) in rows:
                return submitted(job_from_row(rows[str(job_id)]), new.stages), True
            replay = (await find_replays(conn, fence.tenant_id, [new], [0]))[0]
        if isinstance(replay, BaseException):
            raise RequestIdReused(
                f"key {key!r} was used for a different child of {job_name(fence.job_id)}",
                field="key",
            )
        if replay.parent != job_name(fence.job_id):
            raise RequestIdReused(
                f"the request_id of key {key!r} was taken by a job that is not a child of "
                f"{job_name(fence.job_id)}",
                field="key",
            )
        return replay, False


async def cancel_descendants(
    conn: AsyncConnection,
    machine: StateMachine,
    tenant_id: uuid.UUID,
    job_id: uuid.UUID,
    reason: str,
) -> Sequence[str]:
    """Cancel the job's descendants that have not ended, in the caller's transaction.

    QUEUED ones are CANCELLED, RUNNING ones asked to cancel (Temporal's
    ParentClosePolicy REQUEST_CANCEL); each through the machine, with its own
    event. Returns the concurrency keys of those cancelled, for the caller to
    release after its commit.
    """
    keys: list[str] = []
    cause = Cause(f"parent {job_name(job_id)} cancelled: {reason}")
    seen: set[Any] = set()
    # Walked again until a walk finds nothing new: a child whose lock the
    # walk waited for may have committed a child of its own meanwhile, which
    # the walk's snapshot did not hold. A child asked to cancel (and locked
    # by this transaction) can submit none, so the walks end.
    while True:
        found = await conn.execute(_LIVE_DESCENDANTS, {"id": job_id, "tenant_id": tenant_id})
        rows = [row for row in found.mappings().all() if row["id"] not in seen]
        if not rows:
            return keys
        for row in rows:
            seen.add(row["id"])
            params = {"id": row["id"], "tenant_id": tenant_id, "reason": cause.message}
            if row["state"] == JobState.QUEUED.value:
                await machine.apply(conn, Transition.CANCEL, params, cause)
                if row["concurrency_key"]:
                    keys.append(str(row["concurrency_key"]))
            elif not row["cancel_requested"]:
                await machine.apply(conn, Transition.REQUEST_CANCEL, params, cause)
