"""One Ctrl-C stops `make dev` in every phase: the start, the demo, the ingestion,
serving; its parts, and the local S3 server started for it, with it.

A terminal's Ctrl-C is a SIGINT to every process of the foreground process
group; each test runs the command in a group of its own and sends it that.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import services
from tests.support.ingest import CORPUS
from tests.support.ports import free_port, free_ports

ROOT = Path(__file__).resolve().parents[2]
#: Everything gone this soon after one Ctrl-C. The README says two seconds, what
#: normally holds; the bound has the margin of a loaded two-core machine, and still
#: fails a stop that waits for the parts' SIGKILL backstop (devparts.KILL_AFTER).
WITHIN = 5.0
#: The log line of each process's ops listener, its address after it.
_LISTENING = re.compile(r"ops\.listening\s.*address=\S*:(\d+)")


@pytest.fixture
def vhost_url() -> Iterator[str]:
    name = f"jobplane-ctrlc-{uuid.uuid4().hex[:8]}"
    yield services.create_vhost(name)
    services.delete_vhost(name)


def _group(pgid: int) -> list[int]:
    """The running (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def _free(port: int) -> bool:
    """Nothing listens on ``port`` (connections it had may linger in TIME_WAIT)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class Dev:
    process: asyncio.subprocess.Process
    ports: list[int]
    lines: list[str] = field(default_factory=list)

    async def until_line(self, part: str, timeout: float = 120, count: int = 1) -> None:
        """Read the output until ``count`` lines hold ``part``."""
        assert self.process.stdout is not None
        async with asyncio.timeout(timeout):
            while sum(part in line for line in self.lines) < count:
                raw = await self.process.stdout.readline()
                assert raw, "\n".join(self.lines)
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    async def ctrl_c(self) -> float:
        """SIGINT to the whole group; seconds until no process of it is left."""
        pgid = self.process.pid
        before = _group(pgid)
        assert len(before) >= 1
        start = time.monotonic()
        os.killpg(pgid, signal.SIGINT)
        # Keep reading: a full pipe must not be what holds a process up.
        assert self.process.stdout is not None
        reader = asyncio.create_task(self.process.stdout.read())
        try:
            while _group(pgid) and time.monotonic() - start < 30:  # noqa: ASYNC110 - no event says a pid ended
                await asyncio.sleep(0.05)
        finally:
            rest = await asyncio.wait_for(reader, timeout=30)
            self.lines += rest.decode(errors="replace").splitlines()
        return time.monotonic() - start


@asynccontextmanager
async def _dev(command: list[str], env: dict[str, str]) -> AsyncIterator[Dev]:
    ports = list(free_ports(2))
    env = {
        **os.environ,
        "JOBPLANE_LISTEN": f"127.0.0.1:{ports[0]}",
        "JOBPLANE_UI_LISTEN": f"127.0.0.1:{ports[1]}",
        # Any free port, each process its own (a fixed one a neighbour may hold):
        # their ops.listening lines say which.
        "JOBPLANE_METRICS_LISTEN": "127.0.0.1:0",
        # The phases' log lines (server.started, ops.listening).
        "JOBPLANE_LOG_LEVEL": "info",
        **env,
    }
    process = await asyncio.create_subprocess_exec(
        *command,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    dev = Dev(process, ports)
    try:
        yield dev
    finally:
        for pid in _group(process.pid):
            os.kill(pid, signal.SIGKILL)
        await process.wait()


def _jobplane_dev(*args: str) -> list[str]:
    return [sys.executable, "-m", "jobplane", "dev", *args]


async def _assert_all_stopped(dev: Dev) -> None:
    took = await dev.ctrl_c()
    out = "\n".join(dev.lines)
    assert took < WITHIN, f"{took:.1f}s after one Ctrl-C:\n{out}"
    # Exited (a zombie until reaped here): with the status of a stop, not of a crash
    # (killed by the SIGINT itself when it came before the interpreter handles it).
    status = await asyncio.wait_for(dev.process.wait(), timeout=10)
    assert status in (0, 130, -signal.SIGINT), out
    assert "Traceback" not in out, out
    # Its ports (gRPC, dashboard, each process's metrics) are free.
    metrics = [int(m[1]) for line in dev.lines if (m := _LISTENING.search(line))]
    assert metrics, out
    for port in [*dev.ports, *metrics]:
        assert _free(port), f"port {port} still taken:\n{out}"


@pytest.mark.parametrize("processes", ["1", "3"])
async def test_one_ctrl_c_during_the_demo_stops_every_part(
    database_url: str, vhost_url: str, processes: str
) -> None:
    env = {"JOBPLANE_DATABASE_URL": database_url, "JOBPLANE_AMQP_URL": vhost_url}
    command = _jobplane_dev("--demo", "--demo-steps", "400", "--processes", processes)
    async with _dev(command, env) as dev:
        # The demo's handler runs (a worker part holds it), its progress on show.
        await dev.until_line("step 2/400")
        await _assert_all_stopped(dev)


@pytest.mark.parametrize(
    "phase",
    [
        "ops.listening",  # migrated; applying the topology, about to start the parts
        "server.started",  # the parts started; keys, the dashboard
        "jobplane dev is up",  # submitting the demo
    ],
)
async def test_one_ctrl_c_while_starting_stops_every_part(
    database_url: str, vhost_url: str, phase: str
) -> None:
    env = {"JOBPLANE_DATABASE_URL": database_url, "JOBPLANE_AMQP_URL": vhost_url}
    async with _dev(_jobplane_dev("--demo", "--processes", "3"), env) as dev:
        await dev.until_line(phase)
        await _assert_all_stopped(dev)


async def test_one_ctrl_c_while_serving_stops_every_part(database_url: str, vhost_url: str) -> None:
    env = {"JOBPLANE_DATABASE_URL": database_url, "JOBPLANE_AMQP_URL": vhost_url}
    async with _dev(_jobplane_dev("--processes", "3"), env) as dev:
        await dev.until_line("serving; Ctrl-C to stop")
        await _assert_all_stopped(dev)


async def test_one_ctrl_c_while_ingesting_stops_everything_and_the_local_s3_server(
    database_url: str, vhost_url: str, tmp_path: Path
) -> None:
    # As `make dev` runs it: the local S3 server started by scripts/dev-s3.sh for it.
    s3_port = free_port()
    env = {
        "JOBPLANE_DATABASE_URL": database_url,
        "JOBPLANE_AMQP_URL": vhost_url,
        "JOBPLANE_TOPOLOGY": "builtin:dev",
        "JOBPLANE_DEV_S3_PORT": str(s3_port),
        "JOBPLANE_S3_ACCESS_KEY_ID": "dev",
        "JOBPLANE_S3_SECRET_ACCESS_KEY": "dev",
        "JOBPLANE_DATA_DIR": str(tmp_path),
        "VENV": str(Path(sys.executable).parent.parent),
    }
    files = [str(CORPUS / "guide.pdf"), str(CORPUS / "pipelines.md")]
    command = [
        str(ROOT / "scripts" / "dev-s3.sh"),
        *_jobplane_dev("--processes", "3", *(a for f in files for a in ("--ingest", f))),
    ]
    async with _dev(command, env) as dev:
        await dev.until_line("ingesting ")
        await dev.until_line("[parse]")
        assert not _free(s3_port)
        await _assert_all_stopped(dev)
        assert _free(s3_port), "\n".join(dev.lines)


async def test_dev_waits_for_a_broker_that_is_down_and_one_ctrl_c_stops_the_wait(
    database_url: str,
) -> None:
    # Nothing listens on this port: the broker is down, as far as dev can tell.
    down = f"amqp://guest:guest@127.0.0.1:{free_port()}/"
    env = {"JOBPLANE_DATABASE_URL": database_url, "JOBPLANE_AMQP_URL": down}
    async with _dev(_jobplane_dev("--processes", "3"), env) as dev:
        await dev.until_line("broker.unavailable")
        await dev.until_line("broker.unavailable", count=2)  # still waiting, not exited
        await _assert_all_stopped(dev)
        assert "jobplane dev is up" not in "\n".join(dev.lines)
