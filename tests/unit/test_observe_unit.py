"""Log settings, log lines and the ops listener's address, without services."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from jobplane.cli import main
from jobplane.config import ConfigError, ListenAddress, Settings, parse_listen
from jobplane.logs import configure, fingerprint, set_job_prefixes
from jobplane.observe.metrics import MAX_TYPE_LABELS, NO_METRICS, OTHER_TYPE, Metrics
from jobplane.process import METRICS_DEFAULTS
from jobplane.topology import TopologyError, parse_topology


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str]) -> Iterator[pytest.CaptureFixture[str]]:
    """Logging configured for JSON (to the captured stderr); configured back afterwards."""
    configure("info", "json", job_prefix="")
    capsys.readouterr()
    yield capsys
    set_job_prefixes()
    configure("warning")


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines()]


def _boom() -> None:
    raise RuntimeError("boom")


def test_another_librarys_record_is_one_json_line_with_its_logger(
    stderr: pytest.CaptureFixture[str],
) -> None:
    logging.getLogger("aio_pika").warning("lost %s", "Bearer " + "t" * 20)
    logging.getLogger("asyncpg").info("below warning: not shown")
    try:
        _boom()
    except RuntimeError:
        logging.getLogger("grpc").exception("failed")
    lines = _lines(stderr)
    assert [(r["logger"], r["level"]) for r in lines] == [
        ("aio_pika", "warning"),
        ("grpc", "error"),
    ]
    assert lines[0]["event"] == "lost Bearer [REDACTED]"
    assert "RuntimeError: boom" in str(lines[1]["exception"])


def test_the_prefix_goes_before_job_names_only(stderr: pytest.CaptureFixture[str]) -> None:
    # A logger of its own: one an earlier test cached keeps that test's configuration.
    configure("info", "json", job_prefix="ingestion.")
    set_job_prefixes("ingestion.", {"maintenance": "upkeep."})
    log = structlog.get_logger(f"jobplane.test.{id(stderr)}")
    log.info("job.completed", queue="jobplane.default")
    log.info("job.dispatched", queue="maintenance")
    log.info("broker.publish.failed", queue="jobplane.default")
    log.info("broker.message.redelivered")
    log.info("jobs.other")
    lines = _lines(stderr)
    assert [r["event"] for r in lines] == [
        "ingestion.job.completed",
        "upkeep.job.dispatched",
        "broker.publish.failed",
        "broker.message.redelivered",
        "jobs.other",
    ]
    assert all(r["logger"] == f"jobplane.test.{id(stderr)}" for r in lines)


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("JOBPLANE_LOG_LEVEL", "verbose"),
        ("JOBPLANE_LOG_FORMAT", "xml"),
        ("JOBPLANE_LOG_JOB_PREFIX", "Ingestion"),
        ("JOBPLANE_LOG_JOB_PREFIX", "ingestion"),
        ("JOBPLANE_LOG_LEVLE", "info"),
        ("JOBPLANE_METRICS_LISTEN", "9460"),
    ],
)
def test_serve_refuses_a_bad_setting_by_name(
    name: str, bad: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(name, bad)
    with pytest.raises(SystemExit) as exited:
        main(["serve"])
    assert exited.value.code == 2
    assert name in capsys.readouterr().err


def test_the_serve_command_exits_2_on_a_bad_log_level() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "jobplane", "serve"],
        env={"JOBPLANE_LOG_LEVEL": "loud", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "JOBPLANE_LOG_LEVEL must be one of debug, info, warning, error, critical" in done.stderr


def test_log_settings_are_read() -> None:
    env = {"JOBPLANE_LOG_JOB_PREFIX": "ingestion.", "JOBPLANE_LOG_LEVEL": "DEBUG"}
    settings = Settings.from_env(env)
    assert (settings.log_job_prefix, settings.log_level) == ("ingestion.", "debug")
    assert not Settings.from_env({}).metrics_listen_set
    off = Settings.from_env({"JOBPLANE_METRICS_LISTEN": "off"})
    assert off.metrics_listen_set and off.metrics_listen is None


def test_a_queue_log_prefix_is_checked() -> None:
    queue = {"name": "files", "bindings": ["ingest.#"], "log_prefix": "ingestion."}
    topology = parse_topology({"queues": [queue]})
    assert topology.queue("files").log_prefix == "ingestion."
    with pytest.raises(TopologyError, match="log_prefix"):
        parse_topology({"queues": [{**queue, "log_prefix": "no dot"}]})


def test_every_command_has_its_own_default_port() -> None:
    ports = {c: parse_listen(a) for c, a in METRICS_DEFAULTS.items()}
    assert len(set(ports.values())) == len(ports) == 5
    assert ports["dev"] == parse_listen("127.0.0.1:9464")


@given(
    host=st.one_of(
        st.sampled_from(["127.0.0.1", "0.0.0.0", "localhost", "ops.internal"]),
        st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True),
    ),
    port=st.integers(0, 65535),
)
def test_listen_addresses_round_trip(host: str, port: int) -> None:
    parsed = parse_listen(f"{host}:{port}")
    assert parsed == ListenAddress(host, port)
    assert parse_listen(str(parsed)) == parsed


@given(port=st.integers(0, 65535))
def test_ipv6_listen_addresses_round_trip(port: int) -> None:
    parsed = parse_listen(f"[::1]:{port}")
    assert parsed == ListenAddress("::1", port)
    assert str(parsed) == f"[::1]:{port}"


@given(st.text(max_size=40))
def test_any_other_text_is_refused_or_parsed_whole(raw: str) -> None:
    try:
        parsed = parse_listen(raw)
    except ConfigError as exc:
        refused = str(exc)
        assert "JOBPLANE_METRICS_LISTEN" in refused
        return
    if parsed is None:
        assert raw.strip().lower() == "off"
        return
    assert 0 <= parsed.port <= 65535
    assert parse_listen(str(parsed)) == parsed


def test_no_metrics_counts_nothing_and_a_registry_is_per_instance() -> None:
    NO_METRICS.attempt_ended("t", "q", "completed", 1.0)
    NO_METRICS.jobs_submitted.labels("t", "q").inc()
    one, two = Metrics(), Metrics()
    one.know_types(["t"])
    one.attempt_ended("t", "q", "completed", 0.5)
    assert (
        one.registry.get_sample_value(
            "jobplane_jobs_finished_total", {"type": "t", "queue": "q", "outcome": "completed"}
        )
        == 1
    )
    assert (
        two.registry.get_sample_value(
            "jobplane_jobs_finished_total", {"type": "t", "queue": "q", "outcome": "completed"}
        )
        is None
    )


def _types(metrics: Metrics, family: str) -> set[str]:
    return {
        s.labels["type"] for f in metrics.registry.collect() for s in f.samples if s.name == family
    }


def test_a_type_label_is_a_known_type_or_other_and_bounded() -> None:
    metrics = Metrics()
    metrics.know_topology(
        parse_topology(
            {
                "queues": [{"name": "q", "bindings": ["img.resize", "img.*", "#"]}],
                "pipelines": [
                    {
                        "name": "ingest",
                        "stages": [{"name": "a", "type": "ingest.fetch"}],
                    }
                ],
            }
        )
    )
    metrics.know_types(f"handler.t{n}" for n in range(MAX_TYPE_LABELS + 100))
    for job_type in ("img.resize", "img.crop", "ingest", "ingest.fetch", "made.up"):
        metrics.submitted(job_type, "q")
        metrics.attempt_started(job_type, "q", 1, None)
        metrics.attempt_ended(job_type, "q", "completed", 0.1)
    for n in range(MAX_TYPE_LABELS + 100):
        metrics.submitted(f"handler.t{n}", "q")
    expected = {"img.resize", "ingest", "ingest.fetch", OTHER_TYPE}
    assert _types(metrics, "jobplane_jobs_finished_total") == expected
    assert _types(metrics, "jobplane_job_attempts_total") == expected
    submitted = _types(metrics, "jobplane_jobs_submitted_total")
    assert expected <= submitted
    assert len(submitted) == MAX_TYPE_LABELS + 1
    assert (
        metrics.registry.get_sample_value(
            "jobplane_jobs_submitted_total", {"type": OTHER_TYPE, "queue": "q"}
        )
        == 2 + 103
    )  # img.crop, made.up, and the handler types past the bound (3 + 497 known)


def test_a_fingerprint_hides_the_id() -> None:
    assert fingerprint("") == ""
    assert fingerprint("order-1") == fingerprint("order-1") != fingerprint("order-2")
    assert "order" not in fingerprint("order-1")
