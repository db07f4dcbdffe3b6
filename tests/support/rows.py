"""Rows written straight into a test database, the way a writer that skips the
server's validation (or one from before it) would."""

from __future__ import annotations

import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.ids import new_id

# A job, its first event and its outbox row.
_INSERT_JOB = text(
    """
    WITH j AS (
        INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts, request_id,
                          request_hash, correlation_id, dispatch_id, last_seq)
        VALUES (:id, :tenant_id, :type, :queue, 'queued', '{}', 3, :request_id, '\\x00',
                :correlation_id, :dispatch_id, 1)
        RETURNING id, tenant_id, type, correlation_id, dispatch_id
    ), e AS (
        INSERT INTO job_events (job_id, seq, tenant_id, type, state, progress, message, attempt)
        SELECT id, 1, tenant_id, 'queued', 'queued', 0, 'queued', 0 FROM j
    )
    INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id)
    SELECT dispatch_id, tenant_id, id, type, correlation_id FROM j
    """
)


async def insert_job(
    engine: AsyncEngine,
    tenant_id: uuid.UUID,
    queue: str,
    job_type: str,
    correlation_id: str = "",
) -> tuple[uuid.UUID, uuid.UUID]:
    """A QUEUED job with a due outbox row; returns (job id, dispatch id)."""
    job_id, dispatch_id = new_id(), new_id()
    async with engine.begin() as conn:
        await conn.execute(
            _INSERT_JOB,
            {
                "id": job_id,
                "tenant_id": tenant_id,
                "type": job_type,
                "queue": queue,
                "request_id": str(job_id),
                "correlation_id": correlation_id,
                "dispatch_id": dispatch_id,
            },
        )
    return job_id, dispatch_id


async def insert_tenant(engine: AsyncEngine, prefix: str) -> uuid.UUID:
    """A tenant of its own, named ``prefix`` and a random suffix; returns its id."""
    async with engine.begin() as conn:
        found = await conn.execute(
            text("INSERT INTO tenants (name) VALUES (:name) RETURNING id"),
            {"name": f"{prefix}-{uuid.uuid4().hex[:8]}"},
        )
        return uuid.UUID(str(found.scalar_one()))
