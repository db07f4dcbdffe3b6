"""Migration 0023 (dependencies) done and undone: the jobs waiting for others have
no dispatch and nothing before it would decide them, so undoing it parks them,
for a worker of their type to dispatch when it starts; the table, the columns
and the SQL API's new signature come and go with it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib import resources

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import text

from jobplane.store.engine import create_engine
from jobplane.store.keys import KeyStore
from tests.support import services
from tests.support.rows import insert_job

_WAIT = text(
    "UPDATE jobs SET dispatch_id = NULL, waiting_code = 'DEPENDENCIES', "
    "waiting_reason = 'waiting', deps_waiting = 1 WHERE id = :id"
)
_EDGE = text(
    "INSERT INTO job_dependencies (job_id, depends_on, tenant_id) VALUES (:job, :on, :tenant)"
)
_SIGNATURE = (
    "SELECT to_regprocedure('jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, "
    "double precision, timestamptz, interval, text, integer, text, timestamptz, interval, uuid[], "
    "text)') IS NOT NULL"
)


@pytest.fixture
async def database_at_0023(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, "0023") as url:
        yield url


def _downgrade(url: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(resources.files("jobplane.migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.downgrade(config, revision)


async def test_undoing_0023_parks_the_jobs_waiting_for_others(database_at_0023: str) -> None:
    engine = create_engine(database_at_0023, pool_size=2)
    try:
        _key, tenant = await (keys := KeyStore(engine)).create_key("acme")
        await keys.close()
        first, _ = await insert_job(engine, tenant, "default", "demo.echo")
        waiting, _ = await insert_job(engine, tenant, "default", "demo.echo")
        plain, _ = await insert_job(engine, tenant, "default", "demo.echo")
        async with engine.begin() as conn:
            await conn.execute(_WAIT, {"id": waiting})
            await conn.execute(_EDGE, {"job": waiting, "on": first, "tenant": tenant})
            assert (await conn.execute(text(_SIGNATURE))).scalar() is True
        await engine.dispose()
        await asyncio.to_thread(_downgrade, database_at_0023, "0022")
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT id, waiting_code FROM jobs"))).all()
            table = "SELECT to_regclass('job_dependencies') IS NULL"
            assert (await conn.execute(text(table))).scalar() is True
            assert (await conn.execute(text(_SIGNATURE))).scalar() is False
            column = (
                "SELECT count(*) FROM information_schema.columns "
                "WHERE table_name = 'jobs' AND column_name = 'has_dependents'"
            )
            assert (await conn.execute(text(column))).scalar() == 0
    finally:
        await engine.dispose()
    codes = {row.id: row.waiting_code for row in rows}
    assert codes[waiting] == "NO_LIVE_WORKER"
    assert codes[plain] != "NO_LIVE_WORKER" and codes[first] != "NO_LIVE_WORKER"
