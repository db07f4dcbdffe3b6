"""Migration 0027 (lifecycle events published by opt-in) marks lifecycle rows, keeps
the declared types in a row of their own, and undoes both."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from alembic import command
from sqlalchemy import text

from jobplane.store.engine import create_engine, migrate
from tests.support import services
from tests.support.migrations import alembic_config, revision_before

_BEFORE = revision_before("0027")
_STATE = """
SELECT jsonb_build_object(
    'column', (SELECT column_default FROM information_schema.columns
               WHERE table_name = 'events' AND column_name = 'lifecycle'),
    'table', to_regclass('lifecycle_publish') IS NOT NULL,
    'marks', strpos(pg_get_functiondef(to_regprocedure(
        'jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, '
        'timestamptz, interval, text, integer, text, timestamptz, interval, uuid[], text)')),
        'job_id, lifecycle)') > 0)
"""
_OLD_EVENT = """
WITH t AS (INSERT INTO tenants (id, name) VALUES (gen_random_uuid(), 'old') RETURNING id)
INSERT INTO events (tenant_id, event_id, event_type, event_time, correlation_id, payload,
                    request_hash)
SELECT t.id, gen_random_uuid(), 'job.succeeded', now(), 'c', '{}', '' FROM t
"""


@pytest.fixture
async def database_before(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, _BEFORE) as url:
        yield url


async def _query(url: str, sql: str) -> object:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as conn:
            result = await conn.execute(text(sql))
            return result.scalar() if result.returns_rows else None
    finally:
        await engine.dispose()


async def test_0027_marks_lifecycle_rows_keeps_the_types_and_undoes_both(
    database_before: str,
) -> None:
    await _query(database_before, _OLD_EVENT)
    before = {"column": None, "table": False, "marks": False}
    assert await _query(database_before, _STATE) == before
    await migrate(database_before, revision="0027", create=False)
    assert await _query(database_before, _STATE) == {
        "column": "false",
        "table": True,
        "marks": True,
    }
    # A row written before is not a lifecycle event: the feed publishes it as it did.
    assert await _query(database_before, "SELECT bool_or(lifecycle) FROM events") is False
    # One row, nothing declared until a sync writes the topology's.
    assert await _query(
        database_before,
        "SELECT jsonb_agg(jsonb_build_array(patterns, event_types)) FROM lifecycle_publish",
    ) == [[[], []]]
    await asyncio.to_thread(command.downgrade, alembic_config(database_before), _BEFORE)
    assert await _query(database_before, _STATE) == before
    await migrate(database_before, revision="0027", create=False)
    assert (await _query(database_before, _STATE)) == {
        "column": "false",
        "table": True,
        "marks": True,
    }
