"""Repairs: expired leases, stuck outbox rows, lost dispatches, and re-dispatch by job id.

Every statement locks the rows it repairs with SKIP LOCKED and re-checks the
condition under the lock, so any number of sweepers may run at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.ids import new_id
from jobplane.store.outbox import RETURNS_RESET, OutboxKind
from jobplane.store.rows import (
    OUTBOX_CHANNEL,
    OUTBOX_FOR_JOB_SQL,
    dumps,
    job_from_row,
    transition_sql,
)
from jobplane.types import Job

_EXPIRED = text(
    """
    SELECT id, attempt, retry_base, max_attempts
    FROM jobs
    WHERE state = 'running' AND lease_expires_at < now() - make_interval(secs => :grace)
    ORDER BY lease_expires_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
    """
)
_LEASE_WHERE = "id = :id AND state = 'running' AND attempt = :attempt"
_REQUEUE = text(
    transition_sql(
        "state = 'queued', error_code = 'LEASE_EXPIRED', error_message = :message, "
        "error_retryable = true, lease_token = NULL, lease_expires_at = NULL, "
        "dispatch_id = :dispatch_id, next_attempt_time = now() + make_interval(secs => :delay)",
        _LEASE_WHERE,
    )
)
_FAIL_EXPIRED = text(
    transition_sql(
        # No attempts are left: the job is not going to be retried.
        "state = 'failed', error_code = 'LEASE_EXPIRED', error_message = :message, "
        "error_retryable = false, lease_token = NULL, lease_expires_at = NULL, "
        "dispatch_id = NULL, next_attempt_time = NULL, end_time = now()",
        _LEASE_WHERE,
    )
)
_OUTBOX_FOR_JOB = text(OUTBOX_FOR_JOB_SQL)
_STATE = text("SELECT state FROM jobs WHERE id = :id AND tenant_id = :tenant_id")
_STUCK_OUTBOX = text(
    """
    SELECT count(*) FROM outbox
    WHERE published_at IS NULL AND failed_at IS NULL
        AND available_at < now() - make_interval(secs => :older_than)
    """
)
# A QUEUED job whose current dispatch was published long ago and never
# claimed: its message was lost (a purged queue, a dead letter not replayed).
# The same row is made due again, so the copy carries the same dispatch id and
# whichever copy arrives first claims; the other finds the claim taken. The
# wait doubles with each re-publish of the row: a deep backlog legitimately
# holds messages for long, and must not be flooded with copies. Both rows are
# locked (SKIP LOCKED): a job being claimed right now is left alone.
#
# Its cost is bounded whatever the backlog: it looks at the next :limit QUEUED
# jobs after :cursor in the order of jobs_queued_dispatch (no sort, no join of
# the whole backlog), and the caller moves the cursor on, starting again from
# the lowest id once a window comes back short. A backlog is covered over
# several passes instead of read whole on each. The first row carries the
# window's size and last id, also when nothing was due.
_REPUBLISH = text(
    f"""
    WITH scanned AS MATERIALIZED (
        SELECT dispatch_id
        FROM jobs
        WHERE state = 'queued' AND dispatch_id > CAST(:cursor AS uuid)
        ORDER BY dispatch_id
        LIMIT :limit
    ), due AS (
        SELECT o.id
        FROM scanned s
        JOIN outbox o ON o.id = s.dispatch_id
        JOIN jobs j ON j.id = o.job_id
        WHERE j.state = 'queued' AND j.dispatch_id = o.id AND o.published_at IS NOT NULL
            AND o.kind = '{OutboxKind.JOB_DISPATCH.value}'
            AND o.published_at < now()
                - make_interval(secs => :after * power(2, least(o.republish_count, 20)))
        FOR UPDATE OF j, o SKIP LOCKED
    ), r AS (
        UPDATE outbox o SET published_at = NULL, available_at = now(),
            republish_count = o.republish_count + 1, {RETURNS_RESET}
        FROM due WHERE o.id = due.id
        RETURNING o.id, o.job_id, o.republish_count
    )
    SELECT w.scanned, w.last, r.id, r.job_id, r.republish_count,
        CASE WHEN r.id IS NOT NULL THEN pg_notify('{OUTBOX_CHANNEL}', '') END AS notified
    FROM (
        SELECT (SELECT count(*) FROM scanned) AS scanned,
            (SELECT dispatch_id FROM scanned ORDER BY dispatch_id DESC LIMIT 1) AS last
    ) w LEFT JOIN r ON true
    """
)
# One re-publish pass at a time across all sweepers of a database: the pass
# is repair, and two at once would only read the same backlog twice. A
# transaction-level lock ends with the pass, or with its session.
_REPUBLISH_LOCK = text("SELECT pg_try_advisory_xact_lock(:key)")
REPUBLISH_LOCK_KEY = 0x6A70_7265_7075_6231  # "jprepub1"
_START = uuid.UUID(int=0)
_REDISPATCH = text(
    transition_sql(
        # A parked job dispatched by an operator waits for no worker now.
        "state = 'queued', dispatch_id = :dispatch_id, lease_token = NULL, "
        "lease_expires_at = NULL, next_attempt_time = NULL, waiting_reason = NULL",
        "id = :id AND tenant_id = :tenant_id "
        "AND (state = 'queued' OR (state = 'running' AND lease_expires_at < now()))",
    )
)


@dataclass(frozen=True, slots=True)
class Republished:
    """A dispatch made due again: its job, and how often that row was re-published."""

    job_id: uuid.UUID
    dispatch_id: uuid.UUID
    count: int


@dataclass(frozen=True, slots=True)
class RepublishPass:
    """What one pass over QUEUED jobs for lost dispatches did."""

    republished: list[Republished]
    scanned: int  # QUEUED jobs looked at
    lap_done: bool  # reached the last QUEUED job: the next pass starts from the first


@dataclass(frozen=True, slots=True)
class LeaseRepair:
    """What one pass over expired leases did."""

    requeued: int = 0
    failed: int = 0


class SweepStore:
    """SQL of the sweeper and of operator re-dispatch."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._cursor = _START

    async def expire_leases(
        self, *, grace: float, limit: int, delay: Callable[[int], float]
    ) -> LeaseRepair:
        """Jobs whose worker stopped heartbeating: a new attempt, or FAILED when none is left.

        The lost attempt counts: a job that kills its worker every time ends
        FAILED after max_attempts instead of looping.
        """
        requeued = failed = 0
        async with self._engine.begin() as conn:
            rows = (await conn.execute(_EXPIRED, {"grace": grace, "limit": limit})).all()
            for row in rows:
                params: dict[str, Any] = {
                    "id": row.id,
                    "attempt": row.attempt,
                    "event_data": dumps({"error": {"code": "LEASE_EXPIRED", "retryable": True}}),
                }
                message = f"attempt {row.attempt} stopped heartbeating (its worker died or hung)"
                if row.attempt - row.retry_base < row.max_attempts:
                    dispatch_id = new_id()
                    await conn.execute(
                        _REQUEUE,
                        {
                            **params,
                            "message": message,
                            "dispatch_id": dispatch_id,
                            "delay": delay(int(row.attempt)),
                            "event_type": "retry_scheduled",
                            "event_message": message,
                        },
                    )
                    await conn.execute(_OUTBOX_FOR_JOB, {"id": row.id, "dispatch_id": dispatch_id})
                    requeued += 1
                else:
                    final = f"{message}; no attempts left"
                    error = {
                        "code": "LEASE_EXPIRED",
                        "retryable": False,
                        "attempts_exhausted": True,
                    }
                    await conn.execute(
                        _FAIL_EXPIRED,
                        {
                            **params,
                            "event_data": dumps({"error": error}),
                            "message": final,
                            "event_type": "failed",
                            "event_message": final,
                        },
                    )
                    failed += 1
        return LeaseRepair(requeued=requeued, failed=failed)

    async def state_of(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> str | None:
        """The job's state, or None when there is no such job."""
        async with self._engine.connect() as conn:
            state = (
                await conn.execute(_STATE, {"id": job_id, "tenant_id": tenant_id})
            ).scalar_one_or_none()
        return None if state is None else str(state)

    async def stuck_outbox(self, *, older_than: float) -> int:
        """Outbox rows due for longer than ``older_than`` seconds and still unpublished."""
        async with self._engine.connect() as conn:
            count = (await conn.execute(_STUCK_OUTBOX, {"older_than": older_than})).scalar_one()
        return int(count)

    async def republish_unclaimed(
        self, *, after: float, scan: int, window: int = 1000
    ) -> RepublishPass | None:
        """Make due again the dispatches of QUEUED jobs published long ago and never claimed.

        "Long ago" is ``after`` seconds for a row's first re-publish, doubling
        with each one after it. Looks at no more than ``scan`` QUEUED jobs (in
        statements of ``window``), continuing where the last pass of this store
        stopped. None when another sweeper's pass is running.
        """
        found: list[Republished] = []
        scanned = 0
        lap_done = False
        async with self._engine.begin() as conn:
            locked = await conn.execute(_REPUBLISH_LOCK, {"key": REPUBLISH_LOCK_KEY})
            if not locked.scalar_one():
                return None
            while scanned < scan and not lap_done:
                limit = min(window, scan - scanned)
                rows = (
                    await conn.execute(
                        _REPUBLISH, {"after": after, "limit": limit, "cursor": self._cursor}
                    )
                ).all()
                head = rows[0]
                scanned += int(head.scanned)
                found += [
                    Republished(
                        uuid.UUID(str(r.job_id)), uuid.UUID(str(r.id)), int(r.republish_count)
                    )
                    for r in rows
                    if r.id is not None
                ]
                lap_done = head.scanned < limit
                self._cursor = _START if lap_done else uuid.UUID(str(head.last))
        return RepublishPass(found, scanned, lap_done)

    async def redispatch(self, tenant_id: uuid.UUID, job_id: uuid.UUID, reason: str) -> Job | None:
        """A fresh dispatch of a QUEUED job (or a RUNNING one whose lease ran out).

        None when the job is unknown, finished, or held by a live attempt.
        """
        dispatch_id = new_id()
        async with self._engine.begin() as conn:
            row = (
                (
                    await conn.execute(
                        _REDISPATCH,
                        {
                            "id": job_id,
                            "tenant_id": tenant_id,
                            "dispatch_id": dispatch_id,
                            "event_type": "queued",
                            "event_message": reason,
                            "event_data": "{}",
                        },
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                return None
            await conn.execute(_OUTBOX_FOR_JOB, {"id": job_id, "dispatch_id": dispatch_id})
            return job_from_row(row)
