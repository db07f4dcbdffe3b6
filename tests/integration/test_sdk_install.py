"""The SDK alone (``pip install jobplane``) against a real server and worker (ADR-0026).

Its venv (tests/support/sdk_venv.py) holds no server library, and either the
floors of the wheel's own metadata, exactly, or what pip chooses beside
hatchet-sdk (the newest protobuf 6); the dev venv, with the newest versions
(protobuf 7), runs the rest of the suite.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

from jobplane.client import JobState
from jobplane.console import SERVER_COMMANDS, WORKER_COMMANDS
from tests.support.sdk_modules import SERVER_MODULES
from tests.support.sdk_venv import lowest_pins, sdk_python
from tests.support.stack import Stack
from tests.support.wheel import built_wheel

PROGRAM = Path(__file__).parent / "sdk_only" / "program.py"


@pytest.fixture(scope="module")
def beside_hatchet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What pip chooses for the SDK wheel and hatchet-sdk 1.43.1 together (a dry run).

    hatchet-sdk 1.43.1 needs protobuf >= 6.30.2, < 7 and grpcio >= 1.76; with
    the generated code's former floors (protobuf >= 7.35.1) there was no such set.
    """
    report = tmp_path_factory.mktemp("resolution") / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "-q",
            "--report",
            str(report),
            str(built_wheel()),
            "hatchet-sdk==1.43.1",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }


@pytest.fixture(scope="module", params=["lowest", "beside hatchet-sdk"])
def pins(request: pytest.FixtureRequest) -> dict[str, str]:
    """The versions the SDK venv holds: the floors, or what it gets beside hatchet-sdk."""
    lowest = lowest_pins()
    if request.param == "lowest":
        return lowest
    chosen: dict[str, str] = request.getfixturevalue("beside_hatchet")
    # rich (the cli extra) is no part of that resolution: its floor.
    return {name: chosen.get(name, floor) for name, floor in lowest.items()}


@pytest.fixture(scope="module")
def python(pins: dict[str, str]) -> Path:
    return sdk_python(pins)


async def run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *argv,
        env={**os.environ, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=90)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_sdk_alone_runs_a_job(stack: Stack, python: Path, pins: dict[str, str]) -> None:
    assert {"grpcio", "grpcio-status", "protobuf", "googleapis-common-protos"} <= set(pins)
    code, out, err = await run(
        str(python),
        "-W",
        "error",
        str(PROGRAM),
        stack.server.address,
        stack.key,
        json.dumps(SERVER_MODULES),
    )
    assert code == 0, err
    report: dict[str, Any] = json.loads(out)
    installed = {d: v for d, v in report["versions"].items() if d in pins}
    assert installed == {d: v for d, v in pins.items() if d in report["versions"]}
    assert report["imported_before_calls"] == []
    assert report["imported_after_calls"] == []
    seen = report["async"]
    assert seen["succeeded"] is True, seen
    assert seen["result"] == {"from": "the sdk alone"}
    assert seen["events"][-1] == "SUCCEEDED"
    # A typed error, decoded from google.rpc details on the lowest versions.
    assert seen["missing"] == "JOB_NOT_FOUND"
    assert seen["published"] == "sdk.checked"
    assert seen["made_id_version"] == 7
    assert report["sync"] == {"state": "SUCCEEDED", "result": {"from": "the sdk alone"}}
    job = await stack.client().get(seen["name"])
    assert job.state is JobState.SUCCEEDED


async def test_the_command_without_the_server_install(stack: Stack, python: Path) -> None:
    jobplane = str(python.parent / "jobplane")
    env = {"JOBPLANE_ADDRESS": stack.server.address, "JOBPLANE_API_KEY": stack.key}
    for command in sorted(SERVER_COMMANDS - WORKER_COMMANDS):
        code, out, err = await run(jobplane, command, env=env)
        assert code == 2, (command, err)
        assert out == ""
        assert err == (
            f"error: jobplane {command}: this command needs the server install: "
            "pip install 'jobplane[server]'\n"
        )
    code, out, err = await run(jobplane, "worker", env=env)
    assert (code, out) == (2, "")
    assert err == (
        "error: jobplane worker: this command needs the worker install: "
        "pip install 'jobplane[worker]' (or the server install: pip install 'jobplane[server]')\n"
    )
    # A client command runs, with the cli extra's rich and no server library.
    code, out, err = await run(
        jobplane, "submit", "demo.echo", "--payload", '{"n": 1}', "--watch", "--json", env=env
    )
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    name = lines[0]["name"]
    assert lines[-1]["state"] == "succeeded", lines[-1]
    code, out, err = await run(jobplane, "get", name, "--json", env=env)
    assert code == 0, err
    assert json.loads(out)["result"] == {"n": 1}
    code, out, _err = await run(jobplane, "--version")
    assert (code, out.split()[0]) == (0, "jobplane")


def test_the_sdk_resolves_beside_hatchet_sdk(beside_hatchet: dict[str, str]) -> None:
    assert beside_hatchet["jobplane"] == version("jobplane")
    assert beside_hatchet["hatchet-sdk"] == "1.43.1"
    assert beside_hatchet["protobuf"].split(".")[0] == "6", beside_hatchet["protobuf"]
