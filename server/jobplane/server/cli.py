"""The server's commands of ``jobplane``: ``migrate``, ``serve``, ``ui`` (the
dashboard alone) and ``topology apply``, each with its arguments.

jobplane.cli imports this module only when one of them runs (or for the whole
parser): each ``register_*`` fills the parser of its command; ``jobplane dev``
(jobplane.server.dev) builds its server and dashboard with :func:`_server` and
:func:`_server_dashboard`.
"""

from __future__ import annotations

import argparse
import asyncio
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from jobplane.config import ConfigError, ListenAddress, Settings, parse_listen
from jobplane.faults import FaultPoints
from jobplane.process import (
    _answer,
    _async,
    _blob_store,
    _cancelled,
    _database,
    _error_line,
    _first_line,
    _metrics_option,
    _ops,
    _say,
    _settings_and_topology,
    _start_ops,
    _started,
    _stop_signals,
    _tracing,
    _until_signal,
    _until_stopped,
)
from jobplane.topology import Topology

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.blobs import BlobStore
    from jobplane.observe.metrics import Metrics
    from jobplane.server import JobplaneServer
    from jobplane.store.db import Database


async def _migrate(_args: argparse.Namespace) -> int:
    from jobplane.store.engine import create_engine, migrate
    from jobplane.store.routes import sync_submit_rules

    settings, topology = _settings_and_topology()
    await migrate(settings.direct_url)
    _answer("database.migrated", "database is at the latest migration")
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        await sync_submit_rules(
            engine,
            topology,
            max_payload_bytes=settings.max_payload_bytes,
            lifecycle_events=settings.lifecycle_events,
            max_schedule_seconds=settings.max_schedule_seconds,
        )
    finally:
        await engine.dispose()
    _answer("submit_rules.synced", "routes of jobplane.submit_job are the topology's")
    return 0


def _server(
    settings: Settings,
    topology: Topology,
    engine: AsyncEngine,
    db: Database,
    *,
    tls: bool = False,
    blobs: BlobStore | None = None,
    metrics: Metrics | None = None,
) -> JobplaneServer:
    from jobplane.observe.metrics import NO_METRICS
    from jobplane.server import JobplaneServer
    from jobplane.server.app import ServerTLS
    from jobplane.server.limits import TenantLimits

    server_tls: ServerTLS | None = None
    if tls and settings.tls_cert is not None and settings.tls_key is not None:
        try:
            server_tls = ServerTLS.from_files(
                settings.tls_cert, settings.tls_key, settings.tls_client_ca
            )
        except OSError as exc:
            raise ConfigError(f"cannot read {exc.filename}: {exc.strerror or exc}") from exc
    return JobplaneServer(
        engine,
        settings.database_url,
        topology,
        listen=settings.listen,
        max_payload_bytes=settings.max_payload_bytes,
        faults=FaultPoints(settings.faults),
        tls=server_tls,
        limits=TenantLimits.from_settings(settings),
        worker_lease_seconds=settings.worker_lease_seconds,
        blobs=blobs,
        inline_bytes=settings.inline_bytes,
        metrics=metrics or NO_METRICS,
        db=db,
        max_schedule_seconds=settings.max_schedule_seconds,
        listen_url=settings.direct_url,
    )


async def _serve(args: argparse.Namespace) -> int:
    from jobplane.observe.metrics import watch_outbox
    from jobplane.store.engine import create_engine

    settings, topology = _settings_and_topology()
    _tracing("jobplane-server", settings)
    engine = create_engine(settings.database_url, pool_size=settings.db_engine_pool_size)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(engine.dispose)
        metrics, ops = _ops(settings, args, engine)
        watch_outbox(metrics, engine)
        server = _server(
            settings,
            topology,
            engine,
            _database(stack, settings, settings.db_pool_size),
            tls=True,
            blobs=_blob_store(settings, stack),
            metrics=metrics,
        )
        if ops is not None:
            # Not ready until the gRPC port serves, and again from the start of its drain.
            ops.add_check("grpc", server.not_ready)
        await _start_ops(stack, ops)
        await _started(stack, lambda: server.start(report_serving=False), server.stop)
        # SERVING once the topology is on the broker: a consumer that binds to the
        # events exchange when health says so finds it.
        declared = asyncio.create_task(_serving_once_declared(settings, topology, server))
        stack.push_async_callback(_cancelled, declared)
        transport = "plaintext"
        if settings.tls_cert is not None:
            transport = "mutual TLS" if settings.tls_client_ca is not None else "TLS"
        # server.started and ui.listening are these lines' log events.
        _say(None, f"jobplane serving on {server.address} ({transport})")
        ui = await _server_dashboard(stack, settings, server, args.ui_listen, default=None)
        if ui is not None:
            _say(None, f"dashboard on {ui.url}")
        with _stop_signals() as stop:
            ended = await _until_stopped(stop, declared)
            if ended is not None:
                # A broker error that waiting does not mend (until_declared) ends serve.
                ended.result()
                await stop.wait()
    return 0


async def _serving_once_declared(settings: Settings, topology: Topology, server: Any) -> None:
    from jobplane.topology import until_declared

    await until_declared(settings.amqp_url, topology)
    await server.report_serving()


# -- Dashboard (docs/dashboard.md) --------------------------------------------


async def _dashboard(
    stack: AsyncExitStack, settings: Settings, backend: Any, listen: ListenAddress, setting: str
) -> Any:
    """Start the dashboard on ``listen`` (stopped with ``stack``); a taken port is a
    ConfigError naming ``setting``."""
    from jobplane.server.dashboard import Dashboard

    ui = Dashboard(
        backend,
        listen=listen,
        setting=setting,
        secret=settings.ui_secret,
        session_seconds=settings.ui_session_seconds,
        secure_cookie=settings.ui_secure_cookie,
        origin=settings.ui_origin,
        trusted_proxies=settings.ui_trusted_proxies,
    )
    await ui.start()
    # Before the server's stop: open pages end while the feeds still serve.
    stack.push_async_callback(ui.stop)
    return ui


async def _server_dashboard(
    stack: AsyncExitStack,
    settings: Settings,
    server: JobplaneServer,
    flag: str | None,
    *,
    default: str | None,
) -> Any:
    """The dashboard in a server's process, sharing its feeds, engine and key cache."""
    from jobplane.server.dashboard import Backend

    listen, setting = _ui_listen(settings, flag, "--ui-listen", default)
    if listen is None:
        return None
    return await _dashboard(
        stack, settings, Backend.of_server(server, settings.amqp_url), listen, setting
    )


def _ui_listen(
    settings: Settings, flag: str | None, flag_name: str, default: str | None
) -> tuple[ListenAddress | None, str]:
    """Where the dashboard listens (None: off) and the setting that said so: the
    flag, else JOBPLANE_UI_LISTEN, else ``default``; a bad value is a ConfigError
    naming the flag or the variable."""
    if flag is not None:
        return parse_listen(flag, name=flag_name), flag_name
    chosen = settings.ui_address(default)
    if chosen is None:
        return None, "JOBPLANE_UI_LISTEN"
    return parse_listen(chosen, name="JOBPLANE_UI_LISTEN"), "JOBPLANE_UI_LISTEN"


async def _ui(args: argparse.Namespace) -> int:
    from jobplane.config import DEFAULT_UI_LISTEN
    from jobplane.server.dashboard.app import standalone_backend
    from jobplane.server.limits import TenantLimiter, TenantLimits
    from jobplane.store.engine import create_engine

    settings, topology = _settings_and_topology()
    listen, setting = _ui_listen(settings, args.listen, "--listen", DEFAULT_UI_LISTEN)
    if listen is None:
        _error_line("the dashboard is off (JOBPLANE_UI_LISTEN=off); give --listen")
        return 2
    engine = create_engine(settings.database_url, pool_size=settings.db_engine_pool_size)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(engine.dispose)
        # Built as `serve` builds its own, so each JOBPLANE_TENANT_… setting means the same.
        limiter = TenantLimiter(TenantLimits.from_settings(settings))
        backend = await standalone_backend(
            stack,
            engine,
            settings.database_url,
            settings.amqp_url,
            topology,
            limiter=limiter,
            max_payload_bytes=settings.max_payload_bytes,
            db_pool_size=settings.db_pool_size,
            listen_url=settings.direct_url,
        )
        ui = await _dashboard(stack, settings, backend, listen, setting)
        _say(None, f"dashboard on {ui.url}")  # logged as ui.listening
        await _until_signal()
    return 0


async def _topology_apply(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import DBAPIError

    from jobplane import broker
    from jobplane.store.deployment import this_deployment
    from jobplane.store.engine import create_engine
    from jobplane.store.routes import sync_submit_rules
    from jobplane.topology import claim_ownership, declare

    settings, topology = _settings_and_topology(log_level="warning")
    connection = await broker.connect(settings.amqp_url)
    async with connection:
        channel = await connection.channel()
        await declare(channel, topology)
        names = ", ".join(q.name for q in topology.queues)
        _answer(
            "topology.declared",
            f"declared exchange {topology.exchange} and queues {names}; "
            f"events exchange {topology.events_exchange}",
            exchange=topology.exchange,
            queues=[q.name for q in topology.queues],
            events_exchange=topology.events_exchange,
        )
        # The owner is this deployment's database; an operator applying the
        # topology from where Postgres is out of reach leaves the record to
        # the first relay or worker.
        engine = create_engine(settings.database_url, pool_size=1)
        try:
            deployment = await this_deployment(engine)
            await sync_submit_rules(
                engine,
                topology,
                max_payload_bytes=settings.max_payload_bytes,
                lifecycle_events=settings.lifecycle_events,
                max_schedule_seconds=settings.max_schedule_seconds,
            )
        except (DBAPIError, OSError) as exc:
            _answer(
                "topology.owner_unrecorded",
                f"owner not recorded (Postgres: {_first_line(exc)}); "
                "the first relay or worker records it",
                level="warning",
                error=_first_line(exc),
            )
            return 0
        finally:
            await engine.dispose()
        ownership = await claim_ownership(
            connection, topology, deployment, take_over=args.take_ownership
        )
    if ownership.conflict:
        _error_line(
            f"this topology is owned by deployment {ownership.describe_owner()}, not by "
            f"this one, {deployment}: both would consume the same queues. Give each its own "
            "vhost or topology names, or run `jobplane topology apply --take-ownership` if the "
            "other deployment is gone"
        )
        return 1
    _answer(
        "topology.owned",
        f"owner: deployment {deployment}",
        deployment=deployment.id,
        database=deployment.database,
    )
    return 0


# -- Arguments -------------------------------------------------------------


def register_migrate(parser: argparse.ArgumentParser) -> None:
    """``jobplane migrate``: no arguments."""
    parser.set_defaults(func=_async(_migrate))


def register_serve(parser: argparse.ArgumentParser) -> None:
    """``jobplane serve``'s arguments."""
    parser.set_defaults(func=_async(_serve))
    parser.add_argument(
        "--ui-listen", help="serve the dashboard on host:port too (off: not); JOBPLANE_UI_LISTEN"
    )
    _metrics_option(parser, "serve")


def register_ui(parser: argparse.ArgumentParser) -> None:
    """``jobplane ui``'s arguments."""
    parser.add_argument("--listen", help="host:port (default JOBPLANE_UI_LISTEN, 127.0.0.1:8080)")
    parser.set_defaults(func=_async(_ui))


def register_topology(parser: argparse.ArgumentParser) -> None:
    """``jobplane topology apply``'s arguments."""
    topology = parser.add_subparsers(dest="topology", required=True)
    apply = topology.add_parser(
        "apply", help="declare exchanges and queues (needs an account that may configure)"
    )
    apply.add_argument(
        "--take-ownership",
        action="store_true",
        help="record this deployment as the topology's owner, replacing another",
    )
    apply.set_defaults(func=_async(_topology_apply))
