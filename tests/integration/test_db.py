"""The hot paths' pool on the real Postgres (ADR-0030): values, errors and sessions."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
import structlog
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, IntegrityError
from structlog.testing import capture_logs

from jobplane.server.status import error_for
from jobplane.store import db as db_module
from jobplane.store.db import Database
from jobplane.store.down import (
    database_down,
    database_transient,
    database_unavailable,
    pool_exhausted,
    sqlstate,
)
from jobplane.store.engine import connect_raw, create_engine


async def test_json_goes_in_as_text_and_comes_out_decoded(db: Database) -> None:
    async with db.connect() as conn:
        row = await conn.fetchrow(
            "SELECT CAST(:doc AS jsonb) AS b, CAST(:doc AS json) AS j, CAST(:id AS uuid) AS id",
            {"doc": '{"n": 1, "s": ["x"]}', "id": str(uuid.UUID(int=7))},
        )
    assert row is not None
    assert row["b"] == row["j"] == {"n": 1, "s": ["x"]}
    assert row["id"] == uuid.UUID(int=7)
    # A dict where JSON text belongs is a caller's mistake, refused, not str()-ed.
    with pytest.raises(DBAPIError):
        async with db.connect() as conn:
            await conn.fetch("SELECT CAST(:doc AS jsonb)", {"doc": {"n": 1}})


async def test_a_constraint_is_an_integrity_error_without_the_values(db: Database) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    async with db.begin() as conn:
        await conn.execute("CREATE TABLE t_unique (v text PRIMARY KEY)")
        await conn.execute("INSERT INTO t_unique VALUES (:v)", {"v": secret})
    with pytest.raises(IntegrityError) as refused:
        async with db.connect() as conn:
            await conn.execute("INSERT INTO t_unique VALUES (:v)", {"v": secret})
    assert sqlstate(refused.value) == "23505"
    assert not database_transient(refused.value)
    assert secret not in str(refused.value.statement) and refused.value.params is None


async def test_a_failed_block_rolls_its_transaction_back(db: Database) -> None:
    async with db.begin() as conn:
        await conn.execute("CREATE TABLE t_rollback (v int)")

    async def change_of_mind() -> None:
        async with db.begin() as conn:
            await conn.execute("INSERT INTO t_rollback VALUES (1)")
            raise RuntimeError("the caller changed its mind")

    with pytest.raises(RuntimeError):
        await change_of_mind()
    async with db.connect() as conn:
        assert await conn.fetchval("SELECT count(*) FROM t_rollback") == 0
        # The connection came back out of any transaction.
        assert not conn.raw.is_in_transaction()


async def test_a_session_ended_mid_statement_is_down_and_replaced(database_url: str) -> None:
    # One connection: the statement after the loss must get a new one.
    async with Database(database_url, size=1) as db, Database(database_url, size=1) as other:

        async def sleeper() -> None:
            async with db.connect() as conn:
                await conn.fetch("SELECT pg_sleep(30)")

        sleeping = asyncio.create_task(sleeper())
        async with other.connect() as killer:
            pid = None
            for _ in range(200):
                pid = await killer.fetchval(
                    "SELECT pid FROM pg_stat_activity "
                    "WHERE datname = current_database() AND query = 'SELECT pg_sleep(30)'"
                )
                if pid is not None:
                    break
                await asyncio.sleep(0.01)
            assert pid is not None
            assert await killer.fetchval("SELECT pg_terminate_backend(:pid)", {"pid": pid})
        with pytest.raises(DBAPIError) as lost:
            await asyncio.wait_for(sleeping, 10)
        assert database_down(lost.value)
        async with db.connect() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") != pid


async def test_a_full_pool_times_out_as_exhausted_not_as_a_database_that_is_down(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A logger not yet used, so that capture_logs sees its line.
    monkeypatch.setattr(db_module, "log", structlog.get_logger("jobplane.db"))
    async with Database(database_url, size=1, acquire_timeout=0.1) as db:
        async with db.connect():
            with capture_logs() as lines, pytest.raises(DBAPIError) as waited:
                async with db.connect():
                    pass
        # docs/operations.md: the pool's size, and what to raise.
        assert [(line["event"], line["size"], line["waited"]) for line in lines] == [
            ("database.pool.exhausted", 1, 0.1)
        ]
        assert str(waited.value.orig) == (
            "no connection of the pool's 1 came free in 0.1 s (JOBPLANE_DB_POOL_SIZE)"
        )
        # The database answers: the wait was the pool's. Retried, and answered
        # UNAVAILABLE, as an outage is, but not said to be one.
        assert pool_exhausted(waited.value)
        assert not database_down(waited.value)
        assert not waited.value.connection_invalidated
        assert database_unavailable(waited.value) and database_transient(waited.value)
        assert error_for(waited.value, "GetJob").code is grpc.StatusCode.UNAVAILABLE
        async with db.connect() as conn:  # the pool's connection is still good
            assert await conn.fetchval("SELECT 1") == 1


async def test_concurrent_first_uses_make_one_pool(database_url: str) -> None:
    db = Database(database_url, size=3)
    try:

        async def pid() -> int:
            async with db.connect() as conn:
                await asyncio.sleep(0.05)
                return int(await conn.fetchval("SELECT pg_backend_pid()"))

        pids = await asyncio.gather(*(pid() for _ in range(9)))
        assert len(set(pids)) <= 3
    finally:
        await db.close()


async def _end_other_sessions(database_url: str) -> int:
    """Terminate every other session of this test's database; how many there were."""
    killer = await connect_raw(database_url)
    try:
        ended: int = await killer.fetchval(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    finally:
        await killer.close()
    # The server's notice of the end reaches the idle sockets on the next turns
    # of the loop.
    await asyncio.sleep(0.3)
    return ended


async def test_an_idle_connection_the_server_ended_is_not_handed_out(database_url: str) -> None:
    async with Database(database_url, size=2) as db:
        async with db.connect() as one, db.connect() as two:
            before = {await one.fetchval("SELECT pg_backend_pid()")}
            before.add(await two.fetchval("SELECT pg_backend_pid()"))
        assert await _end_other_sessions(database_url) >= 2
        async with db.connect() as conn:
            assert await conn.fetchval("SELECT pg_backend_pid()") not in before


async def test_the_engines_idle_connection_the_server_ended_is_not_handed_out(
    database_url: str,
) -> None:
    engine = create_engine(database_url, pool_size=2)
    try:
        async with engine.connect() as one, engine.connect() as two:
            before = {(await one.execute(text("SELECT pg_backend_pid()"))).scalar_one()}
            before.add((await two.execute(text("SELECT pg_backend_pid()"))).scalar_one())
        assert await _end_other_sessions(database_url) >= 2
        for _ in range(3):  # every pooled connection in turn, none of them dead
            async with engine.connect() as conn:
                pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            assert pid not in before
    finally:
        await engine.dispose()
