"""``jobplane worker``, ``relay`` and ``sweep`` run in this process: what their options
and the environment become (the worker, relay and sweeper each builds, and how it
runs and stops them), their readiness checks, exit codes and what they print.

The long-running parts are stand-ins recording how they were made; the engine,
pools and ops listener are real (nothing connects until a part would use them)."""

from __future__ import annotations

from typing import Any

import pytest

from jobplane.blobs import BlobStore
from jobplane.config import DEFAULT_WORKER_CONCURRENCY
from jobplane.observe.metrics import RelayMetrics, WorkerMetrics
from jobplane.workers import cli
from jobplane.workers.fairness import FairSettings
from jobplane.workers.runtime import worker_pool_size
from tests.support.commands import (
    DEMOS,
    ENV,
    HERE,
    MAINTENANCE,
    CommandRun,
    Part,
    armed,
    environment,
)


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> CommandRun:
    environment(monkeypatch, ENV)
    return CommandRun(
        monkeypatch, cli, {"worker": cli._worker, "relay": cli._relay, "sweep": cli._sweep}
    )


def test_worker_builds_its_worker_from_the_options_and_the_environment(run: CommandRun) -> None:
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
    assert armed(kw.pop("faults"))
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


def test_worker_defaults_run_the_demos_and_maintenance_on_every_queue(run: CommandRun) -> None:
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


def test_worker_with_demo_and_no_maintenance_loads_those_handlers(run: CommandRun) -> None:
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
    run: CommandRun, capsys: pytest.CaptureFixture[str], spec: str, says: str
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


def _check_relay(relay: Part, interceptors: list[type[Any]]) -> dict[str, Any]:
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
    assert armed(kw.pop("faults"))
    assert [type(i) for i in kw.pop("interceptors")] == interceptors
    # At most JOBPLANE_DB_POOL_SIZE (9), no more than the relay uses (6): 4 batches.
    assert (kw.pop("db").size, kw.pop("in_flight")) == (6, 4)
    assert kw == {
        "unroutable_after": 30.0,
        "fair": FAIR,
        "listen_url": "postgresql://jp:pw@127.0.0.1:2/jp_direct",
    }
    return relay.kwargs


def test_relay_builds_its_relay_and_sweeper_from_the_options(run: CommandRun) -> None:
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
    # Ready but for the database while the relay has its channel; not without it.
    assert run.ready is not None and run.unready is not None
    assert (run.ready[0], sorted(run.ready[1]["not_ready"])) == (503, ["database"])
    assert run.unready[1]["not_ready"]["broker"] == "no broker channel"


def test_relay_defaults_and_no_sweep(run: CommandRun) -> None:
    assert run(["relay", "--no-sweep", "--no-fair", "--metrics-listen", "off"]) == 0
    relay = run.of("Relay")
    assert (relay.kwargs["unroutable_after"], relay.kwargs["interceptors"]) == (300.0, [])
    assert relay.kwargs["fair"] == FairSettings(enabled=False)
    assert [p.kind for p in run.made] == ["Relay"]
    assert (relay.calls, run.ops, run.ready) == (["start", ("stop",)], [None], None)


def test_relay_defaults_of_its_sweeper(run: CommandRun) -> None:
    assert run(["relay"]) == 0
    kw = run.of("Sweeper").kwargs
    assert (kw["lease_grace"], kw["republish_after"], kw["interval"]) == (5.0, 600.0, 5.0)


def test_relay_refuses_credit_settings_that_cannot_work(run: CommandRun) -> None:
    with pytest.raises(SystemExit) as stopped:
        run(["relay", "--credit-min", "10", "--credit-max", "5"])
    assert str(stopped.value).startswith("error: ")


def test_sweep_once_runs_one_pass_and_says_what_it_did(
    run: CommandRun, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run([*_relay_argv("sweep"), "--once"]) == 0
    assert run.args.interval == 5.0  # between passes of the loop, and their retries
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


def test_sweep_loop_serves_and_ticks_until_stopped(run: CommandRun) -> None:
    assert run(["sweep", "--interval", "0.01", "--no-fair"]) == 0
    assert run.of("Relay").kwargs["fair"] == FairSettings(enabled=False)
    assert run.of("Sweeper").calls == ["sweep_once"]
    # The schedules and the deadlines run on clocks of their own, stopped at the end.
    assert run.of("Scheduler").calls == ["start", ("stop",)]
    assert run.of("Deadlines").calls == ["start", ("stop",)]
    assert run.of("Relay").calls == ["drain_once"]
    assert run.ops != [] and run.ops[0] is not None
