"""Reading a topology: its TOML file (or a built-in one), parsed and checked."""

from __future__ import annotations

import re
import tomllib
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from jobplane.config import check_log_prefix
from jobplane.names import is_job_type
from jobplane.topics import EVENTS_EXCHANGE, LIFECYCLE_EVENT_TYPES, topic_matches
from jobplane.topology.limits import parse_rate_limits, queue_running_limit
from jobplane.topology.model import (
    PipelineSpec,
    QueueSpec,
    StageSpec,
    Topology,
    TopologyError,
)

#: A queue's ``priority``, highest first (what it means: jobplane.workers.priority).
PRIORITIES = ("high", "normal", "low")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,200}$")
_PATTERN = re.compile(r"^(\*|#|[a-z0-9_-]+)(\.(\*|#|[a-z0-9_-]+))*$")


def parse_topology(data: dict[str, Any], *, source: str = "topology") -> Topology:
    """Build and check a :class:`Topology` from parsed TOML."""
    quorum_group_size = _quorum_group_size(data, source)
    publish_lifecycle = _publish_lifecycle(data, source)
    try:
        exchange = str(data.get("exchange", {}).get("name", "jobplane.jobs"))
        dead = data.get("dead_letter", {})
        events = data.get("events", {})
        queues = tuple(
            QueueSpec(
                name=str(q["name"]),
                bindings=tuple(str(b) for b in q.get("bindings", ["#"])),
                delivery_limit=int(q.get("delivery_limit", 5)),
                max_attempts=int(q.get("max_attempts", 3)),
                priority=str(q.get("priority", "normal")),
                timeout_seconds=float(q.get("timeout_seconds", 3600.0)),
                retry_base_delay=float(q.get("retry_base_delay", 1.0)),
                retry_max_delay=float(q.get("retry_max_delay", 300.0)),
                log_prefix=check_log_prefix(str(q.get("log_prefix", "")), "log_prefix"),
                max_running_per_tenant=queue_running_limit(q, source),
            )
            for q in data.get("queues", [])
        )
        topology = Topology(
            exchange=exchange,
            dead_letter_exchange=str(dead.get("exchange", f"{exchange}.dlx")),
            failed_queue=str(dead.get("queue", "jobplane.failed")),
            queues=queues,
            events_exchange=str(events.get("exchange", EVENTS_EXCHANGE)),
            publish_lifecycle=publish_lifecycle,
            quorum_group_size=quorum_group_size,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TopologyError(f"{source}: {exc}") from exc
    _check(topology, source)
    pipelines = tuple(
        _parse_pipeline(p, topology, source) for p in _tables(data, "pipelines", source)
    )
    _check_pipelines(topology, pipelines, source)
    return replace(topology, pipelines=pipelines, rate_limits=parse_rate_limits(data, source))


#: The most members a quorum queue's initial group may ask for (RabbitMQ caps it
#: at the cluster's nodes anyway).
MAX_QUORUM_GROUP_SIZE = 99


def _quorum_group_size(data: dict[str, Any], source: str) -> int | None:
    """``[quorum] initial_group_size``: None when unset (the broker's default)."""
    table = data.get("quorum", {})
    if not isinstance(table, dict):
        raise TopologyError(f"{source}: [quorum] must be a table")
    unknown = set(table) - {"initial_group_size"}
    if unknown:
        raise TopologyError(f"{source}: [quorum] has unknown keys {sorted(unknown)}")
    size = table.get("initial_group_size")
    if size is None:
        return None
    if type(size) is not int or not 1 <= size <= MAX_QUORUM_GROUP_SIZE:
        raise TopologyError(
            f"{source}: [quorum] initial_group_size must be a whole number from 1 to "
            f"{MAX_QUORUM_GROUP_SIZE}, not {size!r}"
        )
    return size


_EVENTS_KEYS = frozenset({"exchange", "publish_lifecycle"})
#: Patterns of ``publish_lifecycle`` at most (there are eight lifecycle types).
MAX_LIFECYCLE_PATTERNS = 32


def _publish_lifecycle(data: dict[str, Any], source: str) -> tuple[str, ...]:
    """``[events] publish_lifecycle``: topic patterns, each matching a lifecycle
    event type; none when unset."""
    table = data.get("events", {})
    if not isinstance(table, dict):
        raise TopologyError(f"{source}: [events] must be a table")
    unknown = set(table) - _EVENTS_KEYS
    if unknown:
        raise TopologyError(f"{source}: [events] has unknown keys {sorted(unknown)}")
    patterns = table.get("publish_lifecycle", [])
    key = f"{source}: [events] publish_lifecycle"
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise TopologyError(f'{key} must be a list of topic patterns, e.g. ["job.failed"]')
    if len(patterns) > MAX_LIFECYCLE_PATTERNS:
        raise TopologyError(f"{key} has {len(patterns)} patterns, at most {MAX_LIFECYCLE_PATTERNS}")
    for pattern in patterns:
        if not _PATTERN.match(pattern):
            raise TopologyError(f"{key}: {pattern!r} is not a topic pattern")
        if not any(topic_matches(pattern, t) for t in LIFECYCLE_EVENT_TYPES):
            raise TopologyError(
                f"{key}: {pattern!r} matches no lifecycle event type "
                f"({', '.join(LIFECYCLE_EVENT_TYPES)})"
            )
    return tuple(dict.fromkeys(patterns))


_STAGE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,63}")
_STAGE_KEYS = frozenset(
    {"name", "type", "version", "max_attempts", "timeout_seconds", "weight"}
    | {"fan_out", "max_failures", "fail_fast"}
)
#: Children a fan-out stage may tolerate failing, at most (ADR-0047).
MAX_FAN_FAILURES = 10_000
_PIPELINE_KEYS = frozenset({"name", "version", "stages"})
#: Stages of one pipeline at most: each is a row written with the job.
MAX_STAGES = 32


def _tables(data: dict[str, Any], key: str, source: str) -> list[dict[str, Any]]:
    found = data.get(key, [])
    if not isinstance(found, list) or not all(isinstance(t, dict) for t in found):
        raise TopologyError(f"{source}: [[{key}]] must be an array of tables")
    return found


def _parse_pipeline(data: dict[str, Any], topology: Topology, source: str) -> PipelineSpec:
    name = data.get("name")
    if not isinstance(name, str) or not is_job_type(name):
        raise TopologyError(f"{source}: pipeline name {name!r} is not a valid job type")
    where = f"{source}: pipeline {name!r}"
    unknown = set(data) - _PIPELINE_KEYS
    if unknown:
        raise TopologyError(f"{where}: unknown keys {sorted(unknown)}")
    version = _version(data.get("version", ""), where)
    tables = _tables(data, "stages", where)
    if not tables:
        raise TopologyError(f"{where}: needs at least one [[pipelines.stages]]")
    if len(tables) > MAX_STAGES:
        raise TopologyError(f"{where}: has {len(tables)} stages, at most {MAX_STAGES}")
    stages = []
    for table in tables:
        unknown = set(table) - _STAGE_KEYS
        if unknown:
            raise TopologyError(f"{where}: stage with unknown keys {sorted(unknown)}")
        stage_name = table.get("name")
        if not isinstance(stage_name, str) or not _STAGE_NAME.fullmatch(stage_name):
            raise TopologyError(
                f"{where}: stage name {stage_name!r} must be a lowercase word "
                "(letters, digits, '_', '-'; at most 63)"
            )
        at = f"{where}: stage {stage_name!r}"
        job_type = table.get("type")
        if not isinstance(job_type, str) or not is_job_type(job_type):
            raise TopologyError(f"{at}: type {job_type!r} is not a valid job type")
        queue = topology.route(job_type)
        if queue is None:
            raise TopologyError(f"{at}: no queue takes its type {job_type!r}")
        try:
            max_attempts = int(table.get("max_attempts", queue.max_attempts))
            timeout = float(table.get("timeout_seconds", queue.timeout_seconds))
            weight = float(table.get("weight", 1.0))
        except (TypeError, ValueError) as exc:
            raise TopologyError(f"{at}: {exc}") from exc
        if not 1 <= max_attempts <= 1000:
            raise TopologyError(f"{at}: max_attempts must be 1..1000")
        if not 0.001 <= timeout <= 7 * 86400:
            raise TopologyError(f"{at}: timeout_seconds must be between 0.001 and 604800")
        if not 0 < weight <= 1e6:
            raise TopologyError(f"{at}: weight must be > 0 and at most 1e6")
        stages.append(
            StageSpec(
                name=stage_name,
                type=job_type,
                queue=queue.name,
                max_attempts=max_attempts,
                timeout_seconds=timeout,
                version=_version(table.get("version", ""), at),
                weight=weight,
                **_fan_out(table, at),
            )
        )
    _check_fan_outs(stages, where)
    return PipelineSpec(name=name, stages=tuple(stages), version=version)


def _fan_out(table: dict[str, Any], at: str) -> dict[str, Any]:
    """A stage's ``fan_out``, ``max_failures`` and ``fail_fast``, checked."""
    fan_out = table.get("fan_out", False)
    fail_fast = table.get("fail_fast", False)
    max_failures = table.get("max_failures", 0)
    for key, value in (("fan_out", fan_out), ("fail_fast", fail_fast)):
        if not isinstance(value, bool):
            raise TopologyError(f"{at}: {key} must be true or false")
    if isinstance(max_failures, bool) or not isinstance(max_failures, int):
        raise TopologyError(f"{at}: max_failures must be a whole number")
    if not 0 <= max_failures <= MAX_FAN_FAILURES:
        raise TopologyError(f"{at}: max_failures must be 0..{MAX_FAN_FAILURES}")
    if not fan_out and ("max_failures" in table or "fail_fast" in table):
        raise TopologyError(f"{at}: max_failures and fail_fast need fan_out = true")
    return {"fan_out": fan_out, "max_failures": max_failures, "fail_fast": fail_fast}


def _check_fan_outs(stages: list[StageSpec], where: str) -> None:
    """A fan-out stage maps the list the stage before returns, and the stage
    after joins it: it is neither first nor last, nor next to another."""
    for index, stage in enumerate(stages):
        if not stage.fan_out:
            continue
        at = f"{where}: fan-out stage {stage.name!r}"
        if index == 0:
            raise TopologyError(f"{at} is first: a stage before it must return its items")
        if index == len(stages) - 1:
            raise TopologyError(f"{at} is last: a stage after it must join its results")
        if stages[index - 1].fan_out or stages[index + 1].fan_out:
            raise TopologyError(
                f"{at} is next to another fan-out stage: a plain stage must return "
                "the items and join the results"
            )


def _version(value: Any, where: str) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or (value and not _VERSION.fullmatch(value)):
        raise TopologyError(
            f"{where}: version {value!r} must be up to 64 letters, digits and '._:+-'"
        )
    return value


def _check_pipelines(topology: Topology, pipelines: tuple[PipelineSpec, ...], source: str) -> None:
    names = [p.name for p in pipelines]
    if len(set(names)) != len(names):
        raise TopologyError(f"{source}: pipeline names must be unique")
    stage_types = {s.type for p in pipelines for s in p.stages}
    for pipeline in pipelines:
        if pipeline.name in stage_types:
            # A stage's dispatch would be taken for a new pipeline job's.
            raise TopologyError(f"{source}: pipeline {pipeline.name!r} is also the type of a stage")
        stage_names = [s.name for s in pipeline.stages]
        if len(set(stage_names)) != len(stage_names):
            raise TopologyError(f"{source}: pipeline {pipeline.name!r} has two stages of one name")


def _check(topology: Topology, source: str) -> None:
    if not topology.queues:
        raise TopologyError(f"{source}: at least one queue is required")
    names = [topology.exchange, topology.dead_letter_exchange, topology.failed_queue]
    names += [topology.events_exchange]
    names += [q.name for q in topology.queues]
    for name in names:
        if not _NAME.match(name):
            raise TopologyError(f"{source}: {name!r} is not a valid exchange or queue name")
    if topology.events_exchange in (topology.exchange, topology.dead_letter_exchange):
        # An event would reach the job queues bound with `#`, as a job.
        raise TopologyError(f"{source}: the events exchange must be an exchange of its own")
    if len({q.name for q in topology.queues}) != len(topology.queues):
        raise TopologyError(f"{source}: queue names must be unique")
    for queue in topology.queues:
        if not queue.bindings:
            raise TopologyError(f"{source}: queue {queue.name!r} has no bindings")
        for pattern in queue.bindings:
            if not _PATTERN.match(pattern):
                raise TopologyError(f"{source}: binding {pattern!r} is not a topic pattern")
        if queue.priority not in PRIORITIES:
            raise TopologyError(
                f"{source}: queue {queue.name!r} has priority {queue.priority!r}; "
                f"allowed: {', '.join(PRIORITIES)}"
            )
        if queue.max_attempts < 1 or queue.delivery_limit < 1:
            raise TopologyError(
                f"{source}: queue {queue.name!r} needs max_attempts and delivery_limit >= 1"
            )
        if queue.timeout_seconds <= 0 or queue.retry_base_delay < 0:
            raise TopologyError(f"{source}: queue {queue.name!r} needs timeout_seconds > 0")
        if queue.retry_max_delay < queue.retry_base_delay:
            raise TopologyError(
                f"{source}: queue {queue.name!r} has retry_max_delay < retry_base_delay"
            )


#: ``JOBPLANE_TOPOLOGY=builtin:NAME`` loads ``jobplane/topologies/NAME.toml``.
BUILTIN = "builtin:"


def load_topology(path: Path | None = None) -> Topology:
    """Load ``path``, or the packaged default topology when None.

    ``builtin:NAME`` is a topology shipped with jobplane (``default``, ``ingest``).
    """
    if path is not None and str(path).startswith(BUILTIN):
        name = str(path)[len(BUILTIN) :]
        shipped = resources.files("jobplane").joinpath("topologies")
        known = sorted(f.name[:-5] for f in shipped.iterdir() if f.name.endswith(".toml"))
        if name not in known:
            raise TopologyError(f"no built-in topology {name!r}; jobplane ships {', '.join(known)}")
        text = shipped.joinpath(f"{name}.toml").read_text()
        source = f"built-in topology {name}"
    elif path is None:
        text = resources.files("jobplane").joinpath("topologies/default.toml").read_text()
        source = "default topology"
    else:
        try:
            text = path.read_text()
        except OSError as exc:
            raise TopologyError(f"cannot read topology {path}: {exc}") from exc
        source = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{source}: {exc}") from exc
    return parse_topology(data, source=source)
