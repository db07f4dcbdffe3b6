"""`jobplane dev` as `make dev` runs it: one process serving, relaying and working,
the demo job shown live, then shipped files uploaded and ingested into Qdrant."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.config import Settings
from jobplane.contrib.ingest import open_index
from tests.support import services
from tests.support.ingest import CORPUS
from tests.support.s3 import MotoServer, new_bucket

SERVING = "serving; Ctrl-C to stop"


@pytest.fixture
def vhost_url() -> Iterator[str]:
    """A vhost of its own: the ingest topology's queues and bindings stay in it."""
    name = f"jobplane-dev-{uuid.uuid4().hex[:8]}"
    yield services.create_vhost(name)
    services.delete_vhost(name)


def _env(database_url: str, amqp_url: str, moto: MotoServer, data_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "JOBPLANE_DATABASE_URL": database_url,
        "JOBPLANE_AMQP_URL": amqp_url,
        "JOBPLANE_LISTEN": "127.0.0.1:0",
        "JOBPLANE_UI_LISTEN": "127.0.0.1:0",
        "JOBPLANE_TOPOLOGY": "builtin:dev",
        "JOBPLANE_S3_URL": moto.url,
        "JOBPLANE_S3_BUCKET": new_bucket(),
        "JOBPLANE_S3_ACCESS_KEY_ID": "testing",
        "JOBPLANE_S3_SECRET_ACCESS_KEY": "testing",
        "JOBPLANE_DATA_DIR": str(data_dir),
    }


async def _run_until_serving(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run ``jobplane dev ARGS`` until it says it is serving, then Ctrl-C it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        "dev",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(90):
            async for raw in process.stdout:
                lines.append(raw.decode(errors="replace").rstrip("\n"))
                if lines[-1] == SERVING:
                    process.send_signal(signal.SIGINT)
            code = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return code, "\n".join(lines)


async def test_dev_shows_the_demo_then_ingests_the_shipped_files(
    engine: AsyncEngine, database_url: str, vhost_url: str, moto: MotoServer, tmp_path: Path
) -> None:
    env = _env(database_url, vhost_url, moto, tmp_path)
    files = [str(CORPUS / "guide.pdf"), str(CORPUS / "pipelines.md")]
    code, out = await _run_until_serving(
        ["--demo", "--demo-steps", "3", *(a for f in files for a in ("--ingest", f))], env
    )
    assert code == 0, out
    assert "jobplane dev is up." in out and "api key:" in out
    # The dashboard's address, printed beside the key it signs in with.
    dashboard = next(line for line in out.splitlines() if "dashboard:" in line)
    assert "http://127.0.0.1:" in dashboard and not dashboard.rstrip().endswith(":0/"), out
    # The demo job's own page there, to watch it move.
    base = dashboard.split("dashboard:", 1)[1].split()[0]
    demo = next(line for line in out.splitlines() if "on the dashboard:" in line)
    assert re.fullmatch(
        re.escape(base) + r"jobs/[0-9a-f-]{36}", demo.split("on the dashboard:", 1)[1].strip()
    ), out
    assert 'succeeded\nresult: {"steps": 3}' in out, out
    # Each file's summary line, after its stages ran in the one process.
    guide = next(line for line in out.splitlines() if line.startswith(f"{files[0]}: 2 page(s)"))
    assert "points in jobplane_ingest" in guide, out
    assert any(line.startswith(f"{files[1]}: 1 page(s)") for line in out.splitlines()), out
    for stage in ("[parse]", "[chunk]", "[embed]", "[index]"):
        assert stage in out, out
    # The points are in the local index under the data directory, and stay there.
    async with engine.connect() as conn:
        tenant = (await conn.execute(text("SELECT id FROM tenants WHERE name = 'dev'"))).scalar()
    settings = Settings.from_env({"JOBPLANE_DATA_DIR": str(tmp_path)})
    async with open_index(settings) as index:
        points = await index.points(str(tenant))
    assert sorted({p.payload["file"] for p in points}) == sorted(files)


async def test_dev_refuses_to_ingest_without_its_pipeline(
    database_url: str, vhost_url: str, moto: MotoServer, tmp_path: Path
) -> None:
    env = _env(database_url, vhost_url, moto, tmp_path)
    del env["JOBPLANE_TOPOLOGY"]
    code, out = await _run_until_serving(["--ingest", str(CORPUS / "notes.txt")], env)
    assert code == 2, out
    assert "JOBPLANE_TOPOLOGY=builtin:ingest" in out, out

    env = _env(database_url, vhost_url, moto, tmp_path)
    code, out = await _run_until_serving(["--ingest", str(tmp_path / "missing.txt")], env)
    assert code == 2, out
    assert "no such file" in out, out
