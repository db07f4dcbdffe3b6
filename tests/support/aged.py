"""Rows of a tenant's past, written straight into the tables: many jobs of any age at once.

The maintenance tests need jobs that ended weeks ago, by the thousand; running
them through the API would take minutes and could not date them. These
helpers write rows shaped as the store writes them (a job with its events
1..last_seq, its stages, its published dispatch; events the feed could
publish), backdated by ``age_days``.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

_JOBS = text(
    """
    WITH made AS (
        INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts, request_id,
                          request_hash, attempt, last_seq, dispatch_id, create_time,
                          update_time, start_time, end_time, pipeline, stage, stage_name)
        SELECT gen_random_uuid(), :tenant_id, :type, 'q', :state, '{"old": true}', 3,
               'aged-' || gen_random_uuid(), '\\x00'::bytea, 1, :events, gen_random_uuid(),
               now() - make_interval(days => :age) - interval '1 hour',
               now() - make_interval(days => :age),
               now() - make_interval(days => :age) - interval '1 hour',
               CASE WHEN :state IN ('succeeded', 'failed', 'cancelled')
                    THEN now() - make_interval(days => :age) END,
               CASE WHEN :stages > 0 THEN 'aged.pipeline' END,
               CASE WHEN :stages > 0 THEN 0 END,
               CASE WHEN :stages > 0 THEN 's0' END
        FROM generate_series(1, :count)
        RETURNING id, dispatch_id, create_time
    ), events AS (
        INSERT INTO job_events (job_id, seq, tenant_id, type, state, progress, attempt,
                                event_time)
        SELECT m.id, s, :tenant_id, 'progress', :state, 0.5, 1, m.create_time
        FROM made m, generate_series(1, :events) s
    ), stages AS (
        INSERT INTO job_stages (job_id, idx, tenant_id, name, type, queue, max_attempts,
                                timeout_seconds, base, span, state)
        SELECT m.id, i, :tenant_id, 's' || i, 'aged.stage', 'q', 3, 60, 0, 1, 'succeeded'
        FROM made m, generate_series(0, :stages - 1) i
    ), dispatches AS (
        INSERT INTO outbox (id, tenant_id, job_id, routing_key, create_time, available_at,
                            published_at)
        SELECT m.dispatch_id, :tenant_id, m.id, :type, m.create_time, m.create_time,
               m.create_time
        FROM made m
    )
    SELECT id FROM made
    """
)
_EVENTS = text(
    """
    INSERT INTO events (tenant_id, event_id, event_type, event_time, correlation_id, payload,
                        request_hash, job_id, create_time)
    SELECT :tenant_id, gen_random_uuid(), 'aged.happened',
           now() - make_interval(days => :age), 'aged', '{"old": true}', '\\x00'::bytea,
           NULL, now() - make_interval(days => :age)
    FROM generate_series(1, :count)
    """
)
_EVENT_ROWS = text(
    """
    INSERT INTO outbox (id, tenant_id, kind, routing_key, body, create_time, available_at,
                        published_at)
    SELECT gen_random_uuid(), :tenant_id, 'event', 'aged.happened', '\\x7b7d'::bytea,
           now() - make_interval(days => :age), now() - make_interval(days => :age),
           CASE WHEN :published THEN now() - make_interval(days => :age) END
    FROM generate_series(1, :count)
    """
)


async def aged_jobs(
    engine: AsyncEngine,
    tenant_id: uuid.UUID,
    count: int,
    *,
    state: str = "succeeded",
    age_days: int = 40,
    events: int = 3,
    stages: int = 0,
    job_type: str = "aged.work",
) -> list[uuid.UUID]:
    """``count`` jobs in ``state`` that started (and, when finished, ended) ``age_days`` ago."""
    params: dict[str, Any] = {
        "tenant_id": tenant_id,
        "count": count,
        "state": state,
        "age": age_days,
        "events": events,
        "stages": stages,
        "type": job_type,
    }
    async with engine.begin() as conn:
        rows = (await conn.execute(_JOBS, params)).scalars().all()
    return [uuid.UUID(str(r)) for r in rows]


async def aged_events(
    engine: AsyncEngine, tenant_id: uuid.UUID, count: int, *, age_days: int = 40
) -> None:
    """``count`` domain events of the tenant created ``age_days`` ago."""
    async with engine.begin() as conn:
        await conn.execute(_EVENTS, {"tenant_id": tenant_id, "count": count, "age": age_days})


async def aged_event_rows(
    engine: AsyncEngine,
    tenant_id: uuid.UUID,
    count: int,
    *,
    age_days: int = 40,
    published: bool = True,
) -> None:
    """``count`` outbox rows of kind event (parked events) of the tenant, ``age_days`` old."""
    params = {"tenant_id": tenant_id, "count": count, "age": age_days, "published": published}
    async with engine.begin() as conn:
        await conn.execute(_EVENT_ROWS, params)


async def tenant_rows(
    engine: AsyncEngine, tenant_id: uuid.UUID, *, keep: uuid.UUID | None = None
) -> dict[str, int]:
    """Rows of the tenant in every table that has a ``tenant_id`` column.

    Found in the catalog, so a table added later is counted without being
    named here. With ``keep``, the rows of that job (and its own events and
    dispatches) are left out.
    """
    async with engine.connect() as conn:
        tables = (
            await conn.execute(
                text(
                    """
                    SELECT c.table_name,
                           bool_or(k.column_name = 'job_id') AS has_job
                    FROM information_schema.columns c
                    JOIN information_schema.columns k
                      ON k.table_schema = c.table_schema AND k.table_name = c.table_name
                    JOIN information_schema.tables t
                      ON t.table_schema = c.table_schema AND t.table_name = c.table_name
                    WHERE c.table_schema = current_schema() AND c.column_name = 'tenant_id'
                      AND t.table_type = 'BASE TABLE'
                    GROUP BY c.table_name ORDER BY c.table_name
                    """
                )
            )
        ).all()
        counts = {}
        for table, has_job in tables:
            where = "tenant_id = :tenant_id"
            if keep is not None and table == "jobs":
                where += " AND id <> :keep"
            elif keep is not None and has_job:
                where += " AND job_id IS DISTINCT FROM :keep"
            found = await conn.execute(
                text(f"SELECT count(*) FROM {table} WHERE {where}"),
                {"tenant_id": tenant_id, "keep": keep},
            )
            counts[str(table)] = int(found.scalar_one())
    return counts
