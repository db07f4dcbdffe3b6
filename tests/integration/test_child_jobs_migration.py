"""Migration 0024 (child jobs) adds the parent column and its index, and undoes both."""

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

_COLUMN = (
    "SELECT count(*) FROM information_schema.columns "
    "WHERE table_name = 'jobs' AND column_name = 'parent_id' AND table_schema = current_schema()"
)
_INDEX = "SELECT to_regclass('jobs_parent') IS NOT NULL"


@pytest.fixture
async def database_at_0023(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, "0023") as url:
        yield url


def _downgrade(url: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(resources.files("jobplane.migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.downgrade(config, revision)


async def _schema(url: str) -> tuple[int, bool]:
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.connect() as conn:
            column = int((await conn.execute(text(_COLUMN))).scalar_one())
            index = bool((await conn.execute(text(_INDEX))).scalar_one())
    finally:
        await engine.dispose()
    return column, index


async def test_0024_adds_the_parent_and_its_index_and_undoes_them(
    database_at_0023: str,
) -> None:
    assert await _schema(database_at_0023) == (0, False)
    await migrate(database_at_0023, revision="0024", create=False)
    assert await _schema(database_at_0023) == (1, True)
    await asyncio.to_thread(_downgrade, database_at_0023, "0023")
    assert await _schema(database_at_0023) == (0, False)
