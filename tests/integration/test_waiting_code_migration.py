"""Migration 0016 backfills waiting codes after its ALTER is committed, by an index."""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text

from jobplane.store.engine import create_engine, migrate
from jobplane.store.keys import KeyStore
from tests.support import services
from tests.support.rows import insert_job

# Each ALTER TABLE and each row the backfill updates, with its transaction:
# an ALTER and a row update in one transaction would be the backfill run
# under the ALTER's exclusive lock.
_WATCH = """
CREATE TABLE seen (what text, xid bigint, state text);
CREATE FUNCTION seen_alter() RETURNS event_trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO seen VALUES ('alter', txid_current(), NULL); END $$;
CREATE EVENT TRIGGER seen_alter ON ddl_command_end WHEN TAG IN ('ALTER TABLE')
    EXECUTE FUNCTION seen_alter();
CREATE FUNCTION seen_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO seen VALUES ('update', txid_current(), OLD.state); RETURN NEW; END $$;
CREATE TRIGGER seen_update BEFORE UPDATE ON jobs FOR EACH ROW EXECUTE FUNCTION seen_update()
"""
_UNWATCH = "DROP EVENT TRIGGER seen_alter"


@pytest.fixture
async def database_at_0015(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, "0015") as url:
        yield url


async def test_0016_backfills_queued_jobs_after_committing_its_alter(
    database_at_0015: str,
) -> None:
    engine = create_engine(database_at_0015, pool_size=2)
    try:
        _key, tenant = await (keys := KeyStore(engine)).create_key("acme")
        await keys.close()
        queue = "default"
        parked, _ = await insert_job(engine, tenant, queue, "demo.echo")
        handed_back, _ = await insert_job(engine, tenant, queue, "demo.echo")
        done, _ = await insert_job(engine, tenant, queue, "demo.echo")
        async with engine.begin() as conn:
            await conn.execute(
                text(
                    "UPDATE jobs SET waiting_reason = 'no live worker', dispatch_id = NULL "
                    "WHERE id = :id"
                ),
                {"id": parked},
            )
            await conn.execute(
                text("UPDATE jobs SET waiting_reason = 'handed back' WHERE id = :id"),
                {"id": handed_back},
            )
            await conn.execute(
                text("UPDATE jobs SET state = 'succeeded', end_time = now() WHERE id = :id"),
                {"id": done},
            )
            for statement in _WATCH.split(";\n"):
                await conn.execute(text(statement))
        await migrate(database_at_0015, create=False)
        async with engine.begin() as conn:
            await conn.execute(text(_UNWATCH))
            seen = (await conn.execute(text("SELECT what, xid, state FROM seen"))).all()
            rows = (await conn.execute(text("SELECT id, waiting_code FROM jobs"))).all()
        codes = {row.id: row.waiting_code for row in rows}
        alters = {xid for what, xid, _ in seen if what == "alter"}
        updates = [(xid, state) for what, xid, state in seen if what == "update"]
        assert alters, "the migration's ALTER TABLE was not seen"
        assert updates, "the backfill updated no row"
        assert not alters & {xid for xid, _ in updates}
        # Only QUEUED jobs are read (and written) by the backfill.
        assert {state for _, state in updates} == {"queued"}
        assert codes == {parked: "NO_LIVE_WORKER", handed_back: "HANDED_BACK", done: None}
    finally:
        await engine.dispose()


async def test_0016s_backfill_finds_its_rows_by_the_queued_jobs_index(
    database_at_0015: str,
) -> None:
    await migrate(database_at_0015, create=False)
    backfill = importlib.import_module("jobplane.migrations.versions.0016_waiting_code").BACKFILL
    engine = create_engine(database_at_0015, pool_size=1)
    try:
        async with engine.begin() as conn:
            # A table of a few rows is scanned whatever the indexes; without
            # seq scans, a plan that still scans says no index can serve it.
            await conn.execute(text("SET LOCAL enable_seqscan = off"))
            plan = "\n".join(
                (await conn.execute(text("EXPLAIN " + backfill), {"batch": 1000})).scalars()
            )
        assert "jobs_queued_dispatch" in plan, plan
        assert "Seq Scan" not in plan, plan
    finally:
        await engine.dispose()
