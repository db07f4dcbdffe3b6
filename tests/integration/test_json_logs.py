"""With JOBPLANE_LOG_FORMAT=json, every line a long-running command writes is one
JSON object: its start-up lines ("serving on", "dashboard on", dev's banner)
are events with names and fields, not text beside the log."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from jobplane.topology import Topology
from tests.faults.cluster import ROOT, topology_toml

# Each command, its arguments, and the event that says it is up.
COMMANDS = [
    pytest.param(["serve"], "ui.listening", id="serve"),
    pytest.param(["relay"], "relay.connected", id="relay"),
    pytest.param(["worker", "--no-maintenance"], "worker.started", id="worker"),
    pytest.param(["sweep", "--interval", "0.2"], "sweep.done", id="sweep"),
    pytest.param(["ui"], "ui.listening", id="ui"),
    pytest.param(["dev", "--no-maintenance", "--processes", "3"], "dev.serving", id="dev"),
]


def _env(database_url: str, amqp_url: str, topology: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join((str(ROOT / "core"), str(ROOT))),
        "JOBPLANE_DATABASE_URL": database_url,
        "JOBPLANE_AMQP_URL": amqp_url,
        "JOBPLANE_TOPOLOGY": str(topology),
        "JOBPLANE_LISTEN": "127.0.0.1:0",
        "JOBPLANE_METRICS_LISTEN": "127.0.0.1:0",
        "JOBPLANE_UI_LISTEN": "127.0.0.1:0",
        "JOBPLANE_LOG_FORMAT": "json",
        "JOBPLANE_LOG_LEVEL": "info",
    }


async def _lines_until(
    args: list[str], env: dict[str, str], ready: str, stop: int = signal.SIGTERM
) -> tuple[list[str], int]:
    """Run ``jobplane *args`` until it logs ``ready``, then stop it with ``stop``;
    everything it wrote on stdout and stderr, and its exit status."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env=env,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    lines: list[str] = []
    try:
        try:
            async with asyncio.timeout(90):
                async for raw in process.stdout:
                    lines.append(raw.decode(errors="replace").rstrip("\n"))
                    if f'"event": "{ready}"' in lines[-1]:
                        break
                else:
                    raise AssertionError(f"{args[0]} exited before {ready}: {lines}")
        except TimeoutError:
            raise AssertionError(f"{args[0]}: no {ready} within 90 s: {lines}") from None
        async with asyncio.timeout(60):
            # Let it settle first, so its stop (and the lines that say so) is seen too.
            await asyncio.sleep(0.5)
            process.send_signal(stop)
            lines += [raw.decode(errors="replace").rstrip("\n") async for raw in process.stdout]
            return lines, await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def _objects(lines: list[str]) -> list[dict[str, Any]]:
    """Every non-empty line as the JSON object it must be."""
    found = []
    for line in lines:
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(value, dict), line
        found.append(value)
    return found


@pytest.mark.parametrize(("args", "ready"), COMMANDS)
async def test_a_command_in_json_mode_writes_only_json_lines(
    args: list[str],
    ready: str,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    tmp_path: Path,
) -> None:
    path = tmp_path / "topology.toml"
    path.write_text(topology_toml(topology))
    lines, status = await _lines_until(args, _env(database_url, amqp_url, path), ready)
    records = _objects(lines)
    # sweep has no handler for SIGTERM, and the others may take it before theirs
    # are installed (their start-up lines come first): the lines are what counts.
    assert status in (0, -signal.SIGTERM), lines
    events = [r["event"] for r in records]
    assert ready in events
    # What the text lines said, their log events say: where it serves, and how.
    if args[0] == "serve":
        (started,) = [r for r in records if r["event"] == "server.started"]
        assert started["address"].startswith("127.0.0.1:")
        assert started["transport"] == "plaintext"
    if args[0] in ("serve", "ui"):
        (dashboard,) = [r for r in records if r["event"] == "ui.listening"]
        assert dashboard["url"].startswith("http://127.0.0.1:")
    if args[0] == "sweep":
        done = next(r for r in records if r["event"] == "sweep.done")
        assert done["requeued"] == 0 and done["published"] >= 0
    if args[0] == "dev":
        (up,) = [r for r in records if r["event"] == "dev.ready"]
        assert up["api_key"].startswith("jp_") and up["address"].startswith("127.0.0.1:")
        assert len(up["processes"]) == 3  # this one, a worker part and the relay's


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["serve"], {"JOBPLANE_DB_POOL_SIZE": "none"}, "JOBPLANE_DB_POOL_SIZE"),
        (["worker", "--handlers", "tests.no_such_module:registry"], {}, "no_such_module"),
        (["ui"], {"JOBPLANE_UI_LISTEN": "off"}, "give --listen"),
    ],
    ids=["setting", "handlers", "ui-off"],
)
async def test_a_command_that_cannot_start_says_why_in_one_json_line(
    args: list[str],
    env: dict[str, str],
    says: str,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    tmp_path: Path,
) -> None:
    path = tmp_path / "topology.toml"
    path.write_text(topology_toml(topology))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env={**_env(database_url, amqp_url, path), **env},
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    (line,) = _objects(out.decode().splitlines())
    assert line["event"] == "command.failed" and line["level"] == "error"
    assert says in line["error"]
