"""Migration 0026 (the running row) indexes RUNNING jobs without their lease, leaves
room on jobs' pages, and undoes both."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from alembic import command
from sqlalchemy import text

from jobplane.store import sweeps
from jobplane.store.engine import create_engine, migrate
from tests.support import services
from tests.support.migrations import alembic_config, revision_before

_INDEXES = """
SELECT coalesce(array_agg(indexrelid::regclass::text ORDER BY 1), '{}')
FROM pg_index WHERE indrelid = 'jobs'::regclass AND indisvalid
"""
_OPTIONS = "SELECT coalesce(reloptions, '{}') FROM pg_class WHERE oid = 'jobs'::regclass"


_BEFORE = revision_before("0026")


@pytest.fixture
async def database_before(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, _BEFORE) as url:
        yield url


def _downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


async def _schema(url: str) -> tuple[set[str], list[str]]:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as conn:
            indexes = set((await conn.execute(text(_INDEXES))).scalar_one())
            options = list((await conn.execute(text(_OPTIONS))).scalar_one())
    finally:
        await engine.dispose()
    return indexes, options


async def test_0026_swaps_the_lease_index_sets_the_fillfactor_and_undoes_both(
    database_before: str,
) -> None:
    before, options = await _schema(database_before)
    assert "jobs_running_lease" in before and "jobs_running" not in before
    assert options == []
    await migrate(database_before, revision="0026", create=False)
    after, options = await _schema(database_before)
    assert after == (before - {"jobs_running_lease"}) | {"jobs_running"}
    assert options == ["fillfactor=80"]
    await asyncio.to_thread(_downgrade, database_before, _BEFORE)
    assert await _schema(database_before) == (before, [])


async def test_the_sweepers_expired_leases_read_the_running_jobs_index(
    database_before: str,
) -> None:
    """On a table of ended jobs and a few RUNNING ones, the sweeper's statement reads
    the RUNNING jobs through their index, never the whole table."""
    await migrate(database_before, revision="0026", create=False)
    engine = create_engine(database_before, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(_FILL))
            await conn.execute(text("ANALYZE jobs"))
            plan = "\n".join(
                (
                    await conn.execute(
                        text("EXPLAIN " + sweeps._EXPIRED.text), {"grace": 5.0, "limit": 100}
                    )
                ).scalars()
            )
    finally:
        await engine.dispose()
    assert "jobs_running" in plan, plan
    assert "Seq Scan" not in plan, plan


# 20,000 ended jobs and 20 RUNNING ones of one tenant.
_FILL = """
WITH t AS (
    INSERT INTO tenants (id, name) VALUES (gen_random_uuid(), 'plans') RETURNING id
)
INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts, request_id,
                  request_hash, lease_expires_at, end_time)
SELECT gen_random_uuid(), t.id, 'plan.job', 'default',
       CASE WHEN n <= 20 THEN 'running' ELSE 'succeeded' END, '{}', 1, 'r' || n, '\\x00',
       CASE WHEN n <= 20 THEN now() - interval '1 minute' END,
       CASE WHEN n > 20 THEN now() END
FROM t, generate_series(1, 20000) n
"""
