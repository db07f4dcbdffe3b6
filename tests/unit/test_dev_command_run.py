"""``jobplane dev`` run in this process: the server, relay, sweeper, worker (or parts)
and dashboard it builds from its options and the environment, the order it starts
and stops them in, its readiness checks, the lines that say it is up (text and
JSON), its exit codes, and a second Ctrl-C.

The server is a real JobplaneServer whose start and stop bind nothing; the worker,
relay, sweeper, child processes, dashboard and whatever would reach Postgres or the
broker are stand-ins recording their calls."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from jobplane.blobs import BlobStore
from jobplane.config import parse_listen
from jobplane.errors import JobplaneError
from jobplane.observe.metrics import RelayMetrics, WorkerMetrics
from jobplane.server import dev, devparts
from jobplane.server.dashboard import Backend
from jobplane.server.devparts import GRACE
from jobplane.workers.relay import relay_in_flight
from tests.support.commands import DEMOS, ENV, HERE, MAINTENANCE, CommandRun, armed, environment
from tests.support.logs import assert_answers
from tests.support.server_commands import PORT, ServerRun, readyz

ADDRESS = f"127.0.0.1:{PORT}"
PIDS = [4101, 4102, 4103]


class Parts:
    """Child processes of ``dev --processes N`` that record how they were run."""

    def __init__(self, run: DevRun, commands: list[list[str]], names: list[str]) -> None:
        self.commands, self.names = commands, names
        self.calls: list[str] = []
        self._exit, self._log = run.part_exit, run.server.calls
        run.parts.append(self)

    @property
    def pids(self) -> list[int]:
        return PIDS[: len(self.commands)]

    async def start(self) -> None:
        self.calls.append("start")
        self._log.append("parts.start")

    async def stop(self) -> None:
        self.calls.append("stop")
        self._log.append("parts.stop")

    def kill(self) -> None:
        self.calls.append("kill")

    def not_ready(self) -> str | None:
        return "a part stand-in"

    async def exited(self) -> tuple[str, int]:
        if self._exit is None:
            await asyncio.Event().wait()
        assert self._exit is not None
        return self._exit


class DevRun:
    """``jobplane dev`` run in this process (``run(argv)``) and what it made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        environment(monkeypatch, {**ENV, "JOBPLANE_LISTEN": "127.0.0.1:0"})
        self.command = CommandRun(monkeypatch, dev, {"dev": dev._dev})
        self.server = ServerRun(monkeypatch, self.command.ops, stop_at_serving=False)
        self.parts: list[Parts] = []
        self.part_exit: tuple[str, int] | None = None
        self.ready: list[tuple[int, dict[str, Any]]] = []
        self.settled = 0
        record = self.server.record
        monkeypatch.setattr(dev, "_stop_signals", self.server.stop_signals)
        monkeypatch.setattr("jobplane.store.engine.migrate", record("migrate"))
        monkeypatch.setattr("jobplane.topology.apply", record("apply"))
        monkeypatch.setattr(devparts, "Parts", lambda *a: Parts(self, *a))
        monkeypatch.setattr("jobplane.heap.settle", self._settle)
        monkeypatch.setattr("jobplane.store.keys.KeyStore.create_key", self._create_key)
        worker_key = SimpleNamespace(key="jp_worker_key")
        monkeypatch.setattr("jobplane.store.keys.KeyStore.create_worker", record("wk", worker_key))

    async def _create_key(self, *keys_and_tenant: Any) -> tuple[str, uuid.UUID]:
        """Once everything started: the key, and what /readyz says then and once
        every stand-in lost its broker."""
        tenant = keys_and_tenant[-1]
        self.server.calls.append(("key", (tenant,), {}))
        ops = self.server.ops
        if ops is not None:
            self.ready.append(await readyz(ops))
            for part in self.command.made:
                part.connected = False
            self.ready.append(await readyz(ops))
        return "jp_api_key", uuid.uuid4()

    def _settle(self) -> None:
        """``dev`` says it serves: a Ctrl-C then (unless a part exits first)."""
        self.settled += 1
        if self.part_exit is None:
            self.server.stop.set()

    def __call__(self, argv: list[str]) -> int:
        return self.command(argv)


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> DevRun:
    return DevRun(monkeypatch)


def _up_lines(processes: str, dashboard: str | None = "http://127.0.0.1:8080/") -> str:
    ui = f"  dashboard: {dashboard}   (sign in with the api key)\n" if dashboard else ""
    return (
        f"\njobplane dev is up.\n"
        f"  address:  {ADDRESS}\n"
        f"  processes: {processes}\n"
        f"  api key:  jp_api_key   (tenant 'dev')\n"
        f"{ui}"
        f"  worker key: jp_worker_key   (WorkerService, docs/workers.md)\n\n"
        f"  export JOBPLANE_ADDRESS={ADDRESS} JOBPLANE_API_KEY=jp_api_key\n"
        f"  {dev._jobplane_command()} submit demo.progress"
        f' --payload \'{{"steps": 20, "interval_ms": 150}}\' --watch\n\n'
        "serving; Ctrl-C to stop\n"
    )


def test_dev_in_one_process_runs_everything_here(
    run: DevRun, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["dev", "--processes", "1", "--concurrency", "5", "--handlers", f"{HERE}:registry"]
    assert run(argv) == 0
    made = run.command
    assert made.traced == ["jobplane-dev"]
    ((direct,), _) = run.server.of("migrate")
    assert direct == ENV["JOBPLANE_DATABASE_DIRECT_URL"]
    (amqp_url, topology), _ = run.server.of("apply")
    assert (amqp_url, [q.name for q in topology.queues]) == (
        ENV["JOBPLANE_AMQP_URL"],
        ["jobplane.default"],
    )
    server = run.server.server
    assert server.address == ADDRESS and server._tls is None
    assert (server.db.size, type(server.blobs)) == (9, BlobStore)
    assert server.service.metrics.enabled
    # The worker shares the server's engine, pool and object store.
    worker = made.of("Worker")
    engine, database_url, amqp, topology_, handlers = worker.args
    assert (engine.pool.size(), database_url, amqp) == (
        6,
        ENV["JOBPLANE_DATABASE_URL"],
        ENV["JOBPLANE_AMQP_URL"],
    )
    assert topology_ is topology and set(handlers) == DEMOS | MAINTENANCE | {"tests.render"}
    kw = dict(worker.kwargs)
    assert (kw.pop("db"), kw.pop("blobs")) == (server.db, server.blobs)
    assert [type(i) for i in kw.pop("interceptors")] == [WorkerMetrics]
    assert kw == {
        "concurrency": 5,
        "queues": None,
        "max_result_bytes": 300000,
        "inline_bytes": 64 * 1024,
        "sync_threads": 3,
        "listen_url": ENV["JOBPLANE_DATABASE_DIRECT_URL"],
    }
    ((on, kept),) = made.maintenance
    assert on == (engine, server.db) and kept["blobs"] is server.blobs and armed(kept["faults"])
    # The relay and sweeper too, on the same pool.
    relay, sweeper = made.of("Relay"), made.of("Sweeper")
    assert relay.args == (engine, ENV["JOBPLANE_DATABASE_URL"], ENV["JOBPLANE_AMQP_URL"], topology)
    rkw = dict(relay.kwargs)
    faults, observed = rkw.pop("faults"), rkw.pop("interceptors")
    assert armed(faults) and [type(i) for i in observed] == [RelayMetrics]
    assert rkw == {
        "db": server.db,
        "in_flight": relay_in_flight(9),
        "listen_url": ENV["JOBPLANE_DATABASE_DIRECT_URL"],
    }
    assert (sweeper.args, sweeper.kwargs) == (
        (engine,),
        {"topology": topology, "interceptors": observed, "faults": faults},
    )
    # Started server first, stopped within GRACE.
    assert [c for c in run.server.calls if c in (("start", True), ("stop", GRACE))] == [
        ("start", True),
        ("stop", GRACE),
    ]
    assert relay.calls == ["start", ("stop",)]
    assert sweeper.calls == ["enter", "exit"]
    assert worker.calls == ["start", ("stop", GRACE)]
    assert run.server.signals == [{"settle": False, "again": run.server.signals[0]["again"]}]
    # The dashboard (on by default) shares the server's services.
    board = run.server.board
    assert board.backend == Backend.of_server(server, ENV["JOBPLANE_AMQP_URL"])
    assert (board.kwargs["listen"], board.kwargs["setting"]) == (
        parse_listen("127.0.0.1:8080"),
        "JOBPLANE_UI_LISTEN",
    )
    assert run.server.of("key")[0] == ("dev",)
    assert capsys.readouterr().out == _up_lines(
        "1 (server, relay and worker in this one, --processes 1)"
    )
    assert made.args.stopped_in_order


def test_dev_readiness_checks_its_server_relay_and_worker(run: DevRun) -> None:
    assert run(["dev", "--processes", "1", "--ui-listen", "off"]) == 0
    (status, body), (_, lost) = run.ready
    assert status == 503
    assert body["not_ready"] == {
        "database": body["not_ready"]["database"],
        "worker": "the stand-in does not consume",
    }
    assert lost["not_ready"]["relay"] == "no broker channel"
    # SERVING once started: the gRPC check passes.
    assert "grpc" not in lost["not_ready"]
    assert run.server.boards == []


def test_dev_without_maintenance_or_metrics(
    run: DevRun, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["dev", "--processes", "1", "--no-maintenance", "--metrics-listen", "off"]
    assert run([*argv, "--ui-listen", "off"]) == 0
    assert run.command.maintenance == [] and run.ready == []
    assert set(run.command.of("Worker").args[4]) == DEMOS
    assert run.command.of("Worker").kwargs["interceptors"] == []
    assert run.command.of("Relay").kwargs["interceptors"] == []
    assert capsys.readouterr().out == _up_lines(
        "1 (server, relay and worker in this one, --processes 1)", dashboard=None
    )


def test_dev_in_three_processes_runs_the_relay_and_a_worker_apart(
    run: DevRun, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["dev", "--processes", "3", "--handlers", f"{HERE}:registry"]) == 0
    # Nothing but the server here.
    assert run.command.made == [] and run.command.maintenance == []
    (parts,) = run.parts
    assert parts.names == ["worker part 0", "relay part"]
    assert f"{HERE}:registry" in parts.commands[0]
    # The parts start before the server, and stop before it (the second stop, as the
    # start's own stack unwinds, finds them stopped).
    marks = ("parts.start", "parts.stop", ("start", True), ("stop", GRACE))
    assert [c for c in run.server.calls if c in marks] == [
        "parts.start",
        ("start", True),
        "parts.stop",
        ("stop", GRACE),
        "parts.stop",
    ]
    assert run.ready[0][1]["not_ready"]["parts"] == "a part stand-in"
    shown = f"3 (server in this one, pid {os.getpid()}; relay 4102; workers 4101)"
    assert capsys.readouterr().out == _up_lines(shown)


def test_dev_in_two_processes_keeps_the_relay_here(
    run: DevRun, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["dev", "--processes", "2", "--ui-listen", "off"]) == 0
    assert [p.kind for p in run.command.made] == ["Relay", "Sweeper", "Scheduler", "Deadlines"]
    (parts,) = run.parts
    assert parts.names == ["worker part 0"]
    shown = f"2 (server and relay in this one, pid {os.getpid()}; workers 4101)"
    assert capsys.readouterr().out == _up_lines(shown, dashboard=None)


def test_dev_ends_with_1_when_a_part_exits(run: DevRun, capsys: pytest.CaptureFixture[str]) -> None:
    run.part_exit = ("worker part 0", 3)
    assert run(["dev", "--processes", "2"]) == 1
    assert "error: worker part 0 exited (status 3); stopping\n" in capsys.readouterr().err
    assert run.parts[0].calls[:2] == ["start", "stop"]


def test_a_second_ctrl_c_kills_the_parts_and_exits_130(
    run: DevRun, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["dev", "--processes", "2", "--ui-listen", "off"]) == 0
    capsys.readouterr()
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    run.server.signals[0]["again"]()
    assert (exits, run.parts[0].calls[-1]) == ([130], "kill")
    assert capsys.readouterr().err == "\nstopping at once\n"


def test_a_second_ctrl_c_says_so_in_json_with_json_logs(
    run: DevRun, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", "json")
    assert run(["dev", "--processes", "2", "--ui-listen", "off"]) == 0
    capsys.readouterr()
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    run.server.signals[0]["again"]()
    assert (exits, run.parts[0].calls[-1]) == ([130], "kill")
    assert_answers(capsys.readouterr().err, "json", [("dev.stopping_at_once", "", {})])


def test_dev_says_it_is_up_in_json_with_json_logs(
    run: DevRun, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", "json")
    assert run(["dev", "--processes", "2", "--tenant", "acme"]) == 0
    ready, serving = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {k: ready[k] for k in ready if k not in ("timestamp",)} == {
        "event": "dev.ready",
        "level": "info",
        "logger": "jobplane.cli",
        "address": ADDRESS,
        "processes": [os.getpid(), 4101],
        "api_key": "jp_api_key",
        "tenant": "acme",
        "dashboard": "http://127.0.0.1:8080/",
        "worker_key": "jp_worker_key",
    }
    assert serving["event"] == "dev.serving"
    assert run.server.of("key")[0] == ("acme",)


def test_a_ctrl_c_during_the_start_starts_nothing_more(
    run: DevRun, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def stopped_while_applying(*_: Any) -> None:
        run.server.stop.set()
        await asyncio.Event().wait()

    monkeypatch.setattr("jobplane.topology.apply", stopped_while_applying)
    assert run(["dev", "--processes", "2"]) == 0
    assert (run.server.servers, run.parts, run.command.made[0].calls) == ([], [], [])
    assert capsys.readouterr().out == ""


def test_a_ctrl_c_while_the_parts_start_stops_them_and_ends_with_0(
    run: DevRun, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    class StoppedWhileStarting(Parts):
        async def start(self) -> None:
            await super().start()
            run.server.stop.set()

    monkeypatch.setattr(devparts, "Parts", lambda *a: StoppedWhileStarting(run, *a))
    assert run(["dev", "--processes", "3"]) == 0
    # The parts stopped with the start's stack; the server never started.
    (parts,) = run.parts
    assert (parts.calls, run.server.servers) == (["start", "stop"], [])
    assert capsys.readouterr().out == ""


def test_dev_ends_with_a_broker_error_that_waiting_does_not_mend(
    run: DevRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(*_: Any) -> None:
        raise RuntimeError("PRECONDITION_FAILED")

    monkeypatch.setattr("jobplane.topology.apply", refused)
    with pytest.raises(RuntimeError, match="PRECONDITION_FAILED"):
        run(["dev", "--processes", "1"])
    assert run.server.servers == []


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["--processes", "zero"],
            "error: --processes must be auto or a number of 1..64, not 'zero'",
        ),
        (["--handlers", f"{HERE}:nothing_here"], f"module '{HERE}' has no attribute"),
        (["--processes", "1", "--handlers", f"{HERE}:clashing"], "--no-maintenance"),
    ],
    ids=["processes", "handlers", "clashing"],
)
def test_dev_that_cannot_start_exits_2(
    run: DevRun, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert run(["dev", *argv]) == 2
    assert says in capsys.readouterr().err
    assert run.server.servers == []


class Client:
    """The SDK client ``dev --demo`` and ``--ingest`` use, recording its calls."""

    def __init__(self, log: list[Any], address: str, key: str) -> None:
        self._log = log
        log.append(("client", (address, key), {}))

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *_: object) -> None:
        self._log.append("client.closed")

    async def submit(self, job_type: str, payload: dict[str, Any]) -> Any:
        self._log.append(("submit", (job_type, payload), {}))
        return SimpleNamespace(name="jobs/j1")


@pytest.fixture
def client(run: DevRun, monkeypatch: pytest.MonkeyPatch) -> DevRun:
    """``run`` with a stand-in SDK client, job watch and ingestion."""
    log = run.server.calls
    monkeypatch.setattr("jobplane.client.AsyncClient", lambda *a: Client(log, *a))
    monkeypatch.setattr("jobplane.client.cli.render_watch", run.server.record("watch"))
    monkeypatch.setattr("jobplane.contrib.ingest.cli.ingest_files", run.server.record("ingest"))
    return run


def test_dev_demo_submits_a_job_and_shows_it_live(
    client: DevRun, capsys: pytest.CaptureFixture[str]
) -> None:
    assert client(["dev", "--processes", "1", "--demo", "--demo-steps", "7"]) == 0
    log = client.server
    assert log.of("client")[0] == (ADDRESS, "jp_api_key")
    assert log.of("submit")[0] == ("demo.progress", {"steps": 7, "interval_ms": 150})
    (watched, name), kw = log.of("watch")
    assert (type(watched), name, kw) == (Client, "jobs/j1", {"as_json": False})
    assert "client.closed" in log.calls
    assert capsys.readouterr().out.endswith(
        "submitted jobs/j1 (demo.progress); its live progress:\n"
        "  on the dashboard: http://127.0.0.1:8080/jobs/j1\n"
        "serving; Ctrl-C to stop\n"
    )


def test_dev_demo_in_json(
    client: DevRun, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", "json")
    assert client(["dev", "--processes", "1", "--demo", "--ui-listen", "off"]) == 0
    assert client.server.of("submit")[0] == ("demo.progress", {"steps": 20, "interval_ms": 150})
    assert client.server.of("watch")[1] == {"as_json": True}
    events = [json.loads(line)["event"] for line in capsys.readouterr().out.splitlines()]
    assert events == ["dev.ready", "dev.demo.submitted", "dev.serving"]


@pytest.fixture
def ingested(
    client: DevRun, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> tuple[DevRun, Path]:
    monkeypatch.setenv("JOBPLANE_TOPOLOGY", "builtin:dev")
    monkeypatch.setenv("JOBPLANE_QDRANT_PATH", str(tmp_path / "qdrant"))
    notes = tmp_path / "notes.md"
    notes.write_text("# notes\n")
    return client, notes


def test_dev_ingests_its_files_once_up(
    ingested: tuple[DevRun, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run, notes = ingested
    assert run(["dev", "--processes", "1", "--ingest", str(notes), "--ui-listen", "off"]) == 0
    assert run.server.of("client")[0] == (ADDRESS, "jp_api_key")
    (_, files), kw = run.server.of("ingest")
    assert (files, kw) == ([notes], {"mode": "lines"})
    assert run.server.calls.count("client.closed") == 1
    assert capsys.readouterr().out.endswith(
        f"\ningesting {notes} (ingest.file: parse, chunk, embed, index into Qdrant at "
        f"{notes.parent / 'qdrant'}):\n"
        f"  {dev._jobplane_command()} ingest {notes}   (again: changes nothing)\n\n"
        "serving; Ctrl-C to stop\n"
    )


def test_dev_says_when_the_ingestion_cannot_run(
    ingested: tuple[DevRun, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run, notes = ingested

    async def refused(*_: Any, **__: Any) -> None:
        raise JobplaneError("blob store unreachable")

    monkeypatch.setattr("jobplane.contrib.ingest.cli.ingest_files", refused)
    assert run(["dev", "--processes", "1", "--ingest", str(notes), "--ui-listen", "off"]) == 0
    out, err = capsys.readouterr()
    assert "error: the ingestion could not run: blob store unreachable\n" in err
    assert "(again: changes nothing)" not in out
    assert out.endswith("serving; Ctrl-C to stop\n")


def test_dev_shows_the_ingestion_live_on_a_terminal(
    ingested: tuple[DevRun, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    run, notes = ingested
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert run(["dev", "--processes", "1", "--ingest", str(notes), "--ui-listen", "off"]) == 0
    assert run.server.of("ingest")[1] == {"mode": "live"}


def test_dev_waits_for_a_broker_that_is_down(run: DevRun, monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[str] = []

    async def down_once(amqp_url: str, _topology: Any) -> None:
        tries.append(amqp_url)
        if len(tries) == 1:
            raise ConnectionRefusedError("Connect call failed ('127.0.0.1', 3)")

    monkeypatch.setattr("jobplane.topology.apply", down_once)
    assert run(["dev", "--processes", "1", "--ui-listen", "off"]) == 0
    assert tries == [ENV["JOBPLANE_AMQP_URL"]] * 2
    assert run.server.calls.count(("start", True)) == 1
