"""builtin:dev, the topology `make dev` runs: every job type routed, and the ingest
pipeline exactly as builtin:ingest declares it."""

from __future__ import annotations

from pathlib import Path

from jobplane.devparts import part_queues
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
