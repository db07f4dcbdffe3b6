"""Nothing secret or tenant-owned reaches a log line of `jobplane serve`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import AsyncClient, InternalError, Unauthenticated
from jobplane.store.keys import KeyStore
from tests.support.serve import Serve, serve_process

MARKER = "tenant-secret-marker-5f1c"


@pytest.fixture
async def serve(database_url: str) -> AsyncIterator[Serve]:
    async with serve_process(
        database_url, JOBPLANE_LOG_LEVEL="debug", JOBPLANE_LOG_FORMAT="json"
    ) as running:
        yield running


async def test_payloads_and_keys_never_reach_the_server_log(
    serve: Serve, engine: AsyncEngine
) -> None:
    created = await KeyStore(engine).create("acme")
    async with engine.begin() as conn:
        # A database error that echoes the payload in its own message, for
        # the one request that asks for it; its statement's parameters
        # carry the payload too.
        await conn.execute(
            text(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "IF NEW.payload ? 'fail' THEN RAISE EXCEPTION 'refused %', NEW.payload::text; "
                "END IF; RETURN NEW; END $$"
            )
        )
        await conn.execute(
            text(
                "CREATE TRIGGER refuse BEFORE INSERT ON jobs FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        )
    async with AsyncClient(serve.address, created.key) as client:
        job = await client.submit(
            "demo.echo", {"note": MARKER}, labels={"tag": MARKER}, correlation_id=MARKER
        )
        assert (await client.get(job.name)).payload == {"note": MARKER}
        with pytest.raises(InternalError):
            await client.submit("demo.echo", {"fail": True, "note": MARKER})
    forged = "jp_" + "A" * 43
    async with AsyncClient(serve.address, forged) as stranger:
        with pytest.raises(Unauthenticated):
            await stranger.list()

    await serve.stop()

    records = serve.records()
    failed = [r for r in records if r.get("event") == "rpc.failed"]
    assert len(failed) == 1, serve.lines
    # The failure is logged, with its traceback and who called: by key id.
    assert failed[0]["api_key_id"] == created.key_id
    assert failed[0]["tenant_id"] == str(created.tenant_id)
    assert failed[0]["rpc"] == "SubmitJob"
    assert "RaiseError" in str(failed[0]["exception"])
    finished = [r for r in records if r.get("event") == "rpc.finished"]
    assert {r["api_key_id"] for r in finished} == {created.key_id}
    assert any(r.get("event") == "auth.refused" for r in records)
    for line in serve.lines:
        assert MARKER not in line
        assert created.key not in line
        assert created.key[8:] not in line
        assert forged not in line


async def test_engine_errors_hide_statement_parameters(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        with pytest.raises(DBAPIError) as info:
            await conn.execute(text("SELECT 1 / 0 WHERE :marker <> ''"), {"marker": MARKER})
    assert "division by zero" in str(info.value)
    assert MARKER not in str(info.value)
