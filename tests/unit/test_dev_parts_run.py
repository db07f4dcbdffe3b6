"""The parts of ``jobplane dev --processes N`` (``--worker-part`` and ``--relay-part``)
run in this process: the worker, relay and sweeper each builds from its options and
the environment, how it runs them until its parent is gone, and its exit codes."""

from __future__ import annotations

import os

import pytest

from jobplane.blobs import BlobStore
from jobplane.observe.metrics import RelayMetrics, WorkerMetrics
from jobplane.server import dev, devparts
from jobplane.server.devparts import GRACE, part_queues
from tests.support.commands import DEMOS, ENV, HERE, MAINTENANCE, CommandRun, armed, environment


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> CommandRun:
    environment(monkeypatch, ENV)
    return CommandRun(monkeypatch, devparts, {"dev": dev._dev})


def _not_ready(run: CommandRun) -> dict[str, str]:
    assert run.ready is not None
    status, body = run.ready
    assert status == 503
    not_ready: dict[str, str] = body["not_ready"]
    return not_ready


def test_worker_part_zero_runs_every_handler_on_every_queue(run: CommandRun) -> None:
    argv = ["dev", "--worker-part", "0", "--parent-pid", "4321", "--concurrency", "7"]
    assert run([*argv, "--handlers", f"{HERE}:registry"]) == 0
    worker = run.of("Worker")
    engine, database_url, amqp_url, topology, handlers = worker.args
    assert engine.pool.size() == 6
    assert (database_url, amqp_url) == (ENV["JOBPLANE_DATABASE_URL"], ENV["JOBPLANE_AMQP_URL"])
    assert [q.name for q in topology.queues] == ["jobplane.default"]
    assert set(handlers) == DEMOS | MAINTENANCE | {"tests.render"}
    kw = dict(worker.kwargs)
    db, blobs = kw.pop("db"), kw.pop("blobs")
    assert (db.size, type(blobs)) == (7, BlobStore)
    assert [type(i) for i in kw.pop("interceptors")] == [WorkerMetrics]
    assert kw == {
        "concurrency": 7,
        "queues": None,
        "max_result_bytes": 300000,
        "inline_bytes": 64 * 1024,
        "sync_threads": 3,
        "listen_url": ENV["JOBPLANE_DATABASE_DIRECT_URL"],
    }
    ((made, kept),) = run.maintenance
    assert made == (engine, db)
    assert kept["blobs"] is blobs and armed(kept["faults"]) and kept["index"] is not None
    # Served until its parent (the command) is gone, then stopped within GRACE.
    assert (run.parent, worker.calls) == ([4321], ["start", ("stop", GRACE)])
    assert run.traced == ["jobplane-dev"]
    assert _not_ready(run)["broker"] == "the stand-in does not consume"
    assert 'jobplane_db_pool_connections{state="size"} 6.0' in run.metrics
    assert run.args.stopped_in_order


def test_later_worker_parts_leave_maintenance_and_ingest_to_part_zero(run: CommandRun) -> None:
    assert run(["dev", "--worker-part", "1", "--parent-pid", "4321", "--ingest", "a.md"]) == 0
    worker = run.of("Worker")
    assert set(worker.args[4]) == DEMOS
    assert worker.kwargs["queues"] == part_queues(worker.args[3])
    assert run.maintenance == []


def test_worker_part_zero_without_maintenance_or_metrics(run: CommandRun) -> None:
    argv = ["dev", "--worker-part", "0", "--no-maintenance", "--metrics-listen", "off"]
    assert run(argv) == 0
    worker = run.of("Worker")
    assert set(worker.args[4]) == DEMOS
    assert (worker.kwargs["interceptors"], run.ops, run.ready) == ([], [None], None)
    # No --parent-pid: the process that started it is the parent.
    assert run.parent == [os.getppid()]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--handlers", f"{HERE}:nothing_here"], f"module '{HERE}' has no attribute"),
        (["--handlers", f"{HERE}:clashing"], "(run the worker with --no-maintenance)"),
        (["--ingest", "no/such.md"], "error: --ingest: no such file: no/such.md"),
    ],
    ids=["missing", "clashing", "no-file"],
)
def test_a_worker_part_that_cannot_load_its_handlers_exits_2(
    run: CommandRun, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert run(["dev", "--worker-part", "0", *argv]) == 2
    assert says in capsys.readouterr().err
    assert run.made == []


def test_the_relay_part_runs_the_relay_and_the_sweeper(run: CommandRun) -> None:
    assert run(["dev", "--relay-part", "--parent-pid", "4321"]) == 0
    assert run.args.tenant == "dev"  # the key dev prints is the dev tenant's
    relay, sweeper = run.of("Relay"), run.of("Sweeper")
    engine, database_url, amqp_url, topology = relay.args
    assert engine.pool.size() == 6
    assert (database_url, amqp_url) == (ENV["JOBPLANE_DATABASE_URL"], ENV["JOBPLANE_AMQP_URL"])
    kw = dict(relay.kwargs)
    faults, observed = kw.pop("faults"), kw.pop("interceptors")
    assert armed(faults) and [type(i) for i in observed] == [RelayMetrics]
    assert (kw.pop("db").size, kw) == (
        6,
        {"in_flight": 4, "listen_url": ENV["JOBPLANE_DATABASE_DIRECT_URL"]},
    )
    assert sweeper.args == (engine,)
    assert sweeper.kwargs == {"topology": topology, "interceptors": observed, "faults": faults}
    assert (run.parent, relay.calls, sweeper.calls) == (
        [4321],
        ["start", ("stop",)],
        ["enter", "exit"],
    )
    assert run.traced == ["jobplane-dev"]
    assert "relay" not in _not_ready(run)
    assert run.unready is not None
    assert run.unready[1]["not_ready"]["relay"] == "no broker channel"
    assert 'jobplane_db_pool_connections{state="size"} 6.0' in run.metrics
    assert run.args.stopped_in_order


def test_the_relay_part_takes_its_metrics_listen_over_the_environment(run: CommandRun) -> None:
    assert run(["dev", "--relay-part", "--metrics-listen", "off"]) == 0
    assert (run.ops, run.of("Relay").kwargs["interceptors"]) == ([None], [])
