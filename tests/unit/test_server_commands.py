"""``jobplane serve``, ``ui`` and ``migrate`` run in this process: what the options and
the environment become (the server's settings, listeners, pools, TLS and dashboard),
the order it starts, reports SERVING and stops in, its readiness, and what each
command prints and returns.

The server is a real JobplaneServer whose start and stop bind nothing; the dashboard
and whatever would reach Postgres or the broker are stand-ins recording their calls."""

from __future__ import annotations

from ipaddress import ip_network
from pathlib import Path
from typing import Any

import pytest

from jobplane.blobs import BlobStore
from jobplane.config import ConfigError, parse_listen
from jobplane.server import cli
from jobplane.server.app import ServerTLS, _max_receive_bytes
from jobplane.server.dashboard import Backend
from jobplane.server.limits import TenantLimits
from jobplane.store.deployment import Deployment
from jobplane.store.keys import KEYS_CHANNEL
from jobplane.store.rows import DOMAIN_EVENTS_CHANNEL, EVENTS_CHANNEL
from jobplane.topology.on_broker import Ownership
from tests.support.commands import ENV, CommandRun, armed, environment
from tests.support.logs import Answer, assert_answers
from tests.support.server_commands import PORT, ServerRun

SERVER_ENV = {
    "JOBPLANE_LISTEN": "0.0.0.0:50051",
    "JOBPLANE_TENANT_MAX_STREAMS": "12",
    "JOBPLANE_TENANT_SUBMITS_PER_SECOND": "34.5",
    "JOBPLANE_TENANT_SUBMIT_BURST": "56",
    "JOBPLANE_MAX_SCHEDULE_SECONDS": "7200",
    "JOBPLANE_WORKER_LEASE_SECONDS": "45",
    "JOBPLANE_INLINE_BYTES": "1000",
    "JOBPLANE_UI_SECRET": "s" * 40,
    "JOBPLANE_UI_SESSION_HOURS": "2",
    "JOBPLANE_UI_SECURE_COOKIE": "true",
    "JOBPLANE_UI_ORIGIN": "https://jobs.example.com",
    "JOBPLANE_UI_TRUSTED_PROXIES": "10.0.0.0/8",
}


class Runs:
    """A command run in this process (``run(argv)``) and what it made (``.server``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        environment(monkeypatch, {**ENV, **SERVER_ENV})
        self.command = CommandRun(
            monkeypatch,
            cli,
            {
                "serve": cli._serve,
                "ui": cli._ui,
                "migrate": cli._migrate,
                "topology": cli._topology_apply,
            },
        )
        self.server = ServerRun(monkeypatch, self.command.ops)
        monkeypatch.setattr(cli, "_stop_signals", self.server.stop_signals)
        monkeypatch.setattr(cli, "_until_signal", self.server.record("until_signal"))
        monkeypatch.setattr("jobplane.topology.until_declared", self.server.record("declared"))
        monkeypatch.setattr("jobplane.store.engine.migrate", self.server.record("migrate"))
        routes = self.server.record("sync_submit_rules", answer=True)
        monkeypatch.setattr("jobplane.store.routes.sync_submit_rules", routes)

    def __call__(self, argv: list[str]) -> int:
        return self.command(argv)


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> Runs:
    return Runs(monkeypatch)


def _dashboard_settings() -> dict[str, Any]:
    return {
        "secret": b"s" * 40,
        "session_seconds": 7200.0,
        "secure_cookie": True,
        "origin": "https://jobs.example.com",
        "trusted_proxies": (ip_network("10.0.0.0/8"),),
    }


def test_serve_builds_its_server_from_the_environment(
    run: Runs, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["serve", "--ui-listen", "127.0.0.1:8181"]) == 0
    server = run.server.server
    assert run.command.traced == ["jobplane-server"]
    assert server.address == f"0.0.0.0:{PORT}"
    assert server.db.size == 9
    assert type(server.blobs) is BlobStore
    assert server.limiter.limits == TenantLimits(
        max_streams=12, submits_per_second=34.5, submit_burst=56
    )
    assert server.max_receive_bytes == _max_receive_bytes(300000)
    assert server.service.max_schedule_seconds == 7200.0
    assert server.service.metrics.enabled and server.workers.metrics is server.service.metrics
    # What its WorkerService leases and keeps inline; JOBPLANE_FAULTS reach its store.
    assert (server.workers._store.lease_seconds, server.workers._inline_bytes) == (45.0, 1000)
    assert armed(server.service._store._faults)
    assert server.service._blobs is server.blobs
    # The LISTEN sessions go to the direct URL (past PgBouncer).
    direct = ENV["JOBPLANE_DATABASE_DIRECT_URL"]
    listeners = (server.hub, server.event_hub, server.key_events)
    assert [(h._url, h._channel) for h in listeners] == [
        (direct, EVENTS_CHANNEL),
        (direct, DOMAIN_EVENTS_CHANNEL),
        (direct, KEYS_CHANNEL),
    ]
    assert server._tls is None
    # The dashboard shares the server's services, engine and key cache.
    board = run.server.board
    assert board.backend == Backend.of_server(server, ENV["JOBPLANE_AMQP_URL"])
    assert board.backend.engine.pool.size() == 6
    assert board.kwargs == {
        "listen": parse_listen("127.0.0.1:8181"),
        "setting": "--ui-listen",
        **_dashboard_settings(),
    }
    err = capsys.readouterr().err
    assert f"jobplane serving on 0.0.0.0:{PORT} (plaintext)\n" in err
    assert "dashboard on http://127.0.0.1:8181/\n" in err


def test_serve_says_serving_once_the_topology_is_on_the_broker(run: Runs) -> None:
    assert run(["serve"]) == 0
    # Started without SERVING; SERVING once the topology is declared; the
    # dashboard (off unless asked) and then the server stop with the command.
    assert [c for c in run.server.calls if not isinstance(c, tuple) or c[0] != "declared"] == [
        ("start", False),
        "serving",
        ("stop", 5.0),
    ]
    (amqp_url, topology), _ = run.server.of("declared")
    assert amqp_url == ENV["JOBPLANE_AMQP_URL"]
    assert topology is run.server.server._topology
    assert run.server.boards == []
    # /readyz: not ready for gRPC until SERVING, then only the database is.
    assert run.server.ready_at_start is not None and run.server.ready_serving is not None
    status, body = run.server.ready_at_start
    assert (status, body["not_ready"]["grpc"]) == (503, "not serving")
    assert set(run.server.ready_serving[1]["not_ready"]) == {"database"}


def test_serve_stops_its_dashboard_before_its_server(run: Runs) -> None:
    assert run(["serve", "--ui-listen", "127.0.0.1:0"]) == 0
    ends = [c for c in run.server.calls if c in ("ui.start", "ui.stop", ("stop", 5.0))]
    assert ends == ["ui.start", "ui.stop", ("stop", 5.0)]


def test_serve_ends_with_a_broker_error_that_waiting_does_not_mend(
    run: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(*_: Any) -> None:
        # Were the error ignored, serve would end only at this stop, with 0.
        import asyncio

        asyncio.get_running_loop().call_later(1.0, run.server.stop.set)
        raise PermissionError("ACCESS_REFUSED")

    monkeypatch.setattr("jobplane.topology.until_declared", refused)
    with pytest.raises(PermissionError, match="ACCESS_REFUSED"):
        run(["serve"])
    assert run.server.calls == [("start", False), ("stop", 5.0)]


@pytest.fixture
def pems(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    files = {"cert": tmp_path / "cert.pem", "key": tmp_path / "key.pem"}
    files["ca"] = tmp_path / "ca.pem"
    for name, path in files.items():
        path.write_bytes(f"{name} pem".encode())
    monkeypatch.setenv("JOBPLANE_TLS_CERT", str(files["cert"]))
    monkeypatch.setenv("JOBPLANE_TLS_KEY", str(files["key"]))
    return files


def test_serve_speaks_tls_with_the_configured_files(
    run: Runs, pems: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["serve"]) == 0
    assert run.server.server._tls == ServerTLS(b"cert pem", b"key pem", None)
    assert f"jobplane serving on 0.0.0.0:{PORT} (TLS)\n" in capsys.readouterr().err


def test_serve_speaks_mutual_tls_with_a_client_ca(
    run: Runs,
    pems: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("JOBPLANE_TLS_CLIENT_CA", str(pems["ca"]))
    assert run(["serve"]) == 0
    assert run.server.server._tls == ServerTLS(b"cert pem", b"key pem", b"ca pem")
    assert f"jobplane serving on 0.0.0.0:{PORT} (mutual TLS)\n" in capsys.readouterr().err


def test_serve_names_a_tls_file_it_cannot_read(run: Runs, pems: dict[str, Path]) -> None:
    pems["key"].unlink()
    with pytest.raises(ConfigError) as raised:
        run(["serve"])
    assert str(raised.value) == f"cannot read {pems['key']}: No such file or directory"
    assert run.server.servers == []


def test_ui_builds_its_own_backend_from_the_environment(
    run: Runs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = object()
    monkeypatch.setattr(
        "jobplane.server.dashboard.app.standalone_backend",
        run.server.record("backend", answer=backend),
    )
    assert run(["ui", "--listen", "127.0.0.1:8282"]) == 0
    (_stack, engine, database_url, amqp_url, topology), kw = run.server.of("backend")
    assert engine.pool.size() == 6
    assert (database_url, amqp_url) == (ENV["JOBPLANE_DATABASE_URL"], ENV["JOBPLANE_AMQP_URL"])
    assert [q.name for q in topology.queues] == ["jobplane.default"]
    assert kw.pop("limiter").limits == TenantLimits(
        max_streams=12, submits_per_second=34.5, submit_burst=56
    )
    assert kw == {
        "max_payload_bytes": 300000,
        "db_pool_size": 9,
        "listen_url": ENV["JOBPLANE_DATABASE_DIRECT_URL"],
    }
    board = run.server.board
    assert board.backend is backend
    assert board.kwargs == {
        "listen": parse_listen("127.0.0.1:8282"),
        "setting": "--listen",
        **_dashboard_settings(),
    }
    # Served until a signal, then the dashboard stops.
    names = [c if isinstance(c, str) else c[0] for c in run.server.calls]
    assert names == ["backend", "ui.start", "until_signal", "ui.stop"]
    assert capsys.readouterr().err.endswith("dashboard on http://127.0.0.1:8282/\n")


def test_ui_listens_where_the_environment_says_without_listen(
    run: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBPLANE_UI_LISTEN", "127.0.0.1:8383")
    monkeypatch.setattr("jobplane.server.dashboard.app.standalone_backend", run.server.record("b"))
    assert run(["ui"]) == 0
    kw = run.server.board.kwargs
    assert (kw["listen"], kw["setting"]) == (parse_listen("127.0.0.1:8383"), "JOBPLANE_UI_LISTEN")


def test_ui_listens_on_the_default_address_when_nothing_says(
    run: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("jobplane.server.dashboard.app.standalone_backend", run.server.record("b"))
    assert run(["ui"]) == 0
    kw = run.server.board.kwargs
    assert (kw["listen"], kw["setting"]) == (parse_listen("127.0.0.1:8080"), "JOBPLANE_UI_LISTEN")


def test_ui_turned_off_by_the_environment_exits_2(
    run: Runs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOBPLANE_UI_LISTEN", "off")
    assert run(["ui"]) == 2
    assert capsys.readouterr().err == (
        "error: the dashboard is off (JOBPLANE_UI_LISTEN=off); give --listen\n"
    )
    assert run.server.calls == []


def test_ui_names_its_flag_in_a_bad_address(run: Runs) -> None:
    with pytest.raises(ConfigError, match="--listen"):
        run(["ui", "--listen", "nowhere"])


def test_migrate_migrates_then_writes_the_submit_rules(
    run: Runs, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["migrate"]) == 0
    (direct,), _ = run.server.of("migrate")
    assert direct == ENV["JOBPLANE_DATABASE_DIRECT_URL"]
    (engine, topology), kw = run.server.of("sync_submit_rules")
    assert (engine.pool.size(), [q.name for q in topology.queues]) == (1, ["jobplane.default"])
    assert kw == {
        "max_payload_bytes": 300000,
        "lifecycle_events": True,
        "max_schedule_seconds": 7200.0,
    }
    assert capsys.readouterr().err == (
        "database is at the latest migration\nroutes of jobplane.submit_job are the topology's\n"
    )


class Broker:
    """A broker connection that records what ``topology apply`` does with it."""

    def __init__(self, run: Runs, monkeypatch: pytest.MonkeyPatch, owner: str | None) -> None:
        monkeypatch.setenv("JOBPLANE_TOPOLOGY", "builtin:ingest")
        self.calls = run.server.calls
        self.ours = Deployment("d-ours", "jp")
        self.owner = owner
        record = run.server.record
        monkeypatch.setattr("jobplane.broker.connect", self._connect)
        monkeypatch.setattr("jobplane.topology.declare", record("declare"))
        monkeypatch.setattr("jobplane.topology.claim_ownership", self._claim)
        monkeypatch.setattr("jobplane.store.deployment.this_deployment", self._deployment)

    async def _connect(self, url: str) -> Broker:
        self.calls.append(("connect", (url,), {}))
        return self

    async def channel(self) -> str:
        return "the channel"

    async def _deployment(self, engine: Any) -> Deployment:
        self.calls.append(("deployment", (engine,), {}))
        return self.ours

    async def _claim(self, *args: Any, **kwargs: Any) -> Ownership:
        self.calls.append(("claim", args, kwargs))
        return Ownership(self.ours, self.owner, "other_db" if self.owner else None)

    async def __aenter__(self) -> Broker:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.calls.append("closed")


_DECLARED = (
    "declared exchange jobplane.jobs and queues ingest.parse, ingest.chunk, ingest.embed, "
    "ingest.index, jobplane.default; events exchange jobplane.events\n"
)


def test_topology_apply_declares_and_records_this_deployment(
    run: Runs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    broker = Broker(run, monkeypatch, owner=None)
    assert run(["topology", "apply"]) == 0
    names = [c if isinstance(c, str) else c[0] for c in run.server.calls]
    assert names == ["connect", "declare", "deployment", "sync_submit_rules", "claim", "closed"]
    assert run.server.of("connect")[0] == (ENV["JOBPLANE_AMQP_URL"],)
    (channel, topology), _ = run.server.of("declare")
    assert (channel, topology.queues[0].name) == ("the channel", "ingest.parse")
    ((engine,), _) = run.server.of("deployment")
    (synced, synced_topology), kw = run.server.of("sync_submit_rules")
    assert (synced, synced_topology, engine.pool.size()) == (engine, topology, 1)
    assert kw == {
        "max_payload_bytes": 300000,
        "lifecycle_events": True,
        "max_schedule_seconds": 7200.0,
    }
    assert run.server.of("claim") == ((broker, topology, broker.ours), {"take_over": False})
    assert capsys.readouterr().err == _DECLARED + "owner: deployment d-ours (database 'jp')\n"


def test_topology_apply_refuses_a_topology_another_deployment_owns(
    run: Runs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    Broker(run, monkeypatch, owner="d-theirs")
    assert run(["topology", "apply"]) == 1
    assert capsys.readouterr().err == _DECLARED + (
        "error: this topology is owned by deployment d-theirs (database 'other_db'), not by "
        "this one, d-ours (database 'jp'): both would consume the same queues. Give each its "
        "own vhost or topology names, or run `jobplane topology apply --take-ownership` if "
        "the other deployment is gone\n"
    )


def test_topology_apply_takes_ownership_when_asked(
    run: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    Broker(run, monkeypatch, owner=None)
    assert run(["topology", "apply", "--take-ownership"]) == 0
    assert run.server.of("claim")[1] == {"take_over": True}


def test_topology_apply_without_postgres_leaves_the_owner_to_others(
    run: Runs, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    Broker(run, monkeypatch, owner=None)

    async def unreachable(engine: Any) -> Deployment:
        raise OSError("Connect call failed ('127.0.0.1', 1)\nand more")

    monkeypatch.setattr("jobplane.store.deployment.this_deployment", unreachable)
    assert run(["topology", "apply"]) == 0
    names = [c if isinstance(c, str) else c[0] for c in run.server.calls]
    assert names == ["connect", "declare", "closed"]
    assert capsys.readouterr().err == _DECLARED + (
        "owner not recorded (Postgres: Connect call failed ('127.0.0.1', 1)); "
        "the first relay or worker records it\n"
    )


_QUEUES = ["ingest.parse", "ingest.chunk", "ingest.embed", "ingest.index", "jobplane.default"]
_DECLARED_JSON: Answer = (
    "topology.declared",
    _DECLARED.rstrip("\n"),
    {"exchange": "jobplane.jobs", "queues": _QUEUES, "events_exchange": "jobplane.events"},
)


@pytest.mark.parametrize(
    ("argv", "owner", "reachable", "status", "answers"),
    [
        (
            ["migrate"],
            None,
            True,
            0,
            [
                ("database.migrated", "database is at the latest migration", {}),
                ("submit_rules.synced", "routes of jobplane.submit_job are the topology's", {}),
            ],
        ),
        (
            ["topology", "apply"],
            None,
            True,
            0,
            [
                _DECLARED_JSON,
                (
                    "topology.owned",
                    "owner: deployment d-ours (database 'jp')",
                    {"deployment": "d-ours", "database": "jp"},
                ),
            ],
        ),
        (
            ["topology", "apply"],
            None,
            False,
            0,
            [
                _DECLARED_JSON,
                (
                    "topology.owner_unrecorded",
                    "owner not recorded (Postgres: refused); the first relay or worker records it",
                    {"error": "refused"},
                ),
            ],
        ),
        (
            ["topology", "apply"],
            "d-theirs",
            True,
            1,
            [
                _DECLARED_JSON,
                (
                    "command.failed",
                    "",
                    {
                        "error": "this topology is owned by deployment d-theirs (database "
                        "'other_db'), not by this one, d-ours (database 'jp'): both would consume "
                        "the same queues. Give each its own vhost or topology names, or run "
                        "`jobplane topology apply --take-ownership` if the other deployment is "
                        "gone"
                    },
                ),
            ],
        ),
    ],
)
def test_migrate_and_topology_apply_answer_in_json_with_json_logs(
    run: Runs,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    owner: str | None,
    reachable: bool,
    status: int,
    answers: list[Answer],
) -> None:
    """Each line one JSON object, shown at the default level of the command (warning)."""
    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", "json")
    monkeypatch.delenv("JOBPLANE_LOG_LEVEL", raising=False)
    if argv[0] == "topology":
        Broker(run, monkeypatch, owner=owner)
    if not reachable:

        async def unreachable(engine: Any) -> Deployment:
            raise OSError("refused")

        monkeypatch.setattr("jobplane.store.deployment.this_deployment", unreachable)
    assert run(argv) == status
    assert_answers(capsys.readouterr().err, "json", answers)
