"""Nothing secret or tenant-owned reaches a log line of `jobplane serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import AsyncClient, InternalError, Unauthenticated
from jobplane.store.keys import KeyStore

MARKER = "tenant-secret-marker-5f1c"


@dataclass
class Serve:
    """A `jobplane serve` process and every line it wrote to stderr."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    address: str = ""

    async def read(self, started: asyncio.Event) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if line.startswith("jobplane serving on "):
                self.address = line.split()[3]
                started.set()

    def records(self) -> list[dict[str, object]]:
        """The JSON log records among the lines."""
        found = []
        for line in self.lines:
            if line.startswith("{"):
                found.append(json.loads(line))
        return found


@pytest.fixture
async def serve(database_url: str) -> AsyncIterator[Serve]:
    env = {
        **os.environ,
        "JOBPLANE_DATABASE_URL": database_url,
        "JOBPLANE_LISTEN": "127.0.0.1:0",
        "JOBPLANE_LOG_LEVEL": "debug",
        "JOBPLANE_LOG_FORMAT": "json",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jobplane", "serve", env=env, stderr=asyncio.subprocess.PIPE
    )
    running = Serve(process)
    started = asyncio.Event()
    reader = asyncio.create_task(running.read(started))
    try:
        await asyncio.wait_for(started.wait(), timeout=30)
        yield running
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), timeout=30)
        await asyncio.wait_for(reader, timeout=10)


async def test_payloads_and_keys_never_reach_the_server_log(
    serve: Serve, engine: AsyncEngine
) -> None:
    issued = await KeyStore(engine).issue("acme")
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
    async with AsyncClient(serve.address, issued.key) as client:
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

    serve.process.send_signal(signal.SIGTERM)
    await asyncio.wait_for(serve.process.wait(), timeout=30)
    await asyncio.sleep(0)  # let the reader take the last lines

    records = serve.records()
    failed = [r for r in records if r.get("event") == "rpc.failed"]
    assert len(failed) == 1, serve.lines
    # The failure is logged, with its traceback and who called: by key id.
    assert failed[0]["api_key_id"] == issued.key_id
    assert failed[0]["tenant_id"] == str(issued.tenant_id)
    assert failed[0]["rpc"] == "SubmitJob"
    assert "RaiseError" in str(failed[0]["exception"])
    finished = [r for r in records if r.get("event") == "rpc.finished"]
    assert {r["api_key_id"] for r in finished} == {issued.key_id}
    assert any(r.get("event") == "auth.refused" for r in records)
    for line in serve.lines:
        assert MARKER not in line
        assert issued.key not in line
        assert issued.key[8:] not in line
        assert forged not in line


async def test_engine_errors_hide_statement_parameters(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        with pytest.raises(DBAPIError) as info:
            await conn.execute(text("SELECT 1 / 0 WHERE :marker <> ''"), {"marker": MARKER})
    assert "division by zero" in str(info.value)
    assert MARKER not in str(info.value)
