"""compose.yaml cannot be run here (no container engine): check what can be checked
without one — its references, its health conditions, and that every jobplane
process in it would start with its settings and command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from jobplane.cli import build_parser
from jobplane.config import Settings, parse_listen
from jobplane.process import METRICS_DEFAULTS
from jobplane.topology import load_topology

COMPOSE = Path(__file__).parents[2] / "compose.yaml"


def _services() -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, dict[str, Any]] = data["services"]
    return services


def _jobplane() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in _services().items() if s.get("image") == "jobplane:dev"}


def test_every_dependency_exists_and_healthy_ones_have_a_check() -> None:
    services = _services()
    for name, service in services.items():
        for target, condition in (service.get("depends_on") or {}).items():
            assert target in services, f"{name} depends on unknown service {target}"
            assert target != name, f"{name} depends on itself"
            if condition.get("condition") == "service_healthy":
                assert "healthcheck" in services[target], f"{target} has no healthcheck"


def test_the_object_store_and_the_index_are_there() -> None:
    services = _services()
    assert services["minio"]["image"].startswith("minio/minio")
    assert services["qdrant"]["image"].startswith("qdrant/qdrant")
    for name, service in _jobplane().items():
        if name == "migrate":  # the database only
            continue
        env = service["environment"]
        assert env["JOBPLANE_S3_URL"] == "http://minio:9000", name
        assert env["JOBPLANE_QDRANT_URL"] == "http://qdrant:6333", name


@pytest.mark.parametrize("name", sorted(_jobplane()))
def test_each_jobplane_process_takes_its_settings_and_command(name: str) -> None:
    service = _jobplane()[name]
    env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
    settings = Settings.from_env(env)  # raises ConfigError on a bad value
    if name != "migrate":
        assert settings.blobs_enabled, name
        topology = load_topology(settings.topology_path)
        assert topology.pipeline("ingest.file") is not None
    args = build_parser().parse_args([str(a) for a in service["command"]])
    assert callable(args.func), name


@pytest.mark.parametrize("name", ["server", "relay", "worker", "ingest-worker"])
def test_each_long_running_process_is_checked_by_its_readyz(name: str) -> None:
    service = _jobplane()[name]
    args = build_parser().parse_args([str(a) for a in service["command"]])
    listen = parse_listen(args.metrics_listen or METRICS_DEFAULTS[args.command])
    assert listen is not None, name
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], name  # the image has no curl
    assert f"http://127.0.0.1:{listen.port}/readyz" in test[3], name
    compile(test[3], f"{name} healthcheck", "exec")  # the one-liner is Python
    assert listen.host == "0.0.0.0", name  # reachable from a Prometheus beside it


def test_the_server_serves_the_dashboard_on_a_published_port() -> None:
    service = _jobplane()["server"]
    args = build_parser().parse_args([str(a) for a in service["command"]])
    listen = parse_listen(args.ui_listen)
    assert listen is not None and listen.host == "0.0.0.0"
    assert f"127.0.0.1:{listen.port}:{listen.port}" in service["ports"]
