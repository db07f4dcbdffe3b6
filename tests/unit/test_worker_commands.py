"""``jobplane worker``, ``relay`` and ``sweep`` run in this process: what their options
and the environment become (the worker, relay and sweeper each builds, and how it
runs and stops them), their readiness checks, exit codes and what they print.

The long-running parts are stand-ins recording how they were made; the engine,
pools and ops listener are real (nothing connects until a part would use them)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from jobplane.blobs import BlobStore
from jobplane.cli import build_parser
from jobplane.config import DEFAULT_WORKER_CONCURRENCY
from jobplane.faults import FaultPoints, InjectedFault
from jobplane.observe.metrics import RelayMetrics, WorkerMetrics
from jobplane.process import _run, _start_ops
from jobplane.workers import cli
from jobplane.workers.fairness import FairSettings
from jobplane.workers.handlers import JobContext, Registry
from jobplane.workers.maintenance import Maintenance
from jobplane.workers.runtime import worker_pool_size

#: Handlers ``--handlers tests.unit.test_worker_commands:registry`` loads.
registry = Registry()


@registry.handler("tests.render")
async def _render(ctx: JobContext) -> dict[str, Any]:
    return {}


#: Handlers that register a maintenance type of their own.
clashing = Registry()


@clashing.handler("maintenance.retention")
async def _retention(ctx: JobContext) -> dict[str, Any]:
    return {}


HERE = "tests.unit.test_worker_commands"
DEMOS = {"demo.echo", "demo.progress", "demo.fail"}
MAINTENANCE = {"maintenance.retention", "maintenance.erasure"}


class _Part:
    """A worker, relay, sweeper or scheduler that records how it was made and run."""

    def __init__(self, kind: str, made: list[_Part], *args: Any, **kwargs: Any) -> None:
        self.kind, self.args, self.kwargs = kind, args, kwargs
        self.calls: list[Any] = []
        self.connected = False
        self.scheduler: _Part | None = None
        self.deadlines: _Part | None = None
        self.drained = asyncio.Event()
        made.append(self)

    async def start(self) -> None:
        self.calls.append("start")

    async def stop(self, *grace: float) -> None:
        self.calls.append(("stop", *grace))

    def not_ready(self) -> str | None:
        return "the stand-in does not consume"

    async def sweep_once(self) -> Any:
        self.calls.append("sweep_once")
        return SimpleNamespace(requeued=1, failed=2, republished=3, stuck_outbox=4)

    async def tick_once(self) -> None:
        self.calls.append("tick_once")

    async def drain_once(self) -> int:
        self.calls.append("drain_once")
        self.drained.set()
        return 5

    async def __aenter__(self) -> _Part:
        self.calls.append("enter")
        return self

    async def __aexit__(self, *_: object) -> None:
        self.calls.append("exit")


class _Run:
    """One command run in this process, with the parts it made and its /readyz."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list[_Part] = []
        self.ready: tuple[int, dict[str, Any]] | None = None
        self.metrics = ""
        self.ops: list[Any] = []
        self.traced: list[str] = []
        self.maintenance: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._monkeypatch = monkeypatch
        for module, name in (
            ("jobplane.workers.runtime", "Worker"),
            ("jobplane.workers.relay", "Relay"),
            ("jobplane.workers.sweeper", "Sweeper"),
        ):
            monkeypatch.setattr(f"{module}.{name}", self._maker(name))
        monkeypatch.setattr(
            "jobplane.observe.tracing.configure_tracing", lambda name, _: self.traced.append(name)
        )
        maintenance = Maintenance

        def made(*args: Any, **kwargs: Any) -> Maintenance:
            self.maintenance.append((args, kwargs))
            return maintenance(*args, **kwargs)

        monkeypatch.setattr("jobplane.workers.maintenance.Maintenance", made)
        monkeypatch.setattr(cli, "_until_signal", self._served)
        monkeypatch.setattr(cli, "_stop_signals", self._stop_after_a_drain)
        start_ops = _start_ops

        async def started(stack: Any, ops: Any) -> None:
            self.ops.append(ops)
            await start_ops(stack, ops)

        monkeypatch.setattr(cli, "_start_ops", started)

    @contextlib.contextmanager
    def _stop_after_a_drain(self) -> Iterator[asyncio.Event]:
        """The loop of ``sweep`` stops (as at a SIGTERM) once its relay drained once."""
        yield self.of("Relay").drained

    def _maker(self, kind: str) -> Callable[..., _Part]:
        def make(*args: Any, **kwargs: Any) -> _Part:
            part = _Part(kind, self.made, *args, **kwargs)
            if kind == "Sweeper":
                part.scheduler = _Part("Scheduler", self.made)
                part.deadlines = _Part("Deadlines", self.made)
            return part

        return make

    async def _served(self) -> None:
        """While the command serves: what its ops listener says of readiness."""
        ops = self.ops[-1]
        if ops is None:
            return
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://{ops.address}/readyz") as answer,
        ):
            self.ready = (answer.status, json.loads(await answer.read()))
            async with session.get(f"http://{ops.address}/metrics") as scraped:
                self.metrics = await scraped.text()

    def of(self, kind: str) -> _Part:
        (part,) = (p for p in self.made if p.kind == kind)
        return part

    def __call__(self, argv: list[str]) -> int:
        args = build_parser({argv[0]}).parse_args(argv)
        return _run(_COMMANDS[argv[0]](args))


_COMMANDS: dict[str, Callable[[argparse.Namespace], Any]] = {
    "worker": cli._worker,
    "relay": cli._relay,
    "sweep": cli._sweep,
}


def _armed(faults: FaultPoints) -> bool:
    """Whether JOBPLANE_FAULTS's point reached ``faults``."""
    try:
        faults.hit("relay.after_publish")
    except InjectedFault:
        return True
    return False


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> _Run:
    # Addresses nothing answers on: no part here connects to them.
    for name, value in {
        "JOBPLANE_DATABASE_URL": "postgresql://jp:pw@127.0.0.1:1/jp_nowhere",
        "JOBPLANE_DATABASE_DIRECT_URL": "postgresql://jp:pw@127.0.0.1:2/jp_direct",
        "JOBPLANE_AMQP_URL": "amqp://guest:guest@127.0.0.1:3/",
        "JOBPLANE_METRICS_LISTEN": "127.0.0.1:0",
        "JOBPLANE_MAX_PAYLOAD_BYTES": "300000",
        "JOBPLANE_SYNC_THREADS": "3",
        "JOBPLANE_DB_POOL_SIZE": "9",
        "JOBPLANE_DB_ENGINE_POOL_SIZE": "6",
        "JOBPLANE_FAULTS": "relay.after_publish",
        "JOBPLANE_S3_URL": "http://127.0.0.1:4",
        "JOBPLANE_QDRANT_URL": "http://127.0.0.1:5",
    }.items():
        monkeypatch.setenv(name, value)
    return _Run(monkeypatch)


def test_worker_builds_its_worker_from_the_options_and_the_environment(run: _Run) -> None:
    argv = ["worker", "--handlers", f"{HERE}:registry", "--concurrency", "7", "--prefetch", "11"]
    argv += ["--reserve", "2", "--queue", "default", "--queue", "bulk", "--grace", "4.5"]
    argv += ["--lease-seconds", "12", "--group-window", "250", "--group-max", "9"]
    assert run(argv) == 0
    worker = run.of("Worker")
    engine, database_url, amqp_url, topology, handlers = worker.args
    assert str(engine.url) == "postgresql+asyncpg://jp:***@127.0.0.1:1/jp_nowhere"
    assert engine.pool.size() == 6
    assert database_url == "postgresql://jp:pw@127.0.0.1:1/jp_nowhere"
    assert amqp_url == "amqp://guest:guest@127.0.0.1:3/"
    assert [q.name for q in topology.queues] == ["jobplane.default"]
    # --handlers alone: its handlers and maintenance's, not the demos.
    assert set(handlers) == {"tests.render"} | MAINTENANCE
    kw = dict(worker.kwargs)
    assert _armed(kw.pop("faults"))
    db, blobs = kw.pop("db"), kw.pop("blobs")
    assert (db.size, type(blobs)) == (7, BlobStore)
    assert [type(i) for i in kw.pop("interceptors")] == [WorkerMetrics]
    assert kw == {
        "concurrency": 7,
        "prefetch": 11,
        "reserve": 2,
        "queues": ["default", "bulk"],
        "lease_seconds": 12.0,
        "group_window": 0.25,
        "group_max": 9,
        "max_result_bytes": 300000,
        "inline_bytes": 64 * 1024,
        "sync_threads": 3,
        "listen_url": "postgresql://jp:pw@127.0.0.1:2/jp_direct",
    }
    # Maintenance runs on the worker's own engine, pool, blobs, faults and the index.
    ((made, kept),) = run.maintenance
    assert made == (engine, db)
    assert (kept["blobs"], kept["faults"]) == (blobs, worker.kwargs["faults"])
    assert kept["index"] is not None
    # Started, then served until a signal, then stopped with --grace.
    assert worker.calls == ["start", ("stop", 4.5)]
    assert run.traced == ["jobplane-worker"]
    # Its ops listener reports the engine's pool.
    assert 'jobplane_db_pool_connections{state="size"} 6.0' in run.metrics
    assert run.ready is not None
    status, body = run.ready
    assert (status, sorted(body["not_ready"])) == (503, ["broker", "database"])
    assert body["not_ready"]["broker"] == "the stand-in does not consume"


def test_worker_defaults_run_the_demos_and_maintenance_on_every_queue(run: _Run) -> None:
    assert run(["worker", "--metrics-listen", "off"]) == 0
    worker = run.of("Worker")
    assert set(worker.args[4]) == DEMOS | MAINTENANCE
    kw = worker.kwargs
    assert (kw["concurrency"], kw["prefetch"], kw["reserve"], kw["queues"]) == (
        DEFAULT_WORKER_CONCURRENCY,
        None,
        None,
        None,
    )
    assert (kw["lease_seconds"], kw["group_window"], kw["group_max"]) == (30.0, 0.002, 64)
    assert kw["db"].size == min(9, worker_pool_size(DEFAULT_WORKER_CONCURRENCY))
    # No ops listener: nothing observes the worker, and no /readyz.
    assert (kw["interceptors"], run.ops, run.ready) == ([], [None], None)
    assert worker.calls == ["start", ("stop", 10.0)]


def test_worker_with_demo_and_no_maintenance_loads_those_handlers(run: _Run) -> None:
    argv = ["worker", "--handlers", f"{HERE}:registry", "--demo", "--no-maintenance"]
    assert run(argv) == 0
    assert set(run.of("Worker").args[4]) == DEMOS | {"tests.render"}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (f"{HERE}:nothing_here", f"error: module '{HERE}' has no attribute 'nothing_here'"),
        (f"{HERE}:clashing", "(run the worker with --no-maintenance)"),
    ],
    ids=["missing", "clashing"],
)
def test_worker_says_why_its_handlers_cannot_load_and_exits_2(
    run: _Run, capsys: pytest.CaptureFixture[str], spec: str, says: str
) -> None:
    assert run(["worker", "--handlers", spec]) == 2
    assert says in capsys.readouterr().err
    assert run.made == []


def _relay_argv(command: str) -> list[str]:
    return [
        command,
        "--lease-grace",
        "7",
        "--republish-after",
        "60",
        "--unroutable-after",
        "30",
        "--credit-min",
        "3",
        "--credit-per-consumer",
        "2",
        "--credit-horizon",
        "1.5",
        "--credit-max",
        "50",
    ]


FAIR = FairSettings(
    enabled=True, min_backlog=3, per_consumer=2, horizon_seconds=1.5, max_backlog=50
)


def _check_relay(relay: _Part, interceptors: list[type[Any]]) -> dict[str, Any]:
    """The relay's arguments as ``jobplane relay`` and ``sweep`` make it, but what differs."""
    engine, database_url, amqp_url, topology = relay.args
    assert str(engine.url) == "postgresql+asyncpg://jp:***@127.0.0.1:1/jp_nowhere"
    assert engine.pool.size() == 6
    assert (database_url, amqp_url) == (
        "postgresql://jp:pw@127.0.0.1:1/jp_nowhere",
        "amqp://guest:guest@127.0.0.1:3/",
    )
    assert [q.name for q in topology.queues] == ["jobplane.default"]
    kw = dict(relay.kwargs)
    assert _armed(kw.pop("faults"))
    assert [type(i) for i in kw.pop("interceptors")] == interceptors
    # At most JOBPLANE_DB_POOL_SIZE (9), no more than the relay uses (6): 4 batches.
    assert (kw.pop("db").size, kw.pop("in_flight")) == (6, 4)
    assert kw == {
        "unroutable_after": 30.0,
        "fair": FAIR,
        "listen_url": "postgresql://jp:pw@127.0.0.1:2/jp_direct",
    }
    return relay.kwargs


def test_relay_builds_its_relay_and_sweeper_from_the_options(run: _Run) -> None:
    assert run([*_relay_argv("relay"), "--sweep-interval", "2.5"]) == 0
    relay_kw = _check_relay(run.of("Relay"), [RelayMetrics])
    sweeper = run.of("Sweeper")
    assert sweeper.args == (run.of("Relay").args[0],)
    assert sweeper.kwargs == {
        "topology": run.of("Relay").args[3],
        "lease_grace": 7.0,
        "republish_after": 60.0,
        "interceptors": relay_kw["interceptors"],
        "interval": 2.5,
        "faults": relay_kw["faults"],
    }
    assert run.of("Relay").calls == ["start", ("stop",)]
    assert sweeper.calls == ["enter", "exit"]
    assert run.traced == ["jobplane-relay"]
    assert 'jobplane_db_pool_connections{state="size"} 6.0' in run.metrics
    assert run.ready is not None
    status, body = run.ready
    assert (status, sorted(body["not_ready"])) == (503, ["broker", "database"])
    assert body["not_ready"]["broker"] == "no broker channel"


def test_relay_defaults_and_no_sweep(run: _Run) -> None:
    assert run(["relay", "--no-sweep", "--no-fair", "--metrics-listen", "off"]) == 0
    relay = run.of("Relay")
    assert (relay.kwargs["unroutable_after"], relay.kwargs["interceptors"]) == (300.0, [])
    assert relay.kwargs["fair"] == FairSettings(enabled=False)
    assert [p.kind for p in run.made] == ["Relay"]
    assert (relay.calls, run.ops, run.ready) == (["start", ("stop",)], [None], None)


def test_relay_defaults_of_its_sweeper(run: _Run) -> None:
    assert run(["relay"]) == 0
    kw = run.of("Sweeper").kwargs
    assert (kw["lease_grace"], kw["republish_after"], kw["interval"]) == (5.0, 600.0, 5.0)


def test_relay_refuses_credit_settings_that_cannot_work(run: _Run) -> None:
    with pytest.raises(SystemExit) as stopped:
        run(["relay", "--credit-min", "10", "--credit-max", "5"])
    assert str(stopped.value).startswith("error: ")


def test_sweep_once_runs_one_pass_and_says_what_it_did(
    run: _Run, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run([*_relay_argv("sweep"), "--once"]) == 0
    relay_kw = _check_relay(run.of("Relay"), [])
    sweeper = run.of("Sweeper")
    interceptors = sweeper.kwargs.pop("interceptors")
    assert sweeper.kwargs == {
        "topology": run.of("Relay").args[3],
        "lease_grace": 7.0,
        "republish_after": 60.0,
        "faults": relay_kw["faults"],
    }
    assert [type(i) for i in interceptors] == [RelayMetrics]
    # One pass: swept, the schedules ticked once, the outbox drained; nothing served.
    assert sweeper.calls == ["sweep_once"]
    assert (run.of("Scheduler").calls, run.of("Deadlines").calls) == (["tick_once"], [])
    assert run.of("Relay").calls == ["drain_once"]
    assert (run.ops, run.traced) == ([], ["jobplane-sweep"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "leases: 1 requeued, 2 failed; dispatches: 3 re-published; "
        "outbox: 5 published, 4 were stuck"
    )


def test_sweep_loop_serves_and_ticks_until_stopped(run: _Run) -> None:
    assert run(["sweep", "--interval", "0.01", "--no-fair"]) == 0
    assert run.of("Relay").kwargs["fair"] == FairSettings(enabled=False)
    assert run.of("Sweeper").calls == ["sweep_once"]
    # The schedules and the deadlines run on clocks of their own, stopped at the end.
    assert run.of("Scheduler").calls == ["start", ("stop",)]
    assert run.of("Deadlines").calls == ["start", ("stop",)]
    assert run.of("Relay").calls == ["drain_once"]
    assert run.ops != [] and run.ops[0] is not None
