"""Migration 0025 (fan-out and join) adds its columns, and undoes them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from importlib import resources

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import text

from jobplane.store.engine import create_engine, migrate
from tests.support import services

_COLUMNS = """
SELECT table_name || '.' || column_name FROM information_schema.columns
WHERE table_schema = current_schema() AND (
    (table_name = 'jobs' AND column_name IN ('fan_stage', 'fan_size', 'deps_tolerate',
                                             'deps_wait_all', 'fan_progress'))
    OR (table_name = 'job_stages' AND column_name IN ('fan_out', 'max_failures', 'fail_fast'))
    OR (table_name = 'job_dependencies' AND column_name IN ('idx', 'progress')))
ORDER BY 1
"""
_ALL = [
    "job_dependencies.idx",
    "job_dependencies.progress",
    "job_stages.fail_fast",
    "job_stages.fan_out",
    "job_stages.max_failures",
    "jobs.deps_tolerate",
    "jobs.deps_wait_all",
    "jobs.fan_progress",
    "jobs.fan_size",
    "jobs.fan_stage",
]


@pytest.fixture
async def database_at_0024(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, "0024") as url:
        yield url


def _downgrade(url: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(resources.files("jobplane.migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.downgrade(config, revision)


async def _columns(url: str) -> list[str]:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return [str(c) for c in (await conn.execute(text(_COLUMNS))).scalars()]
    finally:
        await engine.dispose()


async def test_0025_adds_the_fan_out_columns_and_undoes_them(database_at_0024: str) -> None:
    assert await _columns(database_at_0024) == []
    await migrate(database_at_0024, revision="0025", create=False)
    assert await _columns(database_at_0024) == _ALL
    await asyncio.to_thread(_downgrade, database_at_0024, "0024")
    assert await _columns(database_at_0024) == []
