"""What `make dev` runs: builtin:dev (every job type routed, the ingest pipeline
exactly as builtin:ingest declares it), and the commands it prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jobplane.server.dev import _jobplane_command
from jobplane.server.devparts import part_queues
from jobplane.topology import load_topology


def test_every_type_is_routed_to_the_one_queue() -> None:
    dev = load_topology(Path("builtin:dev"))
    for job_type in ("reports.render", "a", "demo.progress", "maintenance.retention"):
        route = dev.route(job_type)
        assert route is not None and route.name == "jobplane.default", job_type
    # Later dev parts consume it too (they hand the ingest stages back to part 0).
    assert part_queues(dev) == ["jobplane.default"]


def test_the_ingest_pipeline_is_builtin_ingests() -> None:
    dev = load_topology(Path("builtin:dev")).pipeline("ingest.file")
    ingest = load_topology(Path("builtin:ingest")).pipeline("ingest.file")
    assert dev is not None and ingest is not None
    assert dev.version == ingest.version
    keep = ("name", "type", "version", "weight", "max_attempts", "timeout_seconds")
    assert [tuple(getattr(s, k) for k in keep) for s in dev.stages] == [
        tuple(getattr(s, k) for k in keep) for s in ingest.stages
    ]


def test_dev_prints_the_path_of_a_jobplane_a_new_shell_would_not_find(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "jobplane").write_text("")
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    assert _jobplane_command() == ".venv/bin/jobplane"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert _jobplane_command() == str(bin_dir / "jobplane")
