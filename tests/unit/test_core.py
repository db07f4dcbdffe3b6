"""Pure parts: names, job types, topic routing, topology files, envelopes, config."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from jobplane.config import ConfigError, Settings
from jobplane.envelope import Envelope, EnvelopeError
from jobplane.errors import InvalidArgument
from jobplane.ids import new_id
from jobplane.names import job_name, parse_job_name, validate_job_type
from jobplane.topics import topic_matches
from jobplane.topology import TopologyError, load_topology, parse_topology
from jobplane.workers.demo import registry as demo_registry

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topologies"


def test_job_names_round_trip() -> None:
    job_id = uuid.uuid4()
    assert parse_job_name(job_name(job_id)) == job_id


@pytest.mark.parametrize(
    "name", ["", "jobs/", "jobs/x", "job/" + str(uuid.UUID(int=1)), "jobs/" + "0" * 32]
)
def test_malformed_names(name: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_job_name(name)
    assert info.value.field == "name"


@pytest.mark.parametrize("job_type", ["a", "demo.echo", "ai.interactive.chat-v2", "x_1.y-2"])
def test_valid_job_types(job_type: str) -> None:
    assert validate_job_type(job_type) == job_type


@pytest.mark.parametrize("job_type", ["", "A", "a.", ".a", "a..b", "a b", "a/b", "-a", "x" * 129])
def test_invalid_job_types(job_type: str) -> None:
    with pytest.raises(InvalidArgument):
        validate_job_type(job_type)


@pytest.mark.parametrize(
    ("pattern", "key", "matches"),
    [
        ("#", "anything.at.all", True),
        ("#", "one", True),
        ("demo.*", "demo.echo", True),
        ("demo.*", "demo.echo.more", False),
        ("demo.#", "demo", True),
        ("demo.#", "demo.a.b", True),
        ("*.index", "music.index", True),
        ("*.index", "index", False),
        ("ai.*.chat", "ai.fast.chat", True),
        ("a.#.z", "a.z", True),
        ("a.#.z", "a.b.c.z", True),
        ("a.#.z", "a.b.c", False),
    ],
)
def test_topic_matching(pattern: str, key: str, matches: bool) -> None:
    assert topic_matches(pattern, key) is matches


def test_default_topology_routes_everything_to_one_queue() -> None:
    topology = load_topology()
    assert [q.name for q in topology.queues] == ["jobplane.default"]
    assert topology.route("anything.at.all") is topology.queues[0]


def test_example_topologies_load() -> None:
    paths = sorted(EXAMPLES.glob("*.toml"))
    assert len(paths) >= 3
    for path in paths:
        topology = load_topology(path)
        assert topology.queues


def test_topology_validation() -> None:
    with pytest.raises(TopologyError):
        parse_topology({"queues": []})
    with pytest.raises(TopologyError):
        parse_topology({"queues": [{"name": "q", "bindings": ["Bad Pattern"]}]})
    with pytest.raises(TopologyError):
        parse_topology({"queues": [{"name": "q"}, {"name": "q"}]})
    with pytest.raises(TopologyError):
        parse_topology({"queues": [{"name": "q", "max_attempts": 0}]})
    narrow = parse_topology({"queues": [{"name": "reports", "bindings": ["reports.*"]}]})
    assert narrow.route("reports.render") is not None
    assert narrow.route("billing.charge") is None


def test_envelope_round_trip_and_rejects_garbage() -> None:
    envelope = Envelope(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), "demo.echo", "corr-1")
    assert Envelope.decode(envelope.encode()) == envelope
    assert len(envelope.encode()) < 1024
    for body in (b"", b"not json", b"[]", b'{"v": 2}', b'{"v":1,"kind":"jobplane.job.dispatch"}'):
        with pytest.raises(EnvelopeError):
            Envelope.decode(body)


def test_settings_from_env() -> None:
    settings = Settings.from_env(
        {
            "JOBPLANE_DATABASE_URL": "postgresql://u@h/db",
            "JOBPLANE_LISTEN": "0.0.0.0:6000",
            "JOBPLANE_MAX_PAYLOAD_BYTES": "1024",
            "JOBPLANE_FAULTS": "a, b",
            "JOBPLANE_DB_POOL_SIZE": "7",
            "JOBPLANE_DB_ENGINE_POOL_SIZE": "3",
        }
    )
    assert settings.database_url == "postgresql://u@h/db"
    assert settings.listen == "0.0.0.0:6000"
    assert settings.max_payload_bytes == 1024
    assert settings.faults == frozenset({"a", "b"})
    assert settings.db_pool_size == 7
    assert settings.db_engine_pool_size == 3
    # Small by default: docs/operations.md's bounds of each process follow from them.
    assert (Settings().db_pool_size, Settings().db_engine_pool_size) == (6, 2)
    assert Settings.from_env({}).listen == "127.0.0.1:50051"
    with pytest.raises(ConfigError):
        Settings.from_env({"JOBPLANE_MAX_PAYLOAD_BYTES": "lots"})
    for bad in ("0", "-1", "many"):
        with pytest.raises(ConfigError):
            Settings.from_env({"JOBPLANE_DB_POOL_SIZE": bad})
        with pytest.raises(ConfigError):
            Settings.from_env({"JOBPLANE_DB_ENGINE_POOL_SIZE": bad})


def test_log_settings_are_checked_at_start() -> None:
    settings = Settings.from_env({"JOBPLANE_LOG_LEVEL": " WARNING ", "JOBPLANE_LOG_FORMAT": "JSON"})
    assert (settings.log_level, settings.log_format) == ("warning", "json")
    unset = Settings.from_env({"JOBPLANE_LOG_LEVEL": "", "JOBPLANE_LOG_FORMAT": ""})
    assert (unset.log_level, unset.log_format) == (None, Settings().log_format)
    for name, bad in (
        ("JOBPLANE_LOG_LEVEL", "verbose"),
        ("JOBPLANE_LOG_LEVEL", "warn "),
        ("JOBPLANE_LOG_FORMAT", "xml"),
        ("JOBPLANE_LOG_FORMAT", "jsonl"),
    ):
        with pytest.raises(ConfigError, match=name):
            Settings.from_env({name: bad})


def test_demo_registry_has_the_documented_handlers() -> None:
    assert list(demo_registry) == ["demo.echo", "demo.fail", "demo.progress"]


def test_fault_points_raise_and_crash_on_the_nth_hit() -> None:
    import subprocess
    import sys

    from jobplane.faults import FaultPoints, InjectedFault

    FaultPoints().hit("anything")  # unarmed: nothing happens
    armed = FaultPoints({"submit.after_commit"})
    with pytest.raises(InjectedFault):
        armed.hit("submit.after_commit")
    armed.hit("other.point")

    script = (
        "from jobplane.faults import FaultPoints\n"
        "f = FaultPoints({'crash:p@3'})\n"
        "for i in range(1, 5):\n"
        "    print(i, flush=True)\n"
        "    f.hit('p')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert run.returncode == 137
    assert run.stdout.split() == ["1", "2", "3"]


def test_queue_defaults_and_their_checks() -> None:
    queue = parse_topology(
        {"queues": [{"name": "q", "timeout_seconds": 5, "retry_base_delay": 0.5}]}
    ).queues[0]
    assert queue.timeout_seconds == 5.0
    assert queue.retry_base_delay == 0.5
    with pytest.raises(TopologyError):
        parse_topology({"queues": [{"name": "q", "timeout_seconds": 0}]})
    with pytest.raises(TopologyError):
        parse_topology({"queues": [{"name": "q", "retry_base_delay": 10, "retry_max_delay": 1}]})


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    from jobplane.workers.retry import backoff

    for attempt in range(1, 12):
        ceiling = min(30.0, 1.0 * 2 ** (attempt - 1))
        delays = [backoff(attempt, base=1.0, cap=30.0) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1  # jittered


def test_new_ids_are_version_7_and_ordered_by_creation() -> None:
    ids = [new_id() for _ in range(10_000)]
    assert all(type(i) is uuid.UUID and i.version == 7 for i in ids)
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
