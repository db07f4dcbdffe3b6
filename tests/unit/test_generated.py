"""Generated stubs match proto/, and the wheel carries what `pip install .` needs."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

from tests.support.wheel import built_wheel

ROOT = Path(__file__).resolve().parents[2]


def _protogen() -> object:
    spec = importlib.util.spec_from_file_location("protogen", ROOT / "scripts" / "protogen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_stubs_are_not_stale(tmp_path: Path) -> None:
    fresh = _protogen().generate(tmp_path)  # type: ignore[attr-defined]
    committed = ROOT / "core" / "jobplane" / "v1"
    assert sorted(p.name for p in fresh) == sorted(
        p.name for p in committed.iterdir() if p.is_file()
    )
    stale = [p.name for p in fresh if p.read_bytes() != (committed / p.name).read_bytes()]
    assert not stale, f"run `make proto`: {stale} differ from proto/"


def test_wheel_has_stubs_types_migrations_and_topology() -> None:
    wheel = built_wheel()
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "jobplane/v1/jobs_pb2.py",
        "jobplane/v1/jobs_pb2.pyi",
        "jobplane/v1/jobs_pb2_grpc.pyi",
        "jobplane/v1/events_pb2.py",
        "jobplane/v1/events_pb2_grpc.pyi",
        "jobplane/py.typed",
        "jobplane/server/app.py",
        "jobplane/workers/runtime.py",
        "jobplane/client/__init__.py",
        "jobplane/migrations/env.py",
        "jobplane/migrations/versions/0001_core.py",
        "jobplane/topologies/default.toml",
        "jobplane/topologies/ingest.toml",
        "jobplane/contrib/ingest/handlers.py",
    ):
        assert required in names, f"{required} missing from the wheel"
