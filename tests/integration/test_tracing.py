"""One trace from the caller to the job's outcome, across real processes.

`jobplane serve`, `relay` and `worker` run as separate processes exporting
over OTLP/HTTP to a receiver on loopback (tests/otlp_receiver.py); the test
is the caller, with a span of its own and the SDK's tracing option.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import jobplane.client.tracing as client_tracing
from jobplane.client import AsyncClient, Client, JobNotFound, JobState
from jobplane.topology import PipelineSpec, StageSpec, Topology
from tests.faults.cluster import ROOT, Cluster, Proc
from tests.integration.tracing_handlers import STAGES
from tests.otlp_receiver import ReceivedSpan, Receiver

PIPELINE = "trace.pipeline"
SUBMIT = "jobplane.v1.JobService/SubmitJob"
_PRODUCER, _CONSUMER, _SERVER = 4, 5, 2  # OTLP's SpanKind numbers
_ERROR = 2  # OTLP's Status.STATUS_CODE_ERROR


def _with_pipeline(topology: Topology) -> Topology:
    queue = topology.queues[0].name
    stages = tuple(
        StageSpec(
            name=n,
            type=f"trace.stage.{n}",
            queue=queue,
            max_attempts=3,
            timeout_seconds=60.0,
            version="1",
        )
        for n in STAGES
    )
    return replace(topology, pipelines=(PipelineSpec(PIPELINE, stages, version="1"),))


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver.running() as running:
        yield running


@pytest.fixture
def caller(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """The calling service's own tracer provider (not the process's global one),
    which the SDK's client spans use too."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(client_tracing, "_TRACER", provider.get_tracer("jobplane.client"))
    yield provider, exporter
    provider.shutdown()


async def _cluster(
    database_url: str, amqp_url: str, topology: Topology, workdir: Path, env: dict[str, str]
) -> Cluster:
    cluster = Cluster(database_url, amqp_url, topology, workdir)
    cluster.env.update(env)
    await cluster.prepare()
    return cluster


async def _worker(cluster: Cluster) -> Proc:
    args = ["worker", "--handlers", "tests.integration.tracing_handlers:registry"]
    return await cluster._spawn([*args, "--lease-seconds", "5", "--grace", "1"], "worker.started")


async def _until(
    check: Callable[[], Awaitable[bool] | bool], what: str, timeout: float = 20
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found if isinstance(found, bool) else await found:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _job_spans(spans: Sequence[ReceivedSpan], job_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.attributes.get("jobplane.job.id") == job_id]


def _one(spans: Sequence[ReceivedSpan], **match: Any) -> ReceivedSpan:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.name, s.span_id, s.parent_id) for s in spans])
    return found[0]


class _Garbage(grpc.aio.UnaryUnaryClientInterceptor):
    """Sends a traceparent that is not one."""

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        metadata = grpc.aio.Metadata(
            *(details.metadata or ()),
            ("traceparent", "00-zz-not-a-trace-01"),
            ("tracestate", "=,=,not a state"),
        )
        return await continuation(
            grpc.aio.ClientCallDetails(
                details.method,
                details.timeout,
                metadata,
                details.credentials,
                details.wait_for_ready,
            ),
            request,
        )


async def test_one_trace_from_the_caller_to_the_outcome(
    database_url: str,
    amqp_url: str,
    topology: Topology,
    tmp_path: Path,
    receiver: Receiver,
    caller: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, exported = caller
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    cluster = await _cluster(database_url, amqp_url, _with_pipeline(topology), tmp_path, env)
    try:
        await cluster.server()
        await cluster.relay()
        await _worker(cluster)
        tracer = provider.get_tracer("the caller")
        async with AsyncClient(cluster.address, cluster.key, tracing=True) as client:
            with tracer.start_as_current_span("caller") as span:
                work = await client.submit("trace.work", {"n": 1})
                flaky = await client.submit("trace.flaky", {}, max_attempts=3)
                piped = await client.submit(PIPELINE, {})
                published = await client.publish("trace.published", {"n": 3})
            caller_trace = f"{span.get_span_context().trace_id:032x}"
            # A refused call's span has the code it was refused with.
            with pytest.raises(JobNotFound):
                await client.get(f"jobs/{uuid.uuid4()}")
            for job in (work, flaky, piped):
                assert (await client.wait(job.name, timeout=30)).state is JobState.SUCCEEDED
        # The blocking client: the calling thread's span goes along too.
        with (
            Client(cluster.address, cluster.key, tracing=True) as blocking,
            tracer.start_as_current_span("blocking caller") as blocking_span,
        ):
            await asyncio.to_thread(blocking.submit, "trace.flaky", {}, max_attempts=3)
        blocking_trace = f"{blocking_span.get_span_context().trace_id:032x}"
        # A traceparent that is not one fails nothing: the job runs in a trace of its own.
        async with AsyncClient(cluster.address, cluster.key, interceptors=[_Garbage()]) as client:
            stray = await client.submit("trace.work", {"n": 2})
            assert (await client.wait(stray.name, timeout=30)).state is JobState.SUCCEEDED

        ids = {
            name: j.name.removeprefix("jobs/")
            for name, j in (("work", work), ("flaky", flaky), ("piped", piped), ("stray", stray))
        }

        def outcomes(job: str, count: int) -> bool:
            # Each process exports on its own schedule: the relay's publish
            # span may arrive after the worker's outcome.
            spans = _job_spans(receiver.snapshot(), ids[job])
            return (
                sum(s.name == "job outcome" for s in spans) >= count
                and sum(s.name == "outbox publish" for s in spans) >= count
            )

        for which, count in (("work", 1), ("flaky", 2), ("piped", 2), ("stray", 1)):
            await _until(functools.partial(outcomes, which, count), f"{which}'s outcomes")
        await _until(
            lambda: any(
                s.name.endswith("/GetJob") and s.attributes["rpc.grpc.status_code"] == 5
                for s in receiver.snapshot()
            ),
            "the refused GetJob's span",
        )
        spans = receiver.snapshot()
        servers = [s for s in spans if s.name == SUBMIT]

        # The caller's span → the SDK's client span → the SubmitJob server span.
        mine: list[ReadableSpan] = list(exported.get_finished_spans())
        caller_span = next(s for s in mine if s.name == "caller")
        clients = [s for s in mine if s.name == SUBMIT]
        blocking_client = next(s for s in clients if s.parent == blocking_span.get_span_context())
        clients.remove(blocking_client)
        assert len(clients) == 3
        for client_span in clients:
            assert client_span.parent is not None
            assert client_span.parent.span_id == caller_span.context.span_id
        client_ids = {f"{s.context.span_id:016x}" for s in clients}
        await _until(
            lambda: any(
                s.trace_id == blocking_trace and s.name == SUBMIT for s in receiver.snapshot()
            ),
            "the blocking client's trace",
        )
        (blocking_server,) = [
            s for s in receiver.snapshot() if s.trace_id == blocking_trace and s.name == SUBMIT
        ]
        assert blocking_server.parent_id == f"{blocking_client.context.span_id:016x}"
        traced = [s for s in servers if s.trace_id == caller_trace]
        assert len(traced) == 3
        assert {s.parent_id for s in traced} == client_ids
        for server in traced:
            assert server.service == "jobplane-server"
            assert server.kind == _SERVER
            assert server.attributes["rpc.system"] == "grpc"
            assert server.attributes["rpc.service"] == "jobplane.v1.JobService"
            assert server.attributes["rpc.method"] == "SubmitJob"
            assert server.attributes["rpc.grpc.status_code"] == 0
            assert server.attributes["jobplane.transition"] == "submit"

        not_found = grpc.StatusCode.NOT_FOUND.value[0]
        (refused,) = [
            s
            for s in spans
            if s.name.endswith("/GetJob") and s.attributes["rpc.grpc.status_code"] == not_found
        ]
        assert refused.status != _ERROR  # a client's mistake, not the server's
        assert refused.trace_id != caller_trace

        # A plain job: SubmitJob → outbox publish → claim, run (progress events), outcome.
        trail = _job_spans(spans, ids["work"])
        assert {s.trace_id for s in trail} == {caller_trace}
        publish = _one(trail, name="outbox publish")
        submit_span = next(s for s in traced if s.span_id == publish.parent_id)
        assert publish.service == "jobplane-relay"
        assert publish.kind == _PRODUCER
        assert publish.attributes["messaging.system"] == "rabbitmq"
        assert publish.attributes["messaging.rabbitmq.destination.routing_key"] == "trace.work"
        claim = _one(trail, name="job claim")
        run = _one(trail, name="job run trace.work")
        outcome = _one(trail, name="job outcome")
        for span_ in (claim, run, outcome):
            assert span_.service == "jobplane-worker"
            assert span_.parent_id == publish.span_id
            assert span_.attributes["jobplane.attempt"] == 1
            assert span_.attributes["jobplane.job.id"] == ids["work"]
        assert run.attributes["jobplane.queue"] == topology.queues[0].name
        tenant = publish.attributes["jobplane.tenant.id"]
        assert run.attributes["jobplane.tenant.id"] == tenant == str(uuid.UUID(tenant))
        assert claim.kind == _CONSUMER
        assert claim.attributes["jobplane.transition"] == "claim"
        assert outcome.attributes["jobplane.transition"] == "succeed"
        assert [(n, a["jobplane.progress"]) for n, a in run.events] == [
            ("progress", pytest.approx(1 / 3)),
            ("progress", pytest.approx(2 / 3)),
            ("progress", 1.0),
        ]
        # Nothing of the tenant's: no payload, no key in any attribute.
        for span_ in spans:
            text = json.dumps(span_.attributes, default=str)
            assert '"n"' not in text
            assert cluster.key not in text
        # Its domain events carry the span they were written under.
        rows = await cluster.query(
            "SELECT event_type, traceparent FROM events WHERE job_id = $1 ORDER BY seq",
            uuid.UUID(ids["work"]),
        )
        parents = {r["event_type"]: r["traceparent"].split("-")[2] for r in rows}
        assert {r["traceparent"].split("-")[1] for r in rows} == {caller_trace}
        assert parents["job.queued"] == submit_span.span_id
        assert parents["job.started"] == claim.span_id
        assert parents["trace.worked"] == outcome.span_id
        assert parents["job.succeeded"] == outcome.span_id

        # PublishEvent: the event carries the server span's context.
        publish_rpc = _one(spans, name="jobplane.v1.EventService/PublishEvent")
        assert publish_rpc.trace_id == caller_trace
        (row,) = await cluster.query(
            "SELECT traceparent FROM events WHERE event_id = $1", published.event_id
        )
        assert row["traceparent"].split("-")[1:3] == [caller_trace, publish_rpc.span_id]

        # A retry: the second attempt's dispatch is a child of the first's outcome.
        trail = _job_spans(spans, ids["flaky"])
        assert {s.trace_id for s in trail} == {caller_trace}
        first, second = sorted(
            (s for s in trail if s.name == "job outcome"),
            key=lambda s: s.attributes["jobplane.attempt"],
        )
        assert first.attributes["jobplane.transition"] == "schedule_retry"
        assert second.attributes["jobplane.transition"] == "succeed"
        failed_run = _one(trail, name="job run trace.flaky", parent_id=first.parent_id)
        assert failed_run.status == _ERROR
        assert failed_run.attributes["error.type"] == "RetryableError"
        again = _one(trail, name="outbox publish", span_id=second.parent_id)
        assert again.parent_id == first.span_id

        # A pipeline: each stage's dispatch continues from the stage before.
        trail = _job_spans(spans, ids["piped"])
        assert {s.trace_id for s in trail} == {caller_trace}
        one = _one(trail, name="job run trace.stage.one")
        two = _one(trail, name="job run trace.stage.two")
        advance = _one(trail, name="job outcome", parent_id=one.parent_id)
        assert advance.attributes["jobplane.transition"] == "advance"
        stage_two = _one(trail, name="outbox publish", span_id=two.parent_id)
        assert stage_two.parent_id == advance.span_id
        assert two.attributes["jobplane.stage"] == "two"

        # The garbage traceparent: a new trace, its SubmitJob span a root.
        trail = _job_spans(spans, ids["stray"])
        stray_publish = _one(trail, name="outbox publish")
        # The server exports on its own schedule: its span may come after the others.
        await _until(
            lambda: any(s.span_id == stray_publish.parent_id for s in receiver.snapshot()),
            "the stray SubmitJob's span",
        )
        servers = [s for s in receiver.snapshot() if s.name == SUBMIT]
        stray_submit = _one(servers, span_id=stray_publish.parent_id)
        assert stray_submit.parent_id == ""
        assert stray_submit.trace_id != caller_trace
    finally:
        await cluster.close()


async def test_tracing_off_exports_nothing(
    database_url: str, amqp_url: str, topology: Topology, tmp_path: Path, receiver: Receiver
) -> None:
    # An endpoint is set, but each process is told not to trace.
    cluster = await _cluster(
        database_url,
        amqp_url,
        topology,
        tmp_path,
        {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"},
    )
    cluster.env["OTEL_TRACES_EXPORTER"] = "none"
    try:
        server = await cluster.server()
        async with AsyncClient(cluster.address, cluster.key, tracing=True) as client:
            job = await client.submit("demo.echo", {"x": 1})
        sweep = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jobplane",
            "sweep",
            "--once",
            env={**cluster.env, "OTEL_TRACES_EXPORTER": "", "OTEL_SDK_DISABLED": "true"},
            cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await sweep.communicate()
        assert sweep.returncode == 0, err
        rows = await cluster.query(
            "SELECT headers, published_at FROM outbox WHERE job_id = $1",
            uuid.UUID(job.name.removeprefix("jobs/")),
        )
        # Published, by a relay that did not trace, from a row with no trace context.
        assert [(json.loads(r["headers"]), r["published_at"] is not None) for r in rows] == [
            ({}, True)
        ]
        server.kill(signal.SIGTERM)
        assert await server.wait() == 0
        assert receiver.requests == 0
        probe = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "import sys; from jobplane.observe import tracing; "
            "from opentelemetry import trace; "
            "print(tracing.configure_tracing('x'), type(trace.get_tracer_provider()).__name__, "
            "'opentelemetry.sdk' in sys.modules)",
            env=cluster.env,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await probe.communicate()
        assert out.decode().split() == ["False", "ProxyTracerProvider", "False"]
    finally:
        await cluster.close()


def _json_lines(*procs: Proc) -> list[dict[str, Any]]:
    """Every line the processes logged, each one JSON object."""
    return [
        json.loads(line)
        for proc in procs
        for line in proc.log.read_text().splitlines()
        if line.strip()
    ]


async def test_every_log_line_of_a_job_names_its_trace(
    database_url: str,
    amqp_url: str,
    topology: Topology,
    tmp_path: Path,
    receiver: Receiver,
    caller: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    provider, _ = caller
    # A trace the caller samples, and one no process samples (the ratio 0 at
    # the server's root): the relay and the worker carry the latter on as it came.
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
        "JOBPLANE_LOG_FORMAT": "json",
    }
    cluster = await _cluster(database_url, amqp_url, topology, tmp_path, env)
    try:
        await cluster.server()
        relay = await cluster.relay()
        worker = await _worker(cluster)
        tracer = provider.get_tracer("the caller")
        async with AsyncClient(cluster.address, cluster.key, tracing=True) as client:
            with tracer.start_as_current_span("caller") as span:
                sampled = await client.submit("trace.flaky", {}, max_attempts=3)
        async with AsyncClient(cluster.address, cluster.key) as client:
            unsampled = await client.submit("trace.flaky", {}, max_attempts=3)
            for job in (sampled, unsampled):
                assert (await client.wait(job.name, timeout=30)).state is JobState.SUCCEEDED
        rows = await cluster.query(
            "SELECT headers->>'traceparent' AS parent FROM outbox WHERE job_id = $1",
            uuid.UUID(unsampled.name.removeprefix("jobs/")),
        )
        (unsampled_trace,) = {r["parent"].split("-")[1] for r in rows}
        assert {int(r["parent"].split("-")[3], 16) & 1 for r in rows} == {0}  # not sampled
        traces = {
            sampled.name: f"{span.get_span_context().trace_id:032x}",
            unsampled.name: unsampled_trace,
        }
        wanted = ("job.dispatched", "job.received", "job.started", "job.completed")

        def logged() -> bool:
            events = [(r.get("job"), r.get("event")) for r in _json_lines(relay, worker)]
            return all((job, event) in events for job in traces for event in wanted)

        await _until(logged, "every line of both jobs")
        for name, trace_id in traces.items():
            lines = [r for r in _json_lines(relay, worker) if r.get("job") == name]
            names = [r["event"] for r in lines]
            assert names.count("job.dispatched") == 2, names  # the first attempt and the retry
            assert "job.retry_scheduled" in names, names
            assert [(r["event"], r.get("trace_id")) for r in lines] == [
                (r["event"], trace_id) for r in lines
            ]
    finally:
        await cluster.close()


@pytest.mark.parametrize(
    ("env", "fix"),
    [
        (
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "pip install opentelemetry-exporter-otlp-proto-grpc",
        ),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "set http/protobuf"),
        ({"OTEL_PROPAGATORS": "tracecontext,b3"}, "pip install opentelemetry-propagator-b3"),
    ],
    ids=["grpc", "http-json", "b3"],
)
async def test_what_no_installed_package_does_is_refused_in_one_line(
    database_url: str, env: dict[str, str], fix: str
) -> None:
    if "grpc" in fix and importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc"):
        pytest.fail("the OTLP/gRPC exporter is installed here: this case tests its absence")
    if "b3" in fix and importlib.util.find_spec("opentelemetry.propagators.b3"):
        pytest.fail("the B3 propagator is installed here: this case tests its absence")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        "relay",
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join((str(ROOT / "core"), str(ROOT))),
            "JOBPLANE_DATABASE_URL": database_url,
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
            **env,
        },
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    (line,) = out.decode().splitlines()
    assert process.returncode == 2
    assert line.startswith("error: ") and fix in line, line


@pytest.mark.parametrize("propagators", ["baggage", "none"])
async def test_a_server_without_tracecontext_reads_no_callers_traceparent(
    database_url: str,
    amqp_url: str,
    topology: Topology,
    tmp_path: Path,
    receiver: Receiver,
    caller: tuple[TracerProvider, InMemorySpanExporter],
    propagators: str,
) -> None:
    provider, _ = caller
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_PROPAGATORS": propagators,
    }
    cluster = await _cluster(database_url, amqp_url, topology, tmp_path, env)
    try:
        await cluster.server()
        tracer = provider.get_tracer("the caller")
        async with AsyncClient(cluster.address, cluster.key, tracing=True) as client:
            with tracer.start_as_current_span("caller") as span:
                await client.submit("trace.work", {"n": 1})
        caller_trace = f"{span.get_span_context().trace_id:032x}"
        await _until(
            lambda: any(s.name == SUBMIT for s in receiver.snapshot()), "the SubmitJob span"
        )
        (submit,) = [s for s in receiver.snapshot() if s.name == SUBMIT]
        # The SDK sent its traceparent; this server was told not to read one.
        assert submit.parent_id == ""
        assert submit.trace_id != caller_trace
    finally:
        await cluster.close()
