"""Migration 0028 (the system's request_ids refused by ``jobplane.submit_job``) refuses
them from then on, keeps the jobs that took one before and the function's grants, and
undoes it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from alembic import command

from jobplane.store.engine import asyncpg_dsn, create_engine, migrate
from jobplane.store.routes import sync_submit_rules
from jobplane.topology import QueueSpec, Topology
from tests.support import services
from tests.support.migrations import alembic_config, revision_before

_FUNCTION = (
    "jobplane.submit_job(text, text, jsonb, text, text, integer, jsonb, double precision, "
    "timestamptz, interval, text, integer, text, timestamptz, interval, uuid[], text)"
)
_SUBMIT = "SELECT jobplane.submit_job('acme', 'demo.echo', request_id => $1)"
_PARENT = "0190c0de-5a1e-7000-8000-00000000beef"


_BEFORE = revision_before("0028")


@pytest.fixture
async def database_before(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, _BEFORE) as url:
        engine = create_engine(url, pool_size=1)
        try:
            async with engine.begin() as conn:
                await conn.exec_driver_sql(
                    "INSERT INTO tenants (id, name) VALUES (gen_random_uuid(), 'acme')"
                )
                await sync_submit_rules(
                    conn,
                    Topology(queues=(QueueSpec("demo", ("demo.*",)),)),
                    max_payload_bytes=256 * 1024,
                )
        finally:
            await engine.dispose()
        yield url


async def _submit(url: str, request_id: str) -> tuple[str, str | None] | None:
    """The function's refusal of ``request_id`` (its SQLSTATE and column); None when
    it wrote the job."""
    conn: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        async with conn.transaction():
            await conn.fetchval(_SUBMIT, request_id)
    except asyncpg.PostgresError as exc:
        return str(exc.sqlstate), exc.column_name
    finally:
        await conn.close()
    return None


async def _fetch(url: str, sql: str, *args: object) -> object:
    conn: asyncpg.Connection = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return await conn.fetchval(sql, *args)
    finally:
        await conn.close()


async def test_0028_refuses_the_systems_request_ids_keeps_old_jobs_and_grants_and_undoes(
    database_before: str,
) -> None:
    url = database_before
    role = f"jp_caller_{uuid.uuid4().hex[:8]}"
    await _fetch(url, f'CREATE ROLE "{role}"')
    await _fetch(url, f'GRANT EXECUTE ON FUNCTION {_FUNCTION} TO "{role}"')
    definition = "SELECT pg_get_functiondef(to_regprocedure($1))"
    before = await _fetch(url, definition, _FUNCTION)
    taken = [f"child:{_PARENT}:k", f"fan:{_PARENT}:0:1:0"]
    for request_id in taken:
        assert await _submit(url, request_id) is None
    try:
        await migrate(url, revision="0028", create=False)
        refused = ("JP001", "request_id")
        assert await _submit(url, f"child:{_PARENT}:other") == refused
        assert await _submit(url, f"fan:{_PARENT}:0:1:1") == refused
        assert await _submit(url, "my-child:1") is None
        # The jobs that took one before keep it; a replay of one is refused too.
        held = "SELECT array_agg(request_id ORDER BY request_id) FROM jobs WHERE request_id ~ $1"
        assert await _fetch(url, held, "^(fan|child):") == sorted(taken)
        assert await _submit(url, taken[0]) == refused
        assert await _fetch(url, "SELECT count(*) FROM jobs") == 3
        can = "SELECT has_function_privilege($1, $2, 'EXECUTE')"
        assert await _fetch(url, can, role, _FUNCTION) is True
        assert await _fetch(url, definition, _FUNCTION) != before

        await asyncio.to_thread(command.downgrade, alembic_config(url), _BEFORE)
        assert await _fetch(url, definition, _FUNCTION) == before
        assert await _submit(url, f"child:{_PARENT}:other") is None
        assert await _fetch(url, can, role, _FUNCTION) is True

        await migrate(url, revision="0028", create=False)
        assert await _submit(url, f"fan:{_PARENT}:0:1:1") == refused
    finally:
        await _fetch(url, f'DROP OWNED BY "{role}"')
        await _fetch(url, f'DROP ROLE "{role}"')
