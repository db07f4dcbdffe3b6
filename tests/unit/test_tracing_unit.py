"""Trace context in and out of headers, rows and metadata; the OTEL_* settings."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from importlib.util import find_spec
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.baggage import get_baggage
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, StatusCode, TraceFlags

from jobplane import process
from jobplane.config import OTLP_GRPC_MODULE, ConfigError, Settings
from jobplane.observe import trace_context, trace_server, trace_setup, tracing
from tests.support.attempts import an_attempt

_HEADER_VALUES = st.one_of(
    st.text(max_size=600),
    st.binary(max_size=100),
    st.integers(),
    st.none(),
    st.lists(st.text(max_size=5), max_size=3),
)
_CARRIERS = st.dictionaries(
    st.sampled_from(["traceparent", "tracestate", "other"]) | st.text(max_size=10),
    _HEADER_VALUES,
    max_size=4,
)


@pytest.fixture
def on(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on for the test, with spans kept in memory (no global provider)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "ENABLED", True)
    monkeypatch.setattr(tracing, "_TRACER", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def _parent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


@settings(deadline=None)  # timing is not what these check; shared machines are slow
@given(_CARRIERS)
def test_a_carrier_of_anything_extracts_without_raising(carrier: dict[str, Any]) -> None:
    context = tracing.extract(carrier)
    span = trace.get_current_span(context).get_span_context()
    value = carrier.get("traceparent")
    if not isinstance(value, str | bytes):
        assert not span.is_valid


@settings(deadline=None)  # timing is not what these check; shared machines are slow
@given(st.integers(1, 2**128 - 1), st.integers(1, 2**64 - 1))
def test_a_valid_traceparent_round_trips(trace_id: int, span_id: int) -> None:
    context = tracing.extract({"traceparent": _parent(trace_id, span_id)})
    found = trace.get_current_span(context).get_span_context()
    assert (found.trace_id, found.span_id, found.is_remote) == (trace_id, span_id, True)


@settings(deadline=None)  # timing is not what these check; shared machines are slow
@given(st.text(max_size=80).filter(lambda v: v.count("-") != 3))
def test_a_malformed_traceparent_is_a_new_trace(value: str) -> None:
    context = tracing.extract({"traceparent": value, "tracestate": "a=b"})
    assert not trace.get_current_span(context).get_span_context().is_valid


@settings(deadline=None)  # timing is not what these check; shared machines are slow
@given(
    st.sampled_from(["00", "01", "ff"]),
    st.integers(0, 2**128 - 1),
    st.integers(0, 2**64 - 1),
    st.sampled_from(["00", "01", "02"]),
    st.sampled_from(["", "-more"]),
)
def test_a_log_line_reads_the_trace_id_the_propagator_would(
    version: str, trace_id: int, span_id: int, flags: str, more: str
) -> None:
    parent = f"{version}-{trace_id:032x}-{span_id:016x}-{flags}{more}"
    found = trace.get_current_span(tracing.extract({"traceparent": parent})).get_span_context()
    expected = f"{found.trace_id:032x}" if found.is_valid else None
    assert tracing.trace_id_of({"traceparent": parent}) == expected


@settings(deadline=None)  # timing is not what these check; shared machines are slow
@given(_CARRIERS)
def test_a_log_line_reads_a_trace_id_only_from_a_valid_traceparent(
    carrier: dict[str, Any],
) -> None:
    found = tracing.trace_id_of(carrier)
    if found is not None:
        context = trace.get_current_span(tracing.extract(carrier)).get_span_context()
        assert context.is_valid and found == f"{context.trace_id:032x}"


def test_off_costs_a_check_and_gives_shared_no_ops() -> None:
    assert tracing.ENABLED is False
    assert tracing.current_headers() is tracing.NO_HEADERS
    assert tracing.trace_binds() is tracing.NO_TRACE
    assert tracing.delivered({"traceparent": _parent(1, 1)}) is tracing._NULL
    assert tracing.start_run(object()) is None  # type: ignore[arg-type]
    assert tracing.outgoing("a", "b") == ("a", "b")
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


@settings(deadline=None)  # timing is not what these check; shared machines are slow
@given(_CARRIERS)
def test_a_publish_from_any_row_carries_a_valid_context(carrier: dict[str, Any]) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tracing, "ENABLED", True)
        patch.setattr(tracing, "_TRACER", provider.get_tracer("test"))
        with tracing.publish_span(
            carrier,
            exchange="x",
            routing_key="a.b",
            message_id="m",
            job_id="j",
            tenant_id="t",
        ) as headers:
            pass
    (span,) = exporter.get_finished_spans()
    sent = tracing.extract(headers)
    found = trace.get_current_span(sent).get_span_context()
    assert found.is_valid
    assert (found.trace_id, found.span_id) == (span.context.trace_id, span.context.span_id)
    assert len(headers.get("tracestate", "")) <= tracing.MAX_TRACESTATE


def test_a_publish_continues_the_rows_trace(on: InMemorySpanExporter) -> None:
    row = {"traceparent": _parent(0xABC, 0xDEF), "tracestate": "k=v"}
    with tracing.publish_span(
        row, exchange="x", routing_key="a.b", message_id="m", job_id="j", tenant_id="t"
    ) as headers:
        pass
    (span,) = on.get_finished_spans()
    assert span.context.trace_id == 0xABC
    assert span.parent is not None
    assert span.parent.span_id == 0xDEF
    assert span.kind is trace.SpanKind.PRODUCER
    assert headers["tracestate"] == "k=v"
    assert headers["traceparent"].split("-")[2] == f"{span.context.span_id:016x}"


def test_binds_carry_the_current_span_and_drop_a_long_tracestate(
    on: InMemorySpanExporter,
) -> None:
    context = SpanContext(0x1, 0x2, is_remote=True, trace_flags=TraceFlags(1))
    span = NonRecordingSpan(context)
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        binds = tracing.trace_binds()
    finally:
        otel_context.detach(token)
    assert binds["trace_parent"] == _parent(1, 2)
    assert binds["trace_inherit"] is True
    # No span: nothing to carry, but a dispatch may inherit the job's.
    assert tracing.trace_binds()["trace_parent"] is None
    long_state = ",".join(f"k{i}=" + "v" * 20 for i in range(30))
    context_ = tracing.extract({"traceparent": _parent(5, 6), "tracestate": long_state})
    token = otel_context.attach(context_)
    try:
        assert tracing.current_headers() == {"traceparent": _parent(5, 6)}
    finally:
        otel_context.detach(token)


@settings(deadline=None)  # timing is not what these check; shared machines are slow
@given(st.lists(st.tuples(st.text(max_size=12), _HEADER_VALUES), max_size=5))
def test_metadata_of_anything_extracts_without_raising(metadata: list[tuple[str, Any]]) -> None:
    trace_server._from_metadata(metadata)


def _settings(**env: str) -> Settings:
    return Settings.from_env(env)


def test_tracing_is_off_unless_asked_for() -> None:
    assert _settings().trace_exporters == ()
    assert _settings(OTEL_TRACES_EXPORTER="none").trace_exporters == ()
    assert _settings(OTEL_EXPORTER_OTLP_ENDPOINT="http://h:4318").trace_exporters == ("otlp",)
    assert _settings(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://h/v1/traces").trace_exporters == (
        "otlp",
    )
    assert _settings(OTEL_TRACES_EXPORTER="otlp,console").trace_exporters == ("otlp", "console")
    # An endpoint does not override an explicit "none", and the SDK switch wins over all.
    assert (
        _settings(
            OTEL_TRACES_EXPORTER="none", OTEL_EXPORTER_OTLP_ENDPOINT="http://h"
        ).trace_exporters
        == ()
    )
    assert _settings(OTEL_SDK_DISABLED="true", OTEL_TRACES_EXPORTER="otlp").trace_exporters == ()
    assert _settings(
        OTEL_SERVICE_NAME="billing", OTEL_TRACES_EXPORTER="otlp"
    ).trace_service_name == ("billing")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_TRACES_SAMPLER": "sometimes"},
            "OTEL_TRACES_SAMPLER",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
            "OTEL_TRACES_SAMPLER_ARG",
        ),
        (
            {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "x"},
            "OTEL_TRACES_SAMPLER_ARG",
        ),
    ],
)
def test_a_setting_the_sdk_would_quietly_replace_is_refused(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        Settings.from_env(env)


def test_configure_with_tracing_off_installs_nothing() -> None:
    assert tracing.configure_tracing("jobplane-test", Settings()) is False
    assert tracing.ENABLED is False
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


def test_configure_tracing_alone_traces_the_store_transitions() -> None:
    # A fresh interpreter: configure_tracing installs the global provider. No
    # other call (a Worker embedded in an application, a benchmark) is needed
    # for a transition's dispatch to carry the current span's context.
    program = (
        "import json\n"
        "from jobplane.config import Settings\n"
        "from jobplane.observe import tracing\n"
        "from jobplane import logs\n"
        "from jobplane.store import observers\n"
        "on = tracing.configure_tracing('t', Settings(trace_exporters=('console',)))\n"
        "with tracing.trace.get_tracer('t').start_as_current_span('s') as span:\n"
        "    binds = observers.trace_binds()\n"
        "    line = logs._TRACE_IDS(None, 'info', {}) if logs._TRACE_IDS else {}\n"
        "    trace_id = format(span.get_span_context().trace_id, '032x')\n"
        "found = [on, binds['trace_parent'], line.get('trace_id'), trace_id]\n"
        "print(json.dumps(found), flush=True)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=60
    )
    on, parent, logged, trace_id = json.loads(out.stdout.splitlines()[0])
    assert on is True
    assert parent is not None
    assert parent.split("-")[1] == trace_id
    # ... and its log lines name the trace without a call of their own.
    assert logged == trace_id


def test_otlp_over_grpc_needs_the_grpc_exporter_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # The gRPC exporter installed, the HTTP one not: what the settings accept
    # for OTEL_EXPORTER_OTLP_PROTOCOL=grpc, the CLI must start with.
    asked: list[str] = []

    def missing(names: tuple[str, ...]) -> list[str]:
        asked.extend(names)
        return [n for n in names if n.startswith("opentelemetry.exporter.otlp.proto.http")]

    monkeypatch.setattr(process, "missing_modules", missing)
    monkeypatch.setattr(tracing, "configure_tracing", lambda *_: False)
    grpc = Settings(trace_exporters=("otlp",), trace_protocol="grpc")
    process._tracing("jobplane-test", grpc)
    assert OTLP_GRPC_MODULE in asked
    # Over HTTP the HTTP exporter is still required.
    with pytest.raises(ConfigError, match=r"opentelemetry\.exporter\.otlp\.proto\.http"):
        process._tracing("jobplane-test", Settings(trace_exporters=("otlp",)))


def test_a_failure_is_kept_by_its_type_never_its_message(on: InMemorySpanExporter) -> None:
    attempt = an_attempt(
        type="reports.render", payload={"secret": "s3cr3t"}, attempt=2, queue="default"
    )
    with pytest.raises(ValueError, match="s3cr3t"), tracing.outcome_span(attempt):
        raise ValueError("the payload was s3cr3t")
    run = tracing.start_run(attempt)
    tracing.end_run(run, RuntimeError("s3cr3t again"))
    outcome, handler = on.get_finished_spans()
    assert handler.name == "job run reports.render"
    for span in (outcome, handler):
        assert span.status.status_code is StatusCode.ERROR
        assert "s3cr3t" not in repr(span.attributes) + str(span.status.description)
        assert not span.events
        assert span.attributes is not None
        assert span.attributes["jobplane.attempt"] == 2
        assert span.attributes["jobplane.job.type"] == "reports.render"
    assert outcome.attributes is not None
    assert outcome.attributes["error.type"] == "ValueError"


@pytest.mark.parametrize(
    ("sampler", "skips"),
    [
        (sampling.ParentBased(sampling.ALWAYS_ON), True),
        (sampling.ParentBased(sampling.TraceIdRatioBased(0.1)), True),
        (sampling.ALWAYS_ON, False),
        (sampling.TraceIdRatioBased(0.5), False),
        (
            sampling.ParentBased(sampling.ALWAYS_ON, remote_parent_not_sampled=sampling.ALWAYS_ON),
            False,
        ),
    ],
)
def test_the_sampler_says_whether_an_unsampled_trace_makes_spans(
    sampler: sampling.Sampler, skips: bool
) -> None:
    assert trace_setup.drops_unsampled_children(sampler) is skips


def _unsampled(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-00"


def test_an_unsampled_trace_makes_no_spans_and_carries_its_context(
    on: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracing, "_SKIP_UNSAMPLED", True)
    row = {"traceparent": _unsampled(0xABC, 0xDEF), "tracestate": "k=v"}
    # The relay: the message carries the row's context as it is.
    with tracing.publish_span(
        row, exchange="x", routing_key="a.b", message_id="m", job_id="j", tenant_id="t"
    ) as headers:
        pass
    assert headers == row
    # The worker: no claim, run or outcome span; what it writes carries the trace on.
    attempt = an_attempt(type="reports.render", queue="default")
    with tracing.delivered(headers):
        with tracing.claim_span(object(), object()) as claim:  # type: ignore[arg-type]
            assert claim is None
        assert tracing.start_run(attempt) is None
        with tracing.outcome_span(attempt) as outcome:
            assert outcome is None
            binds = tracing.trace_binds()
    assert on.get_finished_spans() == ()
    assert binds["trace_parent"] == row["traceparent"] and binds["trace_state"] == "k=v"
    # A sampled trace still makes its spans.
    with tracing.publish_span(
        {"traceparent": _parent(0xABC, 0xDEF)},
        exchange="x",
        routing_key="a.b",
        message_id="m",
        job_id="j",
        tenant_id="t",
    ):
        pass
    (span,) = on.get_finished_spans()
    assert span.name == "outbox publish" and span.context.trace_id == 0xABC


_TRACEPARENTS = st.one_of(
    st.builds(
        "{}-{:032x}-{:016x}-{:02x}{}".format,
        st.sampled_from(["00", "01", "ff", "0A"]),
        st.integers(0, 2**128 - 1) | st.just(0),
        st.integers(0, 2**64 - 1) | st.just(0),
        st.integers(0, 255),
        st.sampled_from(["", "-", "-x", " "]),
    ),
    st.text(max_size=60),
    st.binary(max_size=60),
)


@settings(deadline=None)
@given(parent=_TRACEPARENTS, state=st.none() | st.text(max_size=20))
def test_an_unsampled_context_carried_on_as_it_came_is_what_the_propagator_makes(
    parent: str | bytes, state: str | None
) -> None:
    carrier: dict[str, Any] = {"traceparent": parent}
    if state is not None:
        carrier["tracestate"] = state
    assert tracing._passed_on(carrier) is None  # the sampler keeps such spans: no short path
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tracing, "_SKIP_UNSAMPLED", True)
        passed = tracing._passed_on(carrier)
        context = tracing.extract(carrier)
        if passed is None:
            return
        # Only what the propagator reads as a valid trace that is not sampled,
        # and exactly what it would have written back.
        assert tracing._unsampled(context)
        assert passed == trace_context.inject(context)
        found = trace.get_current_span(
            trace_context.remote(passed["traceparent"])
        ).get_span_context()
        assert found == trace.get_current_span(context).get_span_context()


def test_the_short_path_takes_the_plain_form_jobplane_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing, "_SKIP_UNSAMPLED", True)
    plain = {"traceparent": _unsampled(0xABC, 0xDEF)}
    assert tracing._passed_on(plain) == plain
    assert tracing._passed_on({"traceparent": _unsampled(0xABC, 0xDEF).encode()}) == plain
    random_flag = {"traceparent": _unsampled(0xABC, 0xDEF)[:-2] + "02"}
    assert tracing._passed_on(random_flag) == random_flag
    # Sampled, or with a tracestate to check: the propagator's way.
    assert tracing._passed_on({"traceparent": _parent(0xABC, 0xDEF)}) is None
    assert tracing._passed_on({**plain, "tracestate": "k=v"}) is None


def _installed(propagator: str) -> bool:
    return any(e.name == propagator for e in entry_points(group="opentelemetry_propagator"))


def test_otel_propagators_name_installed_propagators_or_are_refused() -> None:
    on = {"OTEL_TRACES_EXPORTER": "console"}
    assert _settings(**on).trace_propagators == ("tracecontext",)
    assert _settings(**on, OTEL_PROPAGATORS="tracecontext, baggage").trace_propagators == (
        "tracecontext",
        "baggage",
    )
    assert _settings(**on, OTEL_PROPAGATORS="none").trace_propagators == ()
    with pytest.raises(ConfigError, match=r"OTEL_PROPAGATORS names 'w3c'.*the installed ones"):
        _settings(**on, OTEL_PROPAGATORS="tracecontext,w3c")
    # One OpenTelemetry has, in a package of its own: the line names the package.
    if _installed("b3"):
        assert _settings(**on, OTEL_PROPAGATORS="b3").trace_propagators == ("b3",)
    else:
        with pytest.raises(ConfigError, match="pip install opentelemetry-propagator-b3"):
            _settings(**on, OTEL_PROPAGATORS="b3")
    # Tracing off reads no caller's context: nothing to check.
    assert _settings(OTEL_PROPAGATORS="b3").trace_propagators == ("tracecontext",)


def test_the_otlp_protocol_is_one_an_installed_exporter_speaks() -> None:
    on = {"OTEL_TRACES_EXPORTER": "otlp"}
    assert _settings(**on).trace_protocol == "http/protobuf"
    assert (
        _settings(**on, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf").trace_protocol
        == "http/protobuf"
    )
    with pytest.raises(ConfigError, match=r"http/json: .* set http/protobuf"):
        _settings(**on, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/json")
    with pytest.raises(ConfigError, match="must be http/protobuf or grpc, not 'thrift'"):
        _settings(**on, OTEL_EXPORTER_OTLP_PROTOCOL="thrift")
    grpc_installed = find_spec("opentelemetry.exporter.otlp") is not None and (
        find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None
    )
    if grpc_installed:
        assert _settings(**on, OTEL_EXPORTER_OTLP_PROTOCOL="grpc").trace_protocol == "grpc"
    else:
        with pytest.raises(ConfigError, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
            _settings(**on, OTEL_EXPORTER_OTLP_PROTOCOL="grpc")


@pytest.mark.parametrize(
    ("names", "traced", "with_baggage"),
    [
        (("tracecontext",), True, False),
        (("tracecontext", "baggage"), True, True),
        (("baggage",), False, True),
        ((), False, False),
    ],
)
def test_the_server_reads_a_callers_context_with_the_propagators_named(
    monkeypatch: pytest.MonkeyPatch,
    names: tuple[str, ...],
    traced: bool,
    with_baggage: bool,
) -> None:
    monkeypatch.setattr(tracing, "_CALLERS", trace_setup.propagator(names))
    metadata = [("traceparent", _parent(7, 9)), ("baggage", "order=o-1")]
    context = trace_server._from_metadata(metadata)
    found = trace.get_current_span(context).get_span_context()
    assert (found.is_valid and found.trace_id == 7) is traced
    assert (get_baggage("order", context) == "o-1") is with_baggage
