"""The Postgres connections each process holds, within docs/operations.md's bounds.

Each process runs as an operator starts it, on a database URL naming it
(``application_name``), so pg_stat_activity tells whose each backend is. A
burst of jobs and listings fills its pools as far as the load takes them;
the most backends seen at once must stay within the documented bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from jobplane.client import AsyncClient, JobState
from jobplane.store.engine import create_engine
from jobplane.store.keys import KeyStore
from jobplane.topology import Topology
from tests.faults.cluster import topology_toml
from tests.support import services
from tests.support.serve import serve_process

# docs/operations.md, "Connections per process": the most each holds by default.
BOUNDS = {"serve": 9, "relay": 9, "worker": 9, "sweep": 8, "dev": 9}


class Peaks:
    """The most backends of each application_name seen at once on one database."""

    def __init__(self, database: str) -> None:
        self._database = database
        self.most: dict[str, int] = {}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Peaks:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *_: object) -> None:
        self._stop.set()
        assert self._task is not None
        await self._task

    async def _sample(self) -> None:
        conn = await asyncpg.connect(services.PG_ADMIN_URL)
        try:
            while not self._stop.is_set():
                rows = await conn.fetch(
                    "SELECT application_name AS name, count(*) AS n FROM pg_stat_activity "
                    "WHERE datname = $1 GROUP BY 1",
                    self._database,
                )
                for row in rows:
                    self.most[row["name"]] = max(self.most.get(row["name"], 0), row["n"])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), timeout=0.05)
        finally:
            await conn.close()


def _env(database_url: str, name: str, amqp_url: str, topology_file: Path) -> dict[str, str]:
    return {
        "JOBPLANE_DATABASE_URL": f"{database_url}?application_name=jp-{name}",
        "JOBPLANE_AMQP_URL": amqp_url,
        "JOBPLANE_TOPOLOGY": str(topology_file),
        "JOBPLANE_METRICS_LISTEN": "off",
        "JOBPLANE_UI_LISTEN": "off",
        "JOBPLANE_LOG_LEVEL": "warning",
    }


@contextlib.asynccontextmanager
async def _process(*args: str, env: dict[str, str]) -> AsyncIterator[asyncio.subprocess.Process]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jobplane", *args,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout=30)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _load(address: str, key: str, jobs: int = 300) -> None:
    """A burst of jobs, with listings beside them, all waited for."""
    async with AsyncClient(address, key) as client:
        listings = asyncio.gather(*(client.list() for _ in range(20)))
        submitted = await asyncio.gather(
            *(client.submit("demo.echo", {"i": i}) for i in range(jobs))
        )
        await listings
        names = [job.name for job in submitted]
        states = await asyncio.gather(*(client.wait(name, timeout=120) for name in names))
        assert {done.state for done in states} == {JobState.SUCCEEDED}


@pytest.fixture
def topology_file(topology: Topology, tmp_path: Path) -> Path:
    path = tmp_path / "topology.toml"
    path.write_text(topology_toml(topology))
    return path


async def test_serve_relay_worker_and_sweep_hold_at_most_their_bounds(
    database_url: str, amqp_url: str, topology_file: Path
) -> None:
    database = make_url(database_url).database
    assert database
    engine = create_engine(database_url, pool_size=1)
    try:
        key, _tenant = await KeyStore(engine).create_key("acme")
    finally:
        await engine.dispose()

    def env(name: str) -> dict[str, str]:
        return _env(database_url, name, amqp_url, topology_file)

    async with (
        Peaks(database) as peaks,
        serve_process(env("serve")["JOBPLANE_DATABASE_URL"], **env("serve")) as server,
        _process("relay", env=env("relay")),
        _process("worker", "--demo", env=env("worker")),
        _process("sweep", "--interval", "0.5", env=env("sweep")),
    ):
        await asyncio.wait_for(_load(server.address, key), timeout=240)
    for name, bound in BOUNDS.items():
        if name != "dev":
            assert 0 < peaks.most.get(f"jp-{name}", 0) <= bound, (name, peaks.most)


async def test_dev_in_one_process_holds_at_most_its_bound(
    database_url: str, amqp_url: str, topology_file: Path
) -> None:
    database = make_url(database_url).database
    assert database
    env = _env(database_url, "dev", amqp_url, topology_file)
    env["JOBPLANE_LISTEN"] = "127.0.0.1:0"
    async with Peaks(database) as peaks, _process("dev", "--processes", "1", env=env) as dev:
        assert dev.stdout is not None
        address = key = ""
        async with asyncio.timeout(90):
            while not (address and key):
                line = (await dev.stdout.readline()).decode()
                assert line, "jobplane dev ended before it was up"
                if line.strip().startswith("address:"):
                    address = line.split()[1]
                elif line.strip().startswith("api key:"):
                    key = line.split()[2]
        await asyncio.wait_for(_load(address, key), timeout=240)
    # Its LISTEN connection at least; the pools as far as the load took them.
    assert 1 < peaks.most.get("jp-dev", 0) <= BOUNDS["dev"], peaks.most
