"""An attempt read back by its fence, for a worker that reports over gRPC.

A worker of :mod:`jobplane.server.worker_protocol` holds only the fence of its
attempt (job, attempt, lease token); the outcome rules need the rest of it
(attempts left, the queue's backoff). Reading it is no write and no check:
every write is still fenced by the statement that makes it.
"""

from __future__ import annotations

import uuid

from sqlalchemy import text

from jobplane.store.attempts import Attempt, attempt_from_row, stage_run
from jobplane.store.db import Database
from jobplane.store.machine import ATTEMPT_FENCE, Transition, where_sources

# The states the attempt's own writes start from (the machine's table): an
# attempt of a job that ended, or went back to the queue, holds nothing. An
# expired lease still holds until another attempt claims the job, as for the
# Python worker's writes.
_HELD = text(
    f"""
    SELECT tenant_id, type, payload, attempt, max_attempts, retry_base, correlation_id,
           request_id, timeout_seconds, queue, pipeline, pipeline_version, stage,
           payload_blob, payload_blob_size
    FROM jobs WHERE {ATTEMPT_FENCE} AND {where_sources(Transition.PROGRESS)}
    """
)


class HeldAttempts:
    """Reads attempts by their fence.

    The outcome writes read what is read here as they read what
    :meth:`AttemptStore.claim` returned: whatever the claim fills in an
    :class:`Attempt` that a write depends on, this must fill too.
    """

    def __init__(self, db: Database) -> None:
        self._db = db

    async def get(self, job_id: uuid.UUID, attempt: int, lease_token: uuid.UUID) -> Attempt | None:
        """The running attempt with this fence; None when it holds the job no longer."""
        params = {"id": job_id, "attempt": attempt, "lease_token": lease_token}
        async with self._db.connect() as conn:
            row = await conn.fetchrow(_HELD, params)
            if row is None:
                return None
            # A pipeline's stage attempt succeeds by advancing to the next stage.
            stage = None if row["stage"] is None else await stage_run(conn, job_id, row)
        tenant_id = uuid.UUID(str(row["tenant_id"]))
        # No started_event_id: only the Python handler's ctx.emit needs it, and
        # this path emits nothing.
        return attempt_from_row(job_id, tenant_id, lease_token, row, stage)
