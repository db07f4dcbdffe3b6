"""The worker runtime, the relay, the sweeper and logging import no observability:
the process hands them their interceptors and registers the log lines' trace ids."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobplane import logs, process
from jobplane.config import Settings
from jobplane.observe import tracing
from jobplane.observe.metrics import NO_METRICS, Metrics, RelayMetrics, WorkerMetrics
from jobplane.store import observers
from jobplane.store.attempts import ClaimResult, ClaimStatus
from jobplane.store.machine import Transition
from jobplane.topology import Topology
from jobplane.workers import runtime
from jobplane.workers.interceptors import Interceptor, RelayInterceptor, chain, chain_relay
from jobplane.workers.sweeper import SweepReport
from tests.support.interceptors import Recording

_WORKERS = Path(runtime.__file__).parent


def _loaded(*modules: str) -> list[str]:
    """The jobplane modules a fresh interpreter loads for importing ``modules``."""
    program = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(json.dumps(sorted(m for m in sys.modules if m.startswith('jobplane.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    )
    loaded: list[str] = json.loads(out.stdout)
    return loaded


def _imports(path: Path) -> set[str]:
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return imported


@pytest.mark.parametrize(
    "module",
    [
        "runtime.py",
        "delivery.py",
        "attempt.py",
        "running.py",
        "recording.py",
        "progress.py",
        "interceptors.py",
        "relay.py",
        "relay_feed.py",
        "relay_link.py",
        "relay_messages.py",
        "relay_outbox.py",
        "relay_record.py",
        "sweeper.py",
    ],
)
def test_the_runtime_imports_no_observe(module: str) -> None:
    imported = _imports(_WORKERS / module)
    assert sorted(i for i in imported if i.startswith("jobplane.observe")) == []


def test_the_store_and_the_runtime_load_no_tracing_nor_metrics() -> None:
    loaded = _loaded("jobplane.store.jobs", "jobplane.store.sweeps", "jobplane.workers.runtime")
    assert "jobplane.workers.runtime" in loaded
    assert "jobplane.store.down" in loaded  # which imports describe_error from logs
    assert [m for m in loaded if m.startswith("jobplane.observe")] == []


def test_the_relay_and_the_sweeper_load_no_tracing_nor_metrics() -> None:
    loaded = _loaded("jobplane.workers.relay", "jobplane.workers.sweeper")
    assert {"jobplane.workers.relay", "jobplane.workers.sweeper"} <= set(loaded)
    assert [m for m in loaded if m.startswith("jobplane.observe")] == []


def test_logging_loads_no_tracing() -> None:
    loaded = _loaded("jobplane.logs")
    assert [m for m in loaded if m.startswith("jobplane.observe")] == []


@pytest.fixture
def unregistered() -> Iterator[None]:
    before = (observers.OBSERVER, logs._TRACE_IDS)
    observers.register(None)
    logs.register_trace_ids(None)
    yield
    observers.register(before[0])
    logs.register_trace_ids(before[1])


@pytest.mark.usefixtures("unregistered")
def test_the_process_registers_no_log_trace_ids_when_tracing_is_off() -> None:
    # On, configure_tracing registers them itself
    # (test_tracing_unit.py::test_configure_tracing_alone_traces_the_store_transitions).
    process._tracing("jobplane-test", Settings())
    assert logs._TRACE_IDS is None


def test_the_process_hands_its_worker_tracing_when_on_and_metrics_when_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert process._worker_interceptors(NO_METRICS) == []
    metrics = Metrics()
    (counting,) = process._worker_interceptors(metrics)
    assert isinstance(counting, WorkerMetrics) and counting.metrics is metrics
    monkeypatch.setattr(tracing, "ENABLED", True)
    traced, counting = process._worker_interceptors(metrics)
    assert isinstance(traced, tracing.WorkerTracing)
    assert isinstance(counting, WorkerMetrics)
    assert [type(i) for i in process._worker_interceptors(NO_METRICS)] == [tracing.WorkerTracing]


def test_the_process_hands_its_relay_tracing_when_on_and_metrics_when_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert process._relay_interceptors(NO_METRICS) == []
    metrics = Metrics()
    (counting,) = process._relay_interceptors(metrics)
    assert isinstance(counting, RelayMetrics) and counting.metrics is metrics
    monkeypatch.setattr(tracing, "ENABLED", True)
    traced, counting = process._relay_interceptors(metrics)
    assert isinstance(traced, tracing.RelayTracing)
    assert isinstance(counting, RelayMetrics)
    assert [type(i) for i in process._relay_interceptors(NO_METRICS)] == [tracing.RelayTracing]


def test_relay_interceptors_chain_in_order_and_the_traced_one_names_the_trace() -> None:
    trace = "1" * 32
    parent = f"00-{trace}-{'2' * 16}-00"  # not sampled: no span, the context goes on
    metrics = Metrics()
    one = RelayMetrics(metrics)
    assert chain_relay([]) is None
    assert chain_relay([one]) is one
    both: RelayInterceptor | None = chain_relay([tracing.RelayTracing(), one])
    assert both is not None
    assert both.trace_id({"traceparent": parent}) == trace
    assert both.trace_id({}) is None
    with both.publish(
        {"traceparent": parent},
        exchange="jobs",
        routing_key="demo.echo",
        message_id="m",
        job_id="j",
        tenant_id="t",
    ) as headers:
        assert headers == {"traceparent": parent}
    both.relayed("job_dispatch", "confirmed", 2)
    both.confirmed(0.5)
    both.batched(0.75)
    both.repaired(SweepReport(requeued=1, failed=0, stuck_outbox=0, republished=3))
    assert metrics.relay_published.labels("job_dispatch", "confirmed")._value.get() == 2
    assert metrics.relay_confirm._sum.get() == 0.5
    assert metrics.relay_dispatch._sum.get() == 0.75
    assert metrics.sweeper_repairs.labels("lease_requeued")._value.get() == 1
    assert metrics.sweeper_repairs.labels("dispatch_republished")._value.get() == 3


def test_no_interceptor_is_none_and_one_is_itself() -> None:
    seen: list[str] = []
    one = Recording("a", seen)
    assert chain([]) is None
    assert chain([one]) is one


async def test_a_chain_calls_each_in_order_the_first_outermost() -> None:
    seen: list[str] = []
    first = Recording("a", seen)
    each = [first, Recording("b", seen, run=False), Recording("c", seen)]
    both: Interceptor | None = chain(each)
    assert both is not None
    envelope, message = object(), object()
    found = ClaimResult(ClaimStatus.CLAIMED, None)

    async def claim() -> ClaimResult:
        seen.append("claim")
        return found

    both.known(lambda: (0, 2), Topology(queues=()), iter(["x", "y"]))
    with both.delivered({}):
        assert await both.claim(envelope, message, claim) is found  # type: ignore[arg-type]
    assert [r.claims for r in each] == [[(envelope, message)]] * 3
    run = both.started(object())  # type: ignore[arg-type]
    assert run is not None
    assert run.context() is first.contexts[0]  # the first run that gives one
    run.ended(ValueError())
    both.progress(0.5)
    with both.outcome(object()):  # type: ignore[arg-type]
        both.applied(Transition.SUCCEED)
    both.grouped("outcome", 3)
    both.submitted("fan.leaf", "leaves", 4)  # a fan-out's children
    both.ended(object(), "completed", 1.0)  # type: ignore[arg-type]
    assert seen == [
        *(f"{n}.known:(0, 2):x,y" for n in "abc"),
        *(f"{n}.delivered>" for n in "abc"),
        *(f"{n}.claim>" for n in "abc"),
        "claim",
        *(f"{n}.{w}" for n in "cba" for w in ("claimed:claimed", "<claim")),
        *(f"{n}.<delivered" for n in "cba"),
        *(f"{n}.started" for n in "abc"),
        "a.context",
        "c.run.ended:ValueError",
        "a.run.ended:ValueError",
        *(f"{n}.progress:0.5" for n in "abc"),
        *(f"{n}.outcome>" for n in "abc"),
        *(f"{n}.applied:succeed" for n in "abc"),
        *(f"{n}.<outcome" for n in "cba"),
        *(f"{n}.grouped:outcome:3" for n in "abc"),
        *(f"{n}.submitted:fan.leaf:leaves:4" for n in "abc"),
        *(f"{n}.ended:completed" for n in "abc"),
    ]
