"""While tracing is on, a line logged inside a span names its trace and span,
whether jobplane or another library (through the standard library) logs it.
The process registers tracing's processor with logging where it turns tracing
on (``jobplane.process._tracing``); these tests register it as it does."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider

from jobplane import logs
from jobplane.logs import configure
from jobplane.observe import tracing


@pytest.fixture
def reconfigured() -> Iterator[None]:
    before = logs._TRACE_IDS
    tracing.register_logs()
    yield
    logs.register_trace_ids(before)
    configure("warning")


def _capture(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    # In the test's own body: the runner's capture replaces stderr anew for each phase.
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    configure("info", "json")
    return out


def _lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


@pytest.mark.usefixtures("reconfigured")
def test_lines_inside_a_span_name_it(monkeypatch: pytest.MonkeyPatch) -> None:
    captured = _capture(monkeypatch)
    monkeypatch.setattr(tracing, "ENABLED", True)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("job run demo.echo") as span:
        structlog.get_logger("jobplane.test.traced").info("job.completed", attempt=1)
        logging.getLogger("aio_pika").warning("from another library")
        context = span.get_span_context()
    structlog.get_logger("jobplane.test.traced").info("after.span")
    inside, foreign, after = _lines(captured)
    for line in (inside, foreign):
        assert line["trace_id"] == format(context.trace_id, "032x")
        assert line["span_id"] == format(context.span_id, "016x")
    assert foreign["logger"] == "aio_pika"
    assert "trace_id" not in after


@pytest.mark.usefixtures("reconfigured")
def test_lines_name_no_trace_while_tracing_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    captured = _capture(monkeypatch)
    monkeypatch.setattr(tracing, "ENABLED", False)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("job run demo.echo"):
        structlog.get_logger("jobplane.test.untraced").info("job.completed")
    (line,) = _lines(captured)
    assert "trace_id" not in line
    assert "span_id" not in line
