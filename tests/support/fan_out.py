"""A topology with fan-out pipelines (ADR-0047), for the tests of fan-out and join."""

from __future__ import annotations

import tomllib

from jobplane.topology import Topology, parse_topology

_TOML = """
[exchange]
name = "jobplane.jobs"

[events]
exchange = "jobplane.events"

[dead_letter]
exchange = "jobplane.jobs.dlx"
queue = "jobplane.failed"

[[queues]]
name = "jobplane.default"
bindings = ["#"]
delivery_limit = 5
max_attempts = 3
timeout_seconds = 60
retry_base_delay = 0.05
retry_max_delay = 0.1

[[pipelines]]
name = "docs.ingest"
[[pipelines.stages]]
name = "split"
type = "docs.split"
[[pipelines.stages]]
name = "embed"
type = "docs.embed"
fan_out = true
max_attempts = 1
weight = 2
[[pipelines.stages]]
name = "index"
type = "docs.index"

[[pipelines]]
name = "docs.tolerant"
[[pipelines.stages]]
name = "split"
type = "docs.split"
[[pipelines.stages]]
name = "embed"
type = "docs.embed"
fan_out = true
max_attempts = 1
max_failures = 1
[[pipelines.stages]]
name = "index"
type = "docs.index"

[[pipelines]]
name = "docs.strict"
[[pipelines.stages]]
name = "split"
type = "docs.split"
[[pipelines.stages]]
name = "embed"
type = "docs.embed"
fan_out = true
max_attempts = 1
fail_fast = true
[[pipelines.stages]]
name = "index"
type = "docs.index"
"""


def fan_topology(prefix: str) -> Topology:
    """The fan-out pipelines ``docs.ingest`` (all must succeed), ``docs.tolerant``
    (one failure tolerated) and ``docs.strict`` (fail fast), under ``prefix``."""
    return parse_topology(tomllib.loads(_TOML), source="fan-out test topology").prefixed(prefix)
