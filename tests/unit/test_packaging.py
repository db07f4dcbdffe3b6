"""What `pip install jobplane` brings, read from the built wheel; the SDK's imports;
the command's two installs (ADR-0026)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from importlib.metadata import packages_distributions

import pytest
from packaging.utils import canonicalize_name

from jobplane import console
from tests.support.sdk_modules import LOADED_BY_GRPC_WHEN_INSTALLED, SERVER_MODULES
from tests.support.wheel import ROOT, built_wheel, requirements, wheel_metadata

SDK = {"grpcio", "grpcio-status", "protobuf", "googleapis-common-protos", "uuid6"}
SERVER = {
    "grpcio-health-checking",
    "grpcio-reflection",
    "aio-pika",
    "pamqp",
    "sqlalchemy",
    "asyncpg",
    "alembic",
    "structlog",
    "rich",
    "uvloop",
    "aioboto3",
    "prometheus-client",
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-http",
    "jinja2",
    "aiohttp",
}
# Modules the SDK must never load (the contract's list and what they bring).
#: The worker install (ADR-0033): what `jobplane worker` imports, and the
#: extras of what it does only when configured.
WORKER = {"aio-pika", "pamqp", "sqlalchemy", "asyncpg", "structlog", "rich", "uvloop"}
WORKER_EXTRAS = {
    "blobs": {"aioboto3"},
    "metrics": {"prometheus-client", "aiohttp"},
    "otlp": {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"},
}


def test_the_base_install_is_the_sdk_and_the_server_is_an_extra() -> None:
    metadata = wheel_metadata(built_wheel())
    base = {r.name.lower() for r in requirements(metadata)}
    assert base == SDK
    server = {r.name.lower() for r in requirements(metadata, "server")}
    assert server >= SERVER
    assert not base & SERVER
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert {"server", "cli", "tracing", "ingest", "dev"} <= extras
    assert {r.name for r in requirements(metadata, "tracing")} == {"opentelemetry-api"}
    assert "jobplane" in {r.name for r in requirements(metadata, "ingest")}  # jobplane[server]
    for requirement in requirements(metadata):
        assert any(s.operator == ">=" for s in requirement.specifier), requirement
        if requirement.name != "uuid6":
            assert any(s.operator == "<" for s in requirement.specifier), requirement


def test_the_wheel_has_its_license_classifiers_and_urls() -> None:
    wheel = built_wheel()
    metadata = wheel_metadata(wheel)
    assert metadata["License-Expression"] == "Apache-2.0"
    names = zipfile.ZipFile(wheel).namelist()
    license_file = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    assert "Apache License" in zipfile.ZipFile(wheel).read(license_file).decode()
    classifiers = metadata.get_all("Classifier") or []
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers)
    urls = dict(u.split(", ", 1) for u in metadata.get_all("Project-URL") or [])
    assert {"Homepage", "Documentation", "Source"} <= set(urls)
    assert all(url.startswith("https://") for url in urls.values())


def test_the_wheel_carries_the_sql_api_files_and_their_frozen_copies() -> None:
    """jobplane.store.sqlapi reads the live files; migrations read the frozen copies."""
    names = set(zipfile.ZipFile(built_wheel()).namelist())
    live = sorted(ROOT.joinpath("core/jobplane/store/sql").glob("*.sql"))
    frozen = sorted(ROOT.joinpath("migrations/jobplane/migrations/sql").glob("*.sql"))
    assert {"submit_job.sql", "publish_event.sql"} <= {p.name for p in live}
    assert frozen
    expected = {f"jobplane/store/sql/{p.name}" for p in live}
    expected |= {f"jobplane/migrations/sql/{p.name}" for p in frozen}
    expected.add("jobplane/migrations/frozen.py")
    assert expected <= names, sorted(expected - names)


@pytest.mark.parametrize(
    "modules",
    [
        ["jobplane.client"],
        ["jobplane.v1.jobs_pb2_grpc", "jobplane.v1.events_pb2_grpc", "jobplane.v1.blobs_pb2_grpc"],
        ["jobplane.client.cli", "jobplane.contrib.ingest.cli", "jobplane.console"],
    ],
)
def test_the_sdk_imports_no_server_library(modules: list[str]) -> None:
    """In a fresh interpreter of the dev venv, where every server library is installed."""
    program = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    allowed = {"rich"} if "jobplane.client.cli" in modules else set()
    assert loaded & (set(SERVER_MODULES) - LOADED_BY_GRPC_WHEN_INSTALLED) == allowed


def test_the_server_commands_are_the_parsers_others() -> None:
    import argparse

    from jobplane.cli import build_parser
    from jobplane.client.cli import register

    def commands(parser: argparse.ArgumentParser) -> set[str]:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return set(action.choices)

    client = argparse.ArgumentParser()
    register(client.add_subparsers())
    assert commands(build_parser()) - commands(client) == console.SERVER_COMMANDS
    assert not console.missing_server_modules()  # the dev venv has the server install


def test_without_rich_a_client_command_names_the_cli_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib.util import find_spec

    monkeypatch.setattr(
        console, "find_spec", lambda name: None if name == "rich" else find_spec(name)
    )
    assert console.client_main(["get", "jobs/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "pip install 'jobplane[cli]'" in err
    assert console.client_main(["serve"]) == 2
    assert "this command needs the server install: pip install 'jobplane[server]'" in (
        capsys.readouterr().err
    )


def test_the_command_checks_for_every_library_of_the_server_extra() -> None:
    """A library added to the server extra needs its module in console.SERVER_MODULES."""
    owners = packages_distributions()
    checked = {
        canonicalize_name(distribution)
        for module in console.SERVER_MODULES
        for distribution in owners.get(module.split(".")[0], [])
    }
    server = requirements(wheel_metadata(built_wheel()), "server")
    # uvloop: the server runs without it (on Windows it is not installed).
    unchecked = {canonicalize_name(r.name) for r in server} - checked - {"uvloop"}
    assert not unchecked, f"add their modules to jobplane.console.SERVER_MODULES: {unchecked}"


def test_the_worker_install_is_the_worker_and_its_options_are_extras() -> None:
    metadata = wheel_metadata(built_wheel())
    worker = {r.name.lower() for r in requirements(metadata, "worker")}
    assert worker == WORKER | {"opentelemetry-api"}
    # Nothing of the object store, tracing's exporter, metrics, the dashboard or
    # the gRPC server: those are the server's, or an extra of their own.
    assert not worker & (SERVER - WORKER - {"opentelemetry-api"})
    for extra, wanted in WORKER_EXTRAS.items():
        assert {r.name.lower() for r in requirements(metadata, extra)} == wanted, extra
    server = {r.name.lower() for r in requirements(metadata, "server")}
    assert worker | set().union(*WORKER_EXTRAS.values()) <= server


def test_the_command_checks_for_every_library_of_the_worker_extra() -> None:
    """A library added to the worker extra needs its module in console.WORKER_MODULES."""
    owners = packages_distributions()
    checked = {
        canonicalize_name(distribution)
        for module in console.WORKER_MODULES
        for distribution in owners.get(module.split(".")[0], [])
    }
    worker = requirements(wheel_metadata(built_wheel()), "worker")
    unchecked = {canonicalize_name(r.name) for r in worker} - checked - {"uvloop"}
    assert not unchecked, f"add their modules to jobplane.console.WORKER_MODULES: {unchecked}"


def test_the_worker_path_imports_no_optional_library() -> None:
    """In a fresh interpreter of the dev venv, where every library is installed: the
    worker command's modules load none of what an extra of the worker brings."""
    program = (
        "import json, sys\n"
        "import jobplane.cli, jobplane.workers.runtime, jobplane.workers.maintenance\n"
        "import jobplane.observe.metrics\n"
        "jobplane.cli.build_parser()\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    ).stdout
    loaded = set(json.loads(out))
    optional = ("aioboto3", "botocore", "prometheus_client", "aiohttp", "opentelemetry.sdk")
    assert sorted(m for m in loaded if m.startswith(optional)) == []


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (["serve"], "jobplane serve: this command needs the server install: pip install"),
        (["worker"], "jobplane worker: this command needs the worker install: pip install"),
        (["get", "jobs/x"], "the jobplane command needs the command-line install: pip install"),
    ],
)
def test_an_install_missing_is_one_json_line_with_json_logs(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    start: str,
) -> None:
    """The line jobplane.logs.json_line makes, ``command.failed`` with the error."""
    from importlib.util import find_spec

    from jobplane.logs import json_line

    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", "json")
    monkeypatch.setattr(
        console, "find_spec", lambda name: None if name == "rich" else find_spec(name)
    )
    assert console.client_main(argv) == 2
    (line,) = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert line["error"].startswith(start)
    shape = json.loads(json_line("command.failed", "error", error=line["error"]))
    assert {k: v for k, v in line.items() if k != "timestamp"} == {
        k: v for k, v in shape.items() if k != "timestamp"
    }
    assert line["timestamp"].endswith("Z")
