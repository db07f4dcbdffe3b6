"""Migration 0022 (deadlines): the column and its index, the SQL API's new signature
with the grants of the old one kept, and the way back."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from importlib import resources

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import text

from jobplane.store.engine import create_engine, migrate
from tests.support import services

_OLD = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval, text, integer, text)"
)
_NEW = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval, text, integer, text, timestamptz, interval)"
)
_CAN = "SELECT has_function_privilege(:role, :fn, 'EXECUTE')"
_FOUND = "SELECT to_regprocedure(:fn) IS NOT NULL"
_COLUMN = (
    "SELECT count(*) FROM information_schema.columns "
    "WHERE table_name = 'jobs' AND column_name = 'deadline' AND table_schema = current_schema()"
)
_INDEX = "SELECT to_regclass('jobs_deadline_due') IS NOT NULL"


@pytest.fixture
async def database_at_0021(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, "0021") as url:
        yield url


def _downgrade(url: str, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(resources.files("jobplane.migrations")))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    command.downgrade(config, revision)


async def test_0022_adds_deadlines_keeps_the_grants_and_undoes_cleanly(
    database_at_0021: str,
) -> None:
    role = f"jp_caller_{uuid.uuid4().hex[:8]}"
    engine = create_engine(database_at_0021, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(f'CREATE ROLE "{role}"'))
            await conn.execute(text(f'GRANT EXECUTE ON FUNCTION {_OLD} TO "{role}"'))
        await migrate(database_at_0021, revision="0022", create=False)
        async with engine.begin() as conn:
            assert (await conn.execute(text(_COLUMN))).scalar() == 1
            assert (await conn.execute(text(_INDEX))).scalar()
            assert (await conn.execute(text(_CAN), {"role": role, "fn": _NEW})).scalar()
            assert not (await conn.execute(text(_CAN), {"role": "public", "fn": _NEW})).scalar()
            assert not (await conn.execute(text(_FOUND), {"fn": _OLD})).scalar()
        await engine.dispose()
        await asyncio.to_thread(_downgrade, database_at_0021, "0021")
        async with engine.begin() as conn:
            assert (await conn.execute(text(_COLUMN))).scalar() == 0
            assert not (await conn.execute(text(_INDEX))).scalar()
            assert not (await conn.execute(text(_FOUND), {"fn": _NEW})).scalar()
            assert (await conn.execute(text(_CAN), {"role": role, "fn": _OLD})).scalar()
            await conn.execute(text(f'DROP OWNED BY "{role}"'))
            await conn.execute(text(f'DROP ROLE "{role}"'))
    finally:
        await engine.dispose()
