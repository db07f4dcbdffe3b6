"""The worker install alone (``pip install 'jobplane[worker]'``) runs jobs (ADR-0033).

Its venv (tests/support/worker_venv.py) holds what pip installs for the
wheel's worker extra and nothing else: no object-store, tracing-export,
metrics, dashboard or gRPC-server library. ``jobplane worker`` from it takes
jobs of the test's server to SUCCEEDED; each extra a setting needs is named in
one line when the setting is there and the extra is not.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jobplane.client import JobState
from tests.faults.cluster import topology_toml
from tests.support.stack import Stack
from tests.support.wheel import built_wheel
from tests.support.worker_venv import worker_python

pytestmark = pytest.mark.stack(worker=False)

HANDLERS = Path(__file__).parent / "worker_only"
#: Distributions the worker install must not bring: the object store's
#: (boto3's family), tracing's exporter, metrics, the dashboard, the gRPC server's.
NOT_INSTALLED = {
    "aioboto3",
    "aiobotocore",
    "boto3",
    "botocore",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-http",
    "prometheus-client",
    "aiohttp",
    "jinja2",
    "alembic",
    "grpcio-health-checking",
    "grpcio-reflection",
}
#: Their modules, which the worker's process must not load either.
NOT_LOADED = {
    "aioboto3",
    "aiobotocore",
    "boto3",
    "botocore",
    "prometheus_client",
    "aiohttp",
    "jinja2",
    "alembic",
    "grpc_health",
    "grpc_reflection",
}


@pytest.fixture(scope="module", params=["newest", "lowest"])
def python(request: pytest.FixtureRequest) -> Path:
    """The worker install on what pip chooses for it, and on the floors of its ranges."""
    return worker_python(lowest=request.param == "lowest")


def installed(python: Path) -> dict[str, str]:
    """Distribution (normalised name) -> version, as the venv's own pip lists them."""
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)}


def worker_env(stack: Stack, tmp_path: Path, **extra: str) -> dict[str, str]:
    topology = tmp_path / "topology.toml"
    topology.write_text(topology_toml(stack.topology))
    # Nothing of the dev venv or of this tree on the path: the venv's own install;
    # and none of the suite's settings (its JOBPLANE_METRICS_LISTEN among them).
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith(("JOBPLANE_", "OTEL_"))
    }
    return {
        **env,
        "JOBPLANE_DATABASE_URL": stack.database_url,
        "JOBPLANE_AMQP_URL": stack.amqp_url,
        "JOBPLANE_TOPOLOGY": str(topology),
        "JOBPLANE_LOG_LEVEL": "warning",
        **extra,
    }


def test_the_worker_install_holds_no_server_library(python: Path) -> None:
    distributions = installed(python)
    assert "jobplane" in distributions
    assert {"aio-pika", "sqlalchemy", "asyncpg", "structlog"} <= set(distributions)
    assert NOT_INSTALLED & set(distributions) == set()


def test_jobplane_testing_imports_on_the_worker_install(python: Path, tmp_path: Path) -> None:
    # A handler's unit tests run where its worker does: no object store driver there.
    program = (
        "import json, sys\n"
        "import jobplane.testing\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(python), "-c", program],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert set(json.loads(done.stdout)) & NOT_LOADED == set()


async def test_jobplane_worker_from_the_worker_install_runs_jobs(
    stack: Stack, python: Path, tmp_path: Path
) -> None:
    process = await asyncio.create_subprocess_exec(
        str(python.parent / "jobplane"),
        "worker",
        "--handlers",
        "leanjobs:registry",
        cwd=HANDLERS,
        env=worker_env(stack, tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    client = stack.client()
    job = await client.submit("lean.modules", {"n": 7})
    try:
        done = await asyncio.wait_for(client.wait(job.name), 90)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        _out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result is not None and done.result["n"] == 7
    loaded = set(done.result["modules"])
    assert {"jobplane", "aio_pika", "sqlalchemy", "asyncpg"} <= loaded
    assert loaded & NOT_LOADED == set()
    assert done.result["otel_sdk"] is False
    # No ops listener without the metrics extra when none is asked for: said once.
    assert err.decode().count("ops.listener.off") == 1, err.decode()


@pytest.mark.parametrize(
    ("setting", "extra"),
    [
        ({"JOBPLANE_S3_URL": "http://127.0.0.1:9/blobs"}, "blobs"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "otlp"),
        ({"JOBPLANE_METRICS_LISTEN": "127.0.0.1:0"}, "metrics"),
    ],
)
async def test_a_setting_whose_extra_is_missing_is_one_line(
    stack: Stack, python: Path, tmp_path: Path, setting: dict[str, str], extra: str
) -> None:
    env = worker_env(stack, tmp_path, **setting)
    process = await asyncio.create_subprocess_exec(
        str(python.parent / "jobplane"),
        "worker",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    lines = [line for line in err.decode().splitlines() if line.startswith("error:")]
    assert process.returncode == 2, err.decode()
    assert out == b""
    assert len(lines) == 1, err.decode()
    assert lines[0].endswith(f"pip install 'jobplane[{extra}]'"), lines[0]
    assert "Traceback" not in err.decode()


async def test_other_server_commands_name_the_server_install(python: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        str(python.parent / "jobplane"),
        "serve",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    assert err.decode() == (
        "error: jobplane serve: this command needs the server install: "
        "pip install 'jobplane[server]'\n"
    )


def test_the_worker_install_resolves_beside_a_new_boto3(tmp_path: Path) -> None:
    """boto3 1.41 and later need a botocore newer than aioboto3 15.5 allows: beside
    the server install pip finds no solution; beside the worker install it does."""
    report = tmp_path / "report.json"
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
            f"{built_wheel()}[worker]",
            "boto3>=1.41",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    chosen = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "aioboto3" not in chosen
    major, minor = (int(p) for p in chosen["botocore"].split(".")[:2])
    assert (major, minor) >= (1, 41), chosen["botocore"]
