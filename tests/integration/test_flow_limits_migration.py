"""Migration 0021 (flow limits) undone: the jobs it held for a RUNNING slot have
no dispatch and nothing before it would release them, so they are left parked,
for a worker of their type to dispatch when it starts."""

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

_HOLD = text(
    "UPDATE jobs SET dispatch_id = NULL, waiting_code = :code, waiting_reason = 'held', "
    "flow_key = :key WHERE id = :id"
)


@pytest.fixture
async def database_at_0021(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, "0021") as url:
        yield url


def _downgrade(url: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(resources.files("jobplane.migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.downgrade(config, revision)


async def test_undoing_0021_parks_the_jobs_it_held(database_at_0021: str) -> None:
    engine = create_engine(database_at_0021, pool_size=2)
    try:
        _key, tenant = await (keys := KeyStore(engine)).create_key("acme")
        await keys.close()
        held, _ = await insert_job(engine, tenant, "default", "demo.echo")
        slot, _ = await insert_job(engine, tenant, "default", "demo.echo")
        plain, _ = await insert_job(engine, tenant, "default", "demo.echo")
        async with engine.begin() as conn:
            await conn.execute(_HOLD, {"id": held, "code": "RATE_LIMITED", "key": "limit/x"})
            await conn.execute(_HOLD, {"id": slot, "code": "TENANT_LIMIT", "key": "queue/q/t"})
        await engine.dispose()
        await asyncio.to_thread(_downgrade, database_at_0021, "0020")
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT id, waiting_code FROM jobs"))).all()
    finally:
        await engine.dispose()
    codes = {row.id: row.waiting_code for row in rows}
    assert codes[held] == codes[slot] == "NO_LIVE_WORKER"
    assert codes[plain] != "NO_LIVE_WORKER"
