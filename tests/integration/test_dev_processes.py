"""`jobplane dev --processes N`: one command, workers in child processes, one Ctrl-C.

Each test runs the real command against its own database and vhost, submits
through the SDK, and reads from Postgres which process claimed each job.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import AsyncClient
from tests.support import services

SERVING = "serving; Ctrl-C to stop"


@pytest.fixture
def vhost_url() -> Iterator[str]:
    name = f"jobplane-devp-{uuid.uuid4().hex[:8]}"
    yield services.create_vhost(name)
    services.delete_vhost(name)


@dataclass
class Dev:
    process: asyncio.subprocess.Process
    lines: list[str]
    address: str
    key: str
    parts: list[int]
    relay: int | None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes: it is not running any more.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _gone(pids: list[int], within: float) -> bool:
    async with asyncio.timeout(within):
        while any(_alive(p) for p in pids):  # noqa: ASYNC110 - no event says a pid ended
            await asyncio.sleep(0.1)
    return True


@asynccontextmanager
async def _dev(database_url: str, amqp_url: str, *args: str) -> AsyncIterator[Dev]:
    env = {
        **os.environ,
        "JOBPLANE_DATABASE_URL": database_url,
        "JOBPLANE_AMQP_URL": amqp_url,
        "JOBPLANE_LISTEN": "127.0.0.1:0",
        "JOBPLANE_UI_LISTEN": "off",
        "JOBPLANE_METRICS_LISTEN": "127.0.0.1:0",
    }
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
        async with asyncio.timeout(60):
            while not lines or lines[-1] != SERVING:
                raw = await process.stdout.readline()
                assert raw, "\n".join(lines)
                lines.append(raw.decode(errors="replace").rstrip("\n"))
        out = "\n".join(lines)
        address = re.search(r"address:\s+(\S+)", out)
        key = re.search(r"api key:\s+(\S+)", out)
        layout = re.search(r"processes: (\d+) \(.*?\)", out)
        assert address and key and layout, out
        workers = re.search(r"workers ([\d, ]+)\)", layout.group(0))
        parts = [int(p) for p in workers.group(1).split(", ")] if workers else []
        relay = re.search(r"relay (\d+);", layout.group(0))
        yield Dev(
            process,
            lines,
            address.group(1),
            key.group(1),
            parts,
            int(relay.group(1)) if relay else None,
        )
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _rest(dev: Dev) -> str:
    assert dev.process.stdout is not None
    async with asyncio.timeout(30):
        rest = await dev.process.stdout.read()
    return "\n".join(dev.lines) + "\n" + rest.decode(errors="replace")


async def _claimed_by(engine: AsyncEngine, names: list[str]) -> dict[str, int]:
    """Job name → pid of the worker process that started it."""
    ids = [uuid.UUID(n.removeprefix("jobs/")) for n in names]
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT e.job_id, w.pid FROM job_events e "
                "JOIN workers w ON w.id = (e.data->>'worker')::uuid "
                "WHERE e.type = 'started' AND e.job_id = ANY(:ids)"
            ),
            {"ids": ids},
        )
        return {f"jobs/{r.job_id}": r.pid for r in rows}


async def test_workers_run_in_child_processes_and_stop_with_one_ctrl_c(
    engine: AsyncEngine, database_url: str, vhost_url: str
) -> None:
    async with _dev(database_url, vhost_url, "--processes", "4", "--concurrency", "2") as dev:
        # The server here; the relay and two workers in processes of their own.
        assert len(dev.parts) == 2 and os.getpid() not in dev.parts, dev.lines
        assert dev.relay is not None and dev.relay not in (*dev.parts, dev.process.pid)
        assert all(_alive(p) for p in (*dev.parts, dev.relay))
        async with AsyncClient(dev.address, dev.key) as client:
            jobs = [
                await client.submit("demo.progress", {"steps": 2, "interval_ms": 40})
                for _ in range(24)
            ]
            ended = [await client.wait(j.name, timeout=60) for j in jobs]
        assert {j.state.name for j in ended} == {"SUCCEEDED"}
        by = await _claimed_by(engine, [j.name for j in jobs])
        assert set(by) == {j.name for j in jobs}
        # Every job ran in a worker part, and both parts took some.
        assert set(by.values()) == set(dev.parts)
        dev.process.send_signal(signal.SIGINT)
        async with asyncio.timeout(30):
            code = await dev.process.wait()
        out = await _rest(dev)
        assert code == 0, out
        assert await _gone([*dev.parts, dev.relay], within=5)


async def test_two_processes_keep_the_relay_beside_the_server(
    engine: AsyncEngine, database_url: str, vhost_url: str
) -> None:
    async with _dev(database_url, vhost_url, "--processes", "2") as dev:
        assert dev.relay is None and len(dev.parts) == 1, dev.lines
        assert any("server and relay in this one" in line for line in dev.lines), dev.lines
        async with AsyncClient(dev.address, dev.key) as client:
            job = await client.submit("demo.progress", {"steps": 1, "interval_ms": 1})
            assert (await client.wait(job.name, timeout=30)).state.name == "SUCCEEDED"
        assert await _claimed_by(engine, [job.name]) == {job.name: dev.parts[0]}
        dev.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await dev.process.wait() == 0


async def test_a_relay_part_that_dies_ends_the_command(database_url: str, vhost_url: str) -> None:
    async with _dev(database_url, vhost_url, "--processes", "3") as dev:
        assert dev.relay is not None and len(dev.parts) == 1, dev.lines
        os.kill(dev.relay, signal.SIGKILL)
        async with asyncio.timeout(30):
            code = await dev.process.wait()
        out = await _rest(dev)
        assert code == 1, out
        assert "error: relay part exited (status -9); stopping" in out
        assert await _gone(dev.parts, within=5)


async def test_one_process_runs_it_all_in_the_command(
    engine: AsyncEngine, database_url: str, vhost_url: str
) -> None:
    async with _dev(database_url, vhost_url, "--processes", "1") as dev:
        assert dev.parts == []
        assert any("processes: 1 (" in line for line in dev.lines), dev.lines
        async with AsyncClient(dev.address, dev.key) as client:
            job = await client.submit("demo.progress", {"steps": 1, "interval_ms": 1})
            assert (await client.wait(job.name, timeout=30)).state.name == "SUCCEEDED"
        by = await _claimed_by(engine, [job.name])
        assert by == {job.name: dev.process.pid}
        dev.process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await dev.process.wait() == 0


async def test_a_worker_part_that_dies_ends_the_command(database_url: str, vhost_url: str) -> None:
    async with _dev(database_url, vhost_url, "--processes", "4") as dev:
        dead, other = dev.parts
        os.kill(dead, signal.SIGKILL)
        async with asyncio.timeout(30):
            code = await dev.process.wait()
        out = await _rest(dev)
        assert code == 1, out
        assert "error: worker part 0 exited (status -9); stopping" in out
        assert dev.relay is not None
        assert await _gone([other, dev.relay], within=5)


async def test_worker_parts_stop_when_the_command_is_killed_outright(
    database_url: str, vhost_url: str
) -> None:
    async with _dev(database_url, vhost_url, "--processes", "2") as dev:
        (part,) = dev.parts
        dev.process.kill()
        await dev.process.wait()
        assert await _gone([part], within=15)


async def test_processes_out_of_range_are_refused() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        "dev",
        "--processes",
        "0",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await process.communicate()
    assert process.returncode == 2
    assert b"--processes must be auto or a number of 1..64, not '0'" in err
