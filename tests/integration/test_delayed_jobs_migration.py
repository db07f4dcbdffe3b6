"""Migration 0017 gives jobplane.submit_job a new signature and keeps who may call it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text

from jobplane.store.engine import create_engine, migrate
from tests.support import services

_OLD = "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision)"
_NEW = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval)"
)
# Concurrency keys' migration (0018, after this one) adds three more, deadlines'
# (0022) two and dependencies' (0023) two more.
_HEAD = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval, text, integer, text, timestamptz, interval, uuid[], text)"
)
_CAN = "SELECT has_function_privilege(:role, :fn, 'EXECUTE')"


@pytest.fixture
async def database_at_0016(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, "0016") as url:
        yield url


async def test_0017_keeps_the_grants_of_the_sql_api(database_at_0016: str) -> None:
    role = f"jp_caller_{uuid.uuid4().hex[:8]}"
    engine = create_engine(database_at_0016, pool_size=1)
    try:
        async with engine.begin() as conn:
            await conn.execute(text(f'CREATE ROLE "{role}"'))
            await conn.execute(text(f'GRANT EXECUTE ON FUNCTION {_OLD} TO "{role}"'))
            assert (await conn.execute(text(_CAN), {"role": role, "fn": _OLD})).scalar()
        await migrate(database_at_0016, revision="0017", create=False)
        async with engine.begin() as conn:
            assert (await conn.execute(text(_CAN), {"role": role, "fn": _NEW})).scalar()
            assert not (await conn.execute(text(_CAN), {"role": "public", "fn": _NEW})).scalar()
            old = await conn.execute(text("SELECT to_regprocedure(:fn)"), {"fn": _OLD})
            assert old.scalar() is None
            horizon = await conn.execute(text("SELECT max_schedule_seconds FROM submit_settings"))
            assert horizon.scalar() == 366 * 86400
        # The next signature keeps them too, and replaces this one.
        await migrate(database_at_0016, create=False)
        async with engine.begin() as conn:
            assert (await conn.execute(text(_CAN), {"role": role, "fn": _HEAD})).scalar()
            assert not (await conn.execute(text(_CAN), {"role": "public", "fn": _HEAD})).scalar()
            for gone in (_OLD, _NEW):
                found = await conn.execute(text("SELECT to_regprocedure(:fn)"), {"fn": gone})
                assert found.scalar() is None
            await conn.execute(text(f'DROP OWNED BY "{role}"'))
            await conn.execute(text(f'DROP ROLE "{role}"'))
    finally:
        await engine.dispose()
