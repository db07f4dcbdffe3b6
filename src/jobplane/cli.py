"""The ``jobplane`` command: processes (migrate, serve, relay, worker, dev), keys,
topology, workers, and the client commands (submit, watch, get, list, cancel, retry, events)."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import AsyncExitStack
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from jobplane import heap
from jobplane.config import (
    OTLP_GRPC_MODULE,
    ConfigError,
    ListenAddress,
    Settings,
    parse_listen,
    requested_log_format,
)
from jobplane.console import extra_install, installed_version, missing_modules
from jobplane.errors import JobplaneError
from jobplane.faults import FaultPoints
from jobplane.logs import configure, json_line, json_lines, scrub, set_job_prefixes
from jobplane.topology import Topology, TopologyError, load_topology

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.blobs import BlobStore
    from jobplane.devparts import Layout
    from jobplane.observe.http import OpsServer
    from jobplane.observe.metrics import Metrics
    from jobplane.server import JobplaneServer
    from jobplane.store.db import Database
    from jobplane.store.jobs import JobStore
    from jobplane.store.keys import KeyInfo, KeyStore
    from jobplane.workers.interceptors import Interceptor, RelayInterceptor


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _until_signal() -> None:
    with _stop_signals() as stop:
        await stop.wait()


@contextlib.contextmanager
def _stop_signals(
    *, settle: bool = True, again: Callable[[], None] | None = None
) -> Iterator[asyncio.Event]:
    """An event set by SIGINT or SIGTERM while the block runs. Entered before
    anything awaits, so a signal right after the process says it serves is
    caught rather than ending it with KeyboardInterrupt.

    ``again``: called at a signal that comes once the event is set (a second
    Ctrl-C while stopping). ``settle``: the process is up (see jobplane.heap)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def signalled() -> None:
        if stop.is_set() and again is not None:
            again()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signalled)
    if settle:
        # The process is up: what it holds now lives as long as it does.
        heap.settle()
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def _until_stopped(stop: asyncio.Event, other: Awaitable[Any]) -> asyncio.Future[Any] | None:
    """Until ``stop`` is set (None) or ``other`` ends first (its future, done)."""
    stopped = asyncio.ensure_future(stop.wait())
    ended = asyncio.ensure_future(other)
    await asyncio.wait({stopped, ended}, return_when=asyncio.FIRST_COMPLETED)
    for task in (stopped, ended):
        task.cancel()
    return ended if ended.done() and not ended.cancelled() else None


def _settings_and_topology(log_level: str = "info") -> tuple[Settings, Topology]:
    from jobplane.store.machine import MACHINE

    settings = Settings.from_env()
    configure(settings.log_level or log_level, settings.log_format)
    # Every command reading these settings writes transitions (or syncs the
    # submit rules) with them: the machine's switch follows them here, once.
    MACHINE.set_lifecycle_events(settings.lifecycle_events)
    topology = load_topology(settings.topology_path)
    set_job_prefixes(settings.log_job_prefix, {q.name: q.log_prefix for q in topology.queues})
    return settings, topology


def _say(event: str | None, text: str, *, level: str = "info", **fields: Any) -> None:
    """Tell the operator ``text`` on stderr; with JSON logs, log ``event`` with
    ``fields`` instead (None: a log line already says it), so that every line the
    process writes is one JSON object."""
    if not json_lines():
        print(text, file=sys.stderr, flush=True)
    elif event is not None:
        import structlog

        getattr(structlog.get_logger("jobplane.cli"), level)(event, **fields)


def _error_line(message: str) -> None:
    """``error: message`` on stderr: a ``command.failed`` JSON line when JSON logs were
    asked for (the settings may be what failed, so asked of the environment)."""
    if json_lines() or requested_log_format() == "json":
        print(json_line("command.failed", "error", error=scrub(message)), file=sys.stderr)
    else:
        print(f"error: {message}", file=sys.stderr)


#: Each command's ops listener (/metrics, /livez, /readyz) when JOBPLANE_METRICS_LISTEN is
#: unset: apart, so the processes of one host do not collide.
METRICS_DEFAULTS = {
    "serve": "127.0.0.1:9460",
    "relay": "127.0.0.1:9461",
    "worker": "127.0.0.1:9462",
    "sweep": "127.0.0.1:9463",
    "dev": "127.0.0.1:9464",
}


def _ops(
    settings: Settings, args: argparse.Namespace, engine: AsyncEngine
) -> tuple[Metrics, OpsServer | None]:
    """The process's metrics and its ops listener (not started; None: turned off).

    ``--metrics-listen`` wins over JOBPLANE_METRICS_LISTEN, which wins over the
    command's default. The database check is the first readiness check.
    """
    from jobplane.observe.metrics import NO_METRICS, Metrics

    flag = getattr(args, "metrics_listen", None)
    asked = True
    # A default taken by another process of this host does not stop this one;
    # an address asked for does (a dev part's is derived from a default one).
    fallback = False
    if flag is not None:
        address = parse_listen(flag, name="--metrics-listen")
        setting = "--metrics-listen"
        fallback = bool(getattr(args, "metrics_fallback", False))
    elif settings.metrics_listen_set:
        address, setting = settings.metrics_listen, "JOBPLANE_METRICS_LISTEN"
    else:
        address = parse_listen(METRICS_DEFAULTS[args.command])
        setting = "JOBPLANE_METRICS_LISTEN (unset: the default)"
        asked = False
        fallback = True
    if address is None:
        return NO_METRICS, None
    if missing_modules(_METRICS_MODULES):
        if not asked:
            # The worker install (ADR-0033) has no listener unless asked for one.
            import structlog

            structlog.get_logger("jobplane.ops").warning(
                "ops.listener.off", reason="metrics extra missing", install=extra_install("metrics")
            )
            return NO_METRICS, None
        _needs(f"{setting} (the ops listener)", "metrics", _METRICS_MODULES)
    from jobplane.observe.http import OpsServer, database_check

    metrics = Metrics()
    metrics.add_pool(engine)
    ops = OpsServer(address, metrics, setting=setting, fallback=fallback)
    ops.add_check("database", database_check(engine))
    return metrics, ops


async def _start_ops(stack: AsyncExitStack, ops: OpsServer | None) -> None:
    if ops is not None:
        await _started(stack, ops.start, ops.stop)


def _failed_queue_depth(
    stack: AsyncExitStack, metrics: Metrics, settings: Settings, topology: Topology
) -> None:
    """Report the failed queue's depth and each queue's messages and consumers at
    each scrape (a relay's, or dev's, listener)."""
    if metrics.enabled:
        from jobplane.observe.metrics import FailedQueueDepth

        depth = FailedQueueDepth(
            metrics,
            settings.amqp_url,
            topology.failed_queue,
            [q.name for q in topology.queues],
        )
        stack.push_async_callback(depth.close)


#: What the ops listener imports: the ``metrics`` extra.
_METRICS_MODULES = ("prometheus_client", "aiohttp")


def _needs(what: str, extra: str, modules: tuple[str, ...]) -> None:
    """A ConfigError (one line, exit 2) when ``what`` is configured and ``extra`` is
    not installed: the worker install (ADR-0033) leaves blobs, tracing's exporters and
    the ops listener to extras of their own."""
    missing = missing_modules(modules)
    if missing:
        raise ConfigError(
            f"{what} needs {', '.join(missing)}, not installed here: {extra_install(extra)}"
        )


def _tracing(service_name: str, settings: Settings) -> None:
    """Tracing on when the OTEL_* variables ask for it (docs/tracing.md), the
    store's transitions with it; off, the store is given no observer."""
    from jobplane.observe.tracing import configure_tracing

    if settings.trace_exporters:
        # The exporter of the protocol asked for: with grpc, the settings
        # accepted the gRPC exporter alone, so the HTTP one is not required.
        exporter = (
            OTLP_GRPC_MODULE
            if settings.trace_protocol == "grpc"
            else "opentelemetry.exporter.otlp.proto.http"
        )
        _needs(
            f"tracing (OTEL_TRACES_EXPORTER={','.join(settings.trace_exporters)})",
            "otlp",
            ("opentelemetry.sdk", *((exporter,) if "otlp" in settings.trace_exporters else ())),
        )

    configure_tracing(service_name, settings)


def _worker_interceptors(metrics: Metrics) -> list[Interceptor]:
    """What this process observes of its worker: tracing, when :func:`_tracing`
    turned it on, and ``metrics``, when it serves them; neither, nothing."""
    from jobplane.observe import tracing
    from jobplane.observe.metrics import WorkerMetrics

    interceptors: list[Interceptor] = []
    if tracing.ENABLED:
        interceptors.append(tracing.WorkerTracing())
    if metrics.enabled:
        interceptors.append(WorkerMetrics(metrics))
    return interceptors


def _relay_interceptors(metrics: Metrics) -> list[RelayInterceptor]:
    """What this process observes of its relay and sweeper: tracing, when
    :func:`_tracing` turned it on, and ``metrics``, when it serves them."""
    from jobplane.observe import tracing
    from jobplane.observe.metrics import RelayMetrics

    interceptors: list[RelayInterceptor] = []
    if tracing.ENABLED:
        interceptors.append(tracing.RelayTracing())
    if metrics.enabled:
        interceptors.append(RelayMetrics(metrics))
    return interceptors


async def _started(
    stack: AsyncExitStack, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]
) -> None:
    await start()
    stack.push_async_callback(stop)


async def _migrate(_args: argparse.Namespace) -> int:
    from jobplane.store.engine import create_engine, migrate
    from jobplane.store.routes import sync_submit_rules

    settings, topology = _settings_and_topology()
    await migrate(settings.database_url)
    print("database is at the latest migration", file=sys.stderr)
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        await sync_submit_rules(
            engine,
            topology,
            max_payload_bytes=settings.max_payload_bytes,
            lifecycle_events=settings.lifecycle_events,
        )
    finally:
        await engine.dispose()
    print("routes of jobplane.submit_job are the topology's", file=sys.stderr)
    return 0


def _blob_store(settings: Settings, stack: AsyncExitStack) -> BlobStore | None:
    """The process's blob store (closed with ``stack``); None when JOBPLANE_S3_URL is unset.

    Nothing is opened here: S3 is reached at first use, so a process starts
    while the object store is down. The store has a small database pool of its
    own: it holds a blob's lock across the S3 call that completes the blob, and
    a slow object store must never take the connections of submits, claims and
    heartbeats.
    """
    if not settings.blobs_enabled:
        return None
    _needs("JOBPLANE_S3_URL (blobs)", "blobs", ("aioboto3",))
    from jobplane.blobs import BlobStore

    store: BlobStore = BlobStore.from_settings(settings)
    stack.push_async_callback(store.close)
    return store


def _database(stack: AsyncExitStack, settings: Settings, size: int) -> Database:
    """The process's pool of the hot statements (ADR-0030), closed with ``stack``."""
    from jobplane.store.db import Database

    db = Database(settings.database_url, size=size)
    stack.push_async_callback(db.close)
    return db


def _relay_pool(stack: AsyncExitStack, settings: Settings) -> tuple[Database, int]:
    """A relay's pool (at most JOBPLANE_DB_POOL_SIZE) and the batches in flight it
    has the connections for: more batches than connections would wait for one
    another's, and time out as a full pool."""
    from jobplane.workers.relay import relay_in_flight, relay_pool_size

    size = min(settings.db_pool_size, relay_pool_size())
    return _database(stack, settings, size), relay_in_flight(size)


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


async def _cancelled(task: asyncio.Task[Any]) -> None:
    from jobplane.tasks import cancel_and_wait

    await cancel_and_wait(task)


# -- Dashboard (docs/dashboard.md) --------------------------------------------


async def _dashboard(
    stack: AsyncExitStack, settings: Settings, backend: Any, listen: ListenAddress, setting: str
) -> Any:
    """Start the dashboard on ``listen`` (stopped with ``stack``); a taken port is a
    ConfigError naming ``setting``."""
    from jobplane.dashboard import Dashboard

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
    from jobplane.dashboard import Backend

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
    from jobplane.dashboard.app import standalone_backend
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
        )
        ui = await _dashboard(stack, settings, backend, listen, setting)
        _say(None, f"dashboard on {ui.url}")  # logged as ui.listening
        await _until_signal()
    return 0


async def _relay(args: argparse.Namespace) -> int:
    from jobplane.observe.metrics import watch_outbox
    from jobplane.store.engine import create_engine
    from jobplane.workers.relay import Relay
    from jobplane.workers.sweeper import Sweeper

    settings, topology = _settings_and_topology()
    _tracing("jobplane-relay", settings)
    engine = create_engine(settings.database_url, pool_size=settings.db_engine_pool_size)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(engine.dispose)
        metrics, ops = _ops(settings, args, engine)
        watch_outbox(metrics, engine)
        _failed_queue_depth(stack, metrics, settings, topology)
        relay_db, in_flight = _relay_pool(stack, settings)
        observed = _relay_interceptors(metrics)
        relay = Relay(
            engine,
            settings.database_url,
            settings.amqp_url,
            topology,
            faults=FaultPoints(settings.faults),
            unroutable_after=args.unroutable_after,
            interceptors=observed,
            db=relay_db,
            in_flight=in_flight,
        )
        sweeper = (
            None
            if args.no_sweep
            else Sweeper(
                engine,
                topology=topology,
                lease_grace=args.lease_grace,
                republish_after=args.republish_after,
                interceptors=observed,
                interval=args.sweep_interval,
            )
        )
        if ops is not None:
            ops.add_check("broker", lambda: None if relay.connected else "no broker channel")
        await _start_ops(stack, ops)
        await _started(stack, relay.start, relay.stop)
        if sweeper is not None:
            await stack.enter_async_context(sweeper)
        await _until_signal()
    return 0


async def _sweep(args: argparse.Namespace) -> int:
    from jobplane import broker
    from jobplane.logs import describe_error
    from jobplane.observe.metrics import NO_METRICS, watch_outbox
    from jobplane.store.down import database_down, database_unavailable
    from jobplane.store.engine import create_engine
    from jobplane.workers.relay import Relay
    from jobplane.workers.sweeper import Sweeper

    settings, topology = _settings_and_topology()
    _tracing("jobplane-sweep", settings)
    engine = create_engine(settings.database_url, pool_size=settings.db_engine_pool_size)
    stack = AsyncExitStack()
    try:
        metrics, ops = _ops(settings, args, engine)
        watch_outbox(metrics, engine)
        if not args.once:
            await _start_ops(stack, ops)
        sweeper = Sweeper(
            engine,
            topology=topology,
            lease_grace=args.lease_grace,
            republish_after=args.republish_after,
            interceptors=_relay_interceptors(metrics),
        )
        relay_db, in_flight = _relay_pool(stack, settings)
        # Its one pass traces as the relay does; its rows are counted by the relays.
        relay = Relay(
            engine,
            settings.database_url,
            settings.amqp_url,
            topology,
            unroutable_after=args.unroutable_after,
            interceptors=_relay_interceptors(NO_METRICS),
            db=relay_db,
            in_flight=in_flight,
        )
        while True:
            try:
                report = await sweeper.sweep_once()
            except Exception as exc:
                # A loop outlives a database restart or failover; a single pass
                # reports it (main).
                if args.once or not database_down(exc):
                    raise
                _say(
                    "database.unavailable",
                    f"database unavailable, not swept: {describe_error(exc)}",
                    level="warning",
                    error=describe_error(exc),
                    retry_in=args.interval,
                )
                await asyncio.sleep(args.interval)
                continue
            try:
                published = await relay.drain_once()
            except Exception as exc:
                # A loop outlives a broker restart; a single pass reports it (main).
                if args.once or not (broker.broker_down(exc) or database_unavailable(exc)):
                    raise
                if broker.broker_down(exc):
                    _say(
                        "broker.unavailable",
                        f"broker unavailable, outbox not drained: {exc!r}",
                        level="warning",
                        error=repr(exc),
                        retry_in=args.interval,
                    )
                else:
                    _say(
                        "database.unavailable",
                        f"database unavailable, outbox not drained: {describe_error(exc)}",
                        level="warning",
                        error=describe_error(exc),
                        retry_in=args.interval,
                    )
                published = 0
            _say(
                "sweep.done",
                f"leases: {report.requeued} requeued, {report.failed} failed; "
                f"dispatches: {report.republished} re-published; "
                f"outbox: {published} published, {report.stuck_outbox} were stuck",
                requeued=report.requeued,
                failed=report.failed,
                republished=report.republished,
                published=published,
                stuck_outbox=report.stuck_outbox,
            )
            if args.once:
                return 0
            await asyncio.sleep(args.interval)
    finally:
        await stack.aclose()
        await engine.dispose()


def _registry(spec: str | None, *, demo: bool) -> Any:
    from jobplane.workers.demo import registry as demo_registry
    from jobplane.workers.handlers import Registry, load_registry

    registry = Registry()
    if demo:
        registry = registry.merge(demo_registry)
    if spec:
        registry = registry.merge(load_registry(spec))
    return registry


def _registry_or_none(spec: str | None, *, demo: bool) -> Any:
    """The registry, or None after saying in one line why it cannot be loaded."""
    try:
        return _registry(spec, demo=demo)
    except (ValueError, TypeError) as exc:  # HandlersError, or two handlers for one type
        _error_line(str(exc))
        return None


async def _worker(args: argparse.Namespace) -> int:
    from jobplane.store.engine import create_engine
    from jobplane.workers.runtime import Worker, worker_pool_size

    settings, topology = _settings_and_topology()
    _tracing("jobplane-worker", settings)
    registry = _registry_or_none(args.handlers, demo=args.demo or not args.handlers)
    if registry is None:
        return 2
    engine = create_engine(settings.database_url, pool_size=settings.db_engine_pool_size)
    faults = FaultPoints(settings.faults)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(engine.dispose)
        metrics, ops = _ops(settings, args, engine)
        blobs = _blob_store(settings, stack)
        db = _database(
            stack, settings, min(settings.db_pool_size, worker_pool_size(args.concurrency))
        )
        if not args.no_maintenance:
            registry = await _with_maintenance(stack, registry, engine, db, blobs, settings, faults)
            if registry is None:
                return 2
        worker = Worker(
            engine,
            settings.database_url,
            settings.amqp_url,
            topology,
            registry,
            concurrency=args.concurrency,
            prefetch=args.prefetch,
            reserve=args.reserve,
            queues=args.queue or None,
            lease_seconds=args.lease_seconds,
            faults=faults,
            group_window=args.group_window / 1000,
            group_max=args.group_max,
            max_result_bytes=settings.max_payload_bytes,
            blobs=blobs,
            inline_bytes=settings.inline_bytes,
            interceptors=_worker_interceptors(metrics),
            db=db,
            sync_threads=settings.sync_threads,
        )
        if ops is not None:
            ops.add_check("broker", worker.not_ready)
        await _start_ops(stack, ops)
        await _started(stack, worker.start, lambda: worker.stop(args.grace))
        await _until_signal()
    return 0


def _maintenance_index(stack: AsyncExitStack, settings: Settings) -> Any:
    """The search index erasure deletes a tenant's points from, when ingestion is set up
    here: a Qdrant server (JOBPLANE_QDRANT_URL), or a local-mode Qdrant directory that
    exists; None otherwise (qdrant-client not installed, or nothing ever indexed here).

    The index opens its client at its first call, closed with ``stack``; in one process
    it shares the client of ingestion's own index (one local-mode lock)."""
    import importlib.util

    if importlib.util.find_spec("qdrant_client") is None:
        return None
    if settings.qdrant_url is None and not settings.qdrant_location.is_dir():
        return None
    from jobplane.contrib.ingest.index import open_index

    index = open_index(settings)
    stack.push_async_callback(index.close)
    return index


async def _with_maintenance(
    stack: AsyncExitStack,
    registry: Any,
    engine: AsyncEngine,
    db: Database,
    blobs: BlobStore | None,
    settings: Settings,
    faults: FaultPoints,
) -> Any:
    """``registry`` with the maintenance handlers, built on the worker's own engine
    and database (None after saying in one line why they cannot be added)."""
    from jobplane.workers.maintenance import Maintenance

    maintenance = Maintenance(
        engine, db, blobs=blobs, index=_maintenance_index(stack, settings), faults=faults
    )
    try:
        return registry.merge(maintenance.registry())
    except ValueError as exc:  # the loaded handlers register a maintenance type too
        _error_line(f"{exc} (run the worker with --no-maintenance)")
        return None


def _with_ingest(registry: Any, files: list[Path], settings: Settings, topology: Topology) -> Any:
    """``registry`` with the ingest handlers for ``jobplane dev --ingest``; None after
    saying in one line why the files cannot be ingested here."""
    missing = [str(f) for f in files if not f.is_file()]
    problem = ""
    if missing:
        problem = f"--ingest: no such file: {', '.join(missing)}"
    elif not settings.blobs_enabled:
        problem = "--ingest needs a blob store: set JOBPLANE_S3_URL (make dev starts one)"
    elif topology.pipeline("ingest.file") is None:
        problem = (
            "--ingest needs the ingest.file pipeline: JOBPLANE_TOPOLOGY=builtin:dev (make "
            "dev's) or JOBPLANE_TOPOLOGY=builtin:ingest"
        )
    if problem:
        _error_line(problem)
        return None
    from jobplane.contrib.ingest import STAGE_TYPES
    from jobplane.contrib.ingest import registry as ingest_registry

    if all(registry.get(t) is not None for t in STAGE_TYPES):
        return registry  # --handlers loaded them already
    try:
        return registry.merge(ingest_registry)
    except ValueError as exc:
        _error_line(str(exc))
        return None


async def _dev(args: argparse.Namespace) -> int:
    from jobplane.broker import until_up
    from jobplane.devparts import GRACE, Layout, resolve_processes
    from jobplane.store.engine import create_engine, migrate
    from jobplane.topology import apply
    from jobplane.topology import log as topology_log
    from jobplane.workers.relay import Relay, relay_in_flight
    from jobplane.workers.sweeper import Sweeper

    if args.relay_part:
        return await _dev_relay_part(args)
    if args.worker_part is not None:
        return await _dev_part(args)
    try:
        processes = resolve_processes(args.processes)
    except ValueError as exc:
        _error_line(str(exc))
        return 2
    settings, topology = _settings_and_topology(log_level="warning")
    _tracing("jobplane-dev", settings)
    registry = _registry_or_none(args.handlers, demo=True)
    if registry is None:
        return 2
    ingest = [Path(f) for f in args.ingest or ()]
    if ingest:
        registry = _with_ingest(registry, ingest, settings, topology)
        if registry is None:
            return 2
    from jobplane.observe.metrics import watch_outbox

    await migrate(settings.database_url)
    engine = create_engine(settings.database_url, pool_size=settings.db_engine_pool_size)
    async with AsyncExitStack() as stack:
        stack.push(_stopped_in_order(args))
        stack.push_async_callback(engine.dispose)
        # One Ctrl-C (a SIGINT to every process of the group) stops every phase
        # (the start, the demo, the ingestion, serving) in order and within
        # jobplane.devparts.GRACE a part; a second stops at once.
        at_once = _AtOnce()
        stop = stack.enter_context(_stop_signals(settle=False, again=at_once))
        metrics, ops = _ops(settings, args, engine)
        watch_outbox(metrics, engine)
        _failed_queue_depth(stack, metrics, settings, topology)
        blobs = _blob_store(settings, stack)
        db = _database(stack, settings, settings.db_pool_size)
        if processes == 1 and not args.no_maintenance:
            registry = await _with_maintenance(
                stack, registry, engine, db, blobs, settings, FaultPoints(settings.faults)
            )
            if registry is None:
                return 2
        layout = Layout(processes)
        server = _server(settings, topology, engine, db, blobs=blobs, metrics=metrics)
        observed = _relay_interceptors(metrics)
        relay = (
            None
            if layout.relay_apart
            else Relay(
                engine,
                settings.database_url,
                settings.amqp_url,
                topology,
                interceptors=observed,
                db=db,
                in_flight=relay_in_flight(db.size),
            )
        )
        worker = (
            _dev_worker(settings, topology, engine, db, registry, args, blobs, metrics)
            if processes == 1
            else None
        )
        if ops is not None:
            ops.add_check("grpc", server.not_ready)
            if relay is not None:
                in_process = relay
                ops.add_check(
                    "relay", lambda: None if in_process.connected else "no broker channel"
                )
            if worker is not None:
                ops.add_check("worker", worker.not_ready)
        await _start_ops(stack, ops)
        # The topology this command runs, bindings and all, before anything says
        # it serves: its routes exist on the broker even where another topology
        # was declared before (the relay and the workers only add what is missing).
        # A broker down is waited for, as the relay and the workers wait for it.
        applied = await _until_stopped(
            stop, until_up(lambda: apply(settings.amqp_url, topology), topology_log)
        )
        if applied is not None:
            applied.result()  # an error waiting does not mend: its one line
        # A Ctrl-C during the start stops it at the next step: what started so far
        # stops with the stack.
        if stop.is_set():
            return 0
        # The parts start before gRPC's threads do (a fork beside them warns),
        # and stop first: before the relay and the server.
        parts = None if worker is not None else await _dev_parts(stack, args, layout, ops)
        at_once.parts = parts
        if stop.is_set():
            return 0
        await _started(stack, server.start, lambda: server.stop(GRACE))
        if relay is not None:
            await _started(stack, relay.start, relay.stop)
            sweeper = Sweeper(engine, topology=topology, interceptors=observed)
            await stack.enter_async_context(sweeper)
        if worker is not None:
            await _started(stack, worker.start, lambda: worker.stop(GRACE))
        if parts is not None:
            stack.push_async_callback(parts.stop)
        key, _tenant = await server.keys.create_key(args.tenant)
        worker_key = (await server.keys.create_worker()).key
        from jobplane.config import DEFAULT_UI_LISTEN

        ui = await _server_dashboard(
            stack, settings, server, args.ui_listen, default=DEFAULT_UI_LISTEN
        )
        if stop.is_set():
            return 0
        ui_line = f"  dashboard: {ui.url}   (sign in with the api key)\n" if ui else ""
        if parts is None:
            shown = "1 (server, relay and worker in this one, --processes 1)"
        else:
            pids = parts.pids
            here = "server" if layout.relay_apart else "server and relay"
            apart = f"relay {pids[-1]}; " if layout.relay_apart else ""
            workers = ", ".join(map(str, pids[: layout.workers]))
            shown = f"{processes} ({here} in this one, pid {os.getpid()}; {apart}workers {workers})"
        if json_lines():
            # The key is what this line is for: printed, not logged (a log line masks it).
            up = json_line(
                "dev.ready",
                address=server.address,
                processes=[os.getpid(), *(parts.pids if parts is not None else ())],
                api_key=key,
                tenant=args.tenant,
                dashboard=ui.url if ui is not None else None,
                worker_key=worker_key,
            )
            print(up, flush=True)
        else:
            print(
                f"\njobplane dev is up.\n"
                f"  address:  {server.address}\n"
                f"  processes: {shown}\n"
                f"  api key:  {key}   (tenant {args.tenant!r})\n"
                f"{ui_line}"
                f"  worker key: {worker_key}   (WorkerService, docs/workers.md)\n\n"
                f"  export JOBPLANE_ADDRESS={server.address} JOBPLANE_API_KEY={key}\n"
                f"  {_jobplane_command()} submit demo.progress"
                f' --payload \'{{"steps": 20, "interval_ms": 150}}\''
                " --watch\n",
                flush=True,
            )
        showing = asyncio.create_task(_dev_show(args, settings, server.address, key, ui, ingest))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({showing, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            await _cancelled(showing)  # its error, if it raised one
        if stop.is_set():
            return 0
        heap.settle()
        if json_lines():
            print(json_line("dev.serving"), flush=True)
        else:
            print("serving; Ctrl-C to stop", flush=True)
        if parts is None:
            await stop.wait()
            return 0
        return await _until_stopped_or_part_exit(stop, parts)


def _dev_command(args: argparse.Namespace) -> int:
    """``jobplane dev`` (and its parts), which end without the interpreter's teardown."""
    code = _run(_dev(args))
    if getattr(args, "stopped_in_order", False):
        _exit_now(code)
    return code


def _stopped_in_order(args: argparse.Namespace) -> Callable[..., None]:
    """An exit callback of the outermost stack: marks ``args`` when it closed without
    an error (every part it started stopped)."""

    def closed(exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            args.stopped_in_order = True

    return closed


def _exit_now(code: int) -> NoReturn:
    """Exit once everything was stopped in order, skipping the interpreter's teardown:
    collecting the heap of a process that served, relayed and worked takes seconds on
    a loaded machine, and one Ctrl-C must free the ports and end within two. The exit
    handlers still run (logging, tracing's last spans)."""
    atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _jobplane_command() -> str:
    """How a new shell runs this jobplane: ``jobplane`` when its PATH finds this very
    install without a virtualenv to activate (installed for the system, or linked
    onto PATH as pipx does), else the script's path (``.venv/bin/jobplane``, relative
    to the current directory when it is under it)."""
    import shutil

    script = Path(sys.executable).parent / "jobplane"
    found = shutil.which("jobplane")
    if found is not None and Path(found).resolve() == script.resolve():
        linked = Path(found).parent != script.parent
        if linked or sys.prefix == sys.base_prefix:
            return "jobplane"
    with contextlib.suppress(ValueError):
        return str(script.relative_to(Path.cwd()))
    return str(script)


class _AtOnce:
    """A second Ctrl-C of ``jobplane dev``: kill its parts and exit now."""

    parts: Any = None

    def __call__(self) -> None:
        print("\nstopping at once", file=sys.stderr, flush=True)
        if self.parts is not None:
            self.parts.kill()
        os._exit(130)


async def _dev_show(
    args: argparse.Namespace,
    settings: Settings,
    address: str,
    key: str,
    ui: Any,
    ingest: list[Path],
) -> None:
    """``jobplane dev --demo`` and ``--ingest``: the demo job live, then the files' ingestion."""
    from jobplane.client import AsyncClient

    if args.demo:
        from jobplane.client.cli import render_watch

        async with AsyncClient(address, key) as client:
            job = await client.submit(
                "demo.progress", {"steps": args.demo_steps, "interval_ms": 150}
            )
            if json_lines():
                print(json_line("dev.demo.submitted", job=job.name), flush=True)
            else:
                print(f"submitted {job.name} (demo.progress); its live progress:", flush=True)
                if ui is not None:
                    print(f"  on the dashboard: {ui.url}{job.name}", flush=True)
            # Its events as JSON objects too, with JSON logs.
            await render_watch(client, job.name, as_json=json_lines())
    if ingest:
        from jobplane.contrib.ingest.cli import ingest_files

        if not json_lines():
            print(
                f"\ningesting {', '.join(map(str, ingest))} (ingest.file: parse, chunk, "
                f"embed, index into Qdrant at {settings.qdrant_location}):",
                flush=True,
            )
        try:
            async with AsyncClient(address, key) as client:
                mode = "live" if sys.stdout.isatty() else "lines"
                await ingest_files(client, ingest, mode="json" if json_lines() else mode)
        except JobplaneError as exc:
            _error_line(f"the ingestion could not run: {exc}")
        else:
            if not json_lines():
                again = " ".join(map(str, ingest))
                command = _jobplane_command()
                print(f"  {command} ingest {again}   (again: changes nothing)\n", flush=True)


def _dev_worker(
    settings: Settings,
    topology: Topology,
    engine: AsyncEngine,
    db: Database,
    registry: Any,
    args: argparse.Namespace,
    blobs: BlobStore | None,
    metrics: Metrics,
    queues: list[str] | None = None,
) -> Any:
    """The worker of ``jobplane dev`` (in its own process, or a part of it)."""
    from jobplane.workers.runtime import Worker

    return Worker(
        engine,
        settings.database_url,
        settings.amqp_url,
        topology,
        registry,
        concurrency=args.concurrency,
        queues=queues,
        max_result_bytes=settings.max_payload_bytes,
        blobs=blobs,
        inline_bytes=settings.inline_bytes,
        interceptors=_worker_interceptors(metrics),
        db=db,
        sync_threads=settings.sync_threads,
    )


async def _dev_parts(
    stack: AsyncExitStack, args: argparse.Namespace, layout: Layout, ops: OpsServer | None
) -> Any:
    """Start the worker parts (and the relay's, when apart) of ``layout``
    (jobplane.devparts), stopped with ``stack``."""
    from jobplane.devparts import Parts, part_command, part_metrics, relay_command

    listen = ops.listen if ops is not None else None
    fallback = ops is not None and ops.fallback
    commands = [
        part_command(
            i,
            parent_pid=os.getpid(),
            metrics_listen=part_metrics(listen, i),
            handlers=args.handlers,
            concurrency=args.concurrency,
            no_maintenance=args.no_maintenance,
            ingest=args.ingest or (),
            metrics_fallback=fallback,
        )
        for i in range(layout.workers)
    ]
    names = [f"worker part {i}" for i in range(layout.workers)]
    if layout.relay_apart:
        commands.append(
            relay_command(
                parent_pid=os.getpid(),
                metrics_listen=part_metrics(listen, layout.workers),
                metrics_fallback=fallback,
            )
        )
        names.append("relay part")
    parts = Parts(commands, names)
    await _started(stack, parts.start, parts.stop)
    if ops is not None:
        ops.add_check("parts", parts.not_ready)
    return parts


async def _until_stopped_or_part_exit(stop: asyncio.Event, parts: Any) -> int:
    """Until ``stop`` (Ctrl-C or SIGTERM: 0), or a part exits on its own (1)."""
    exited = await _until_stopped(stop, parts.exited())
    # A Ctrl-C reaches the parts too, and they leave fast: one may have exited by
    # the time this process looks, and the stop is still the reason.
    if exited is not None and not stop.is_set():
        part, status = exited.result()
        _error_line(f"{part} exited (status {status}); stopping")
        return 1
    return 0


async def _dev_relay_part(args: argparse.Namespace) -> int:
    """The relay part of ``jobplane dev --processes N`` (jobplane.devparts): the relay
    and the sweeper."""
    from jobplane.devparts import parent_gone
    from jobplane.store.engine import create_engine
    from jobplane.workers.relay import Relay
    from jobplane.workers.sweeper import Sweeper

    settings, topology = _settings_and_topology(log_level="warning")
    _tracing("jobplane-dev", settings)
    engine = create_engine(settings.database_url, pool_size=settings.db_engine_pool_size)
    async with AsyncExitStack() as stack:
        stack.push(_stopped_in_order(args))
        stack.push_async_callback(engine.dispose)
        metrics, ops = _ops(settings, args, engine)
        relay_db, in_flight = _relay_pool(stack, settings)
        observed = _relay_interceptors(metrics)
        relay = Relay(
            engine,
            settings.database_url,
            settings.amqp_url,
            topology,
            interceptors=observed,
            db=relay_db,
            in_flight=in_flight,
        )
        if ops is not None:
            ops.add_check("relay", lambda: None if relay.connected else "no broker channel")
        await _start_ops(stack, ops)
        # Caught until the part has stopped: the parent's SIGTERM after a Ctrl-C
        # must not end it halfway through stopping.
        stop = stack.enter_context(_stop_signals())
        await _started(stack, relay.start, relay.stop)
        await stack.enter_async_context(Sweeper(engine, topology=topology, interceptors=observed))
        await _until_stopped(stop, parent_gone(args.parent_pid or os.getppid()))
    return 0


async def _dev_part(args: argparse.Namespace) -> int:
    """One worker part of ``jobplane dev --processes N`` (jobplane.devparts)."""
    from jobplane.devparts import GRACE, parent_gone, part_queues
    from jobplane.store.engine import create_engine
    from jobplane.workers.runtime import worker_pool_size

    settings, topology = _settings_and_topology(log_level="warning")
    _tracing("jobplane-dev", settings)
    first = args.worker_part == 0
    registry = _registry_or_none(args.handlers, demo=True)
    if registry is None:
        return 2
    queues = None
    ingest = [Path(f) for f in args.ingest or ()]
    if first:
        if ingest:
            registry = _with_ingest(registry, ingest, settings, topology)
            if registry is None:
                return 2
    else:
        queues = part_queues(topology)
    engine = create_engine(settings.database_url, pool_size=settings.db_engine_pool_size)
    async with AsyncExitStack() as stack:
        stack.push(_stopped_in_order(args))
        stack.push_async_callback(engine.dispose)
        metrics, ops = _ops(settings, args, engine)
        blobs = _blob_store(settings, stack)
        db = _database(
            stack, settings, min(settings.db_pool_size, worker_pool_size(args.concurrency))
        )
        if first and not args.no_maintenance:
            faults = FaultPoints(settings.faults)
            registry = await _with_maintenance(stack, registry, engine, db, blobs, settings, faults)
            if registry is None:
                return 2
        worker = _dev_worker(settings, topology, engine, db, registry, args, blobs, metrics, queues)
        if ops is not None:
            ops.add_check("broker", worker.not_ready)
        await _start_ops(stack, ops)
        # Caught until the part has stopped (see _dev_relay_part).
        stop = stack.enter_context(_stop_signals())
        await _started(stack, worker.start, lambda: worker.stop(GRACE))
        await _until_stopped(stop, parent_gone(args.parent_pid or os.getppid()))
    return 0


async def _dlq(args: argparse.Namespace) -> int:
    from jobplane.store.engine import create_engine
    from jobplane.workers.dlq import FailedQueue

    settings, topology = _settings_and_topology(log_level="warning")
    failed = FailedQueue(settings.amqp_url, topology)
    if args.dlq == "list":
        for message in await failed.list(args.limit):
            if args.json:
                print(json.dumps(message.as_dict(), sort_keys=True))
            else:
                env = message.envelope
                what = f"jobs/{env.job_id} ({env.job_type})" if env else message.problem
                print(f"{message.reason or '-':<16} {message.source_queue or '-':<28} {what}")
        return 0
    if args.dlq == "replay":
        engine = create_engine(settings.database_url, pool_size=2)
        try:
            report = await failed.replay(engine, args.limit)
        finally:
            await engine.dispose()
        for name in report.replayed:
            print(f"replayed  {name}")
        for name in report.finished:
            print(f"finished  {name} (already ended; message dropped)")
        for name in report.kept:
            print(f"kept      {name} (no job to re-dispatch, or a live attempt holds it)")
        return 0
    if not args.yes:
        print("error: purge drops every failed message; add --yes", file=sys.stderr)
        return 2
    print(f"purged {await failed.purge()} messages", file=sys.stderr)
    return 0


async def _keys(args: argparse.Namespace) -> int:
    from jobplane.store.engine import create_engine
    from jobplane.store.keys import KeyNotFound, KeyRevoked, KeyStore

    settings = Settings.from_env()
    configure(settings.log_level or "warning", settings.log_format)
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        return await _keys_command(KeyStore(engine), args)
    except (KeyNotFound, KeyRevoked) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a tenant name, --grace or --after out of range
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        await engine.dispose()


async def _keys_command(keys: KeyStore, args: argparse.Namespace) -> int:
    if args.keys == "create":
        if args.worker:
            created = await keys.create_worker()
            print(created.key)
            print(f"created worker key {created.key_id} (WorkerService only)", file=sys.stderr)
            return 0
        created = await keys.create(args.tenant)
        # stdout carries the secret alone, for `$(jobplane keys create ...)`.
        print(created.key)
        print(f"created {created.key_id} for tenant {created.tenant!r}", file=sys.stderr)
        return 0
    if args.keys == "list":
        listed = await keys.list_keys(args.tenant)
        if args.json:
            for info in listed:
                print(json.dumps(_key_json(info), sort_keys=True))
        else:
            _print_keys(listed)
        return 0
    if args.keys == "revoke":
        info = await keys.revoke(args.key_id, after=_key_seconds(args.after, "--after"))
        if info.active and info.revoke_time is not None:
            ends = info.revoke_time.isoformat(timespec="seconds")
            print(f"{info.key_id} (tenant {info.tenant!r}) ends at {ends}", file=sys.stderr)
        else:
            print(f"revoked {info.key_id} (tenant {info.tenant!r})", file=sys.stderr)
        return 0
    created, old = await keys.rotate(args.key_id, grace=_key_seconds(args.grace, "--grace"))
    print(created.key)
    ends = old.revoke_time.isoformat(timespec="seconds") if old.revoke_time else "-"
    owner = "worker key" if not created.tenant else f"for tenant {created.tenant!r}"
    print(f"created {created.key_id} {owner}; {old.key_id} ends at {ends}", file=sys.stderr)
    return 0


async def _tenants(args: argparse.Namespace) -> int:
    from jobplane.errors import JobplaneError, TenantNotFound
    from jobplane.store.engine import create_engine

    settings = Settings.from_env()
    configure(settings.log_level or "warning", settings.log_format)
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        return await _tenants_command(engine, args)
    except TenantNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (JobplaneError, ValueError) as exc:  # a horizon out of range, a route missing
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        await engine.dispose()


def _retention_days(value: str) -> int | None:
    """DAYS of ``tenants set-retention``: a whole number of days, or ``none``."""
    if value.lower() in ("none", "off", "forever"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"DAYS must be a whole number of days or 'none', got {value!r}"
        ) from None


async def _tenants_command(engine: AsyncEngine, args: argparse.Namespace) -> int:
    import uuid
    from datetime import UTC

    from jobplane.store.maintenance import MaintenanceStore
    from jobplane.workers.maintenance import ERASURE, RETENTION

    store = MaintenanceStore(engine)
    if args.tenants == "list":
        for tenant in await store.tenants():
            if args.json:
                print(
                    json.dumps(
                        {
                            "id": str(tenant.id),
                            "name": tenant.name,
                            "retention_days": tenant.retention_days,
                        },
                        sort_keys=True,
                    )
                )
            else:
                days = "-" if tenant.retention_days is None else f"{tenant.retention_days}d"
                print(f"{tenant.name:<40}  {days:>7}  {tenant.id}")
        return 0
    if args.tenants == "set-retention":
        tenant = await store.set_retention(args.tenant, args.days)
        kept = "for ever" if tenant.retention_days is None else f"{tenant.retention_days} days"
        print(f"tenant {tenant.name!r}: finished jobs and events are kept {kept}", file=sys.stderr)
        return 0
    if args.tenants == "retention":
        if args.all:
            names = [t.name for t in await store.tenants() if t.retention_days is not None]
        else:
            names = [(await store.tenant_named(name)).name for name in args.tenant]
        if not names:
            print("no tenant has a retention horizon", file=sys.stderr)
            return 0
        # One run per tenant and day: a cron that fires twice submits once.
        day = datetime.now(UTC).strftime("%Y-%m-%d")
        jobs = [
            await _submit_maintenance(engine, name, RETENTION, {}, f"{RETENTION}/{day}")
            for name in names
        ]
    else:  # erase
        if not args.yes:
            print(
                f"error: erasing deletes every job, event, blob and index point of tenant "
                f"{args.tenant!r}; add --yes",
                file=sys.stderr,
            )
            return 2
        tenant = await store.tenant_named(args.tenant)
        payload = {"confirm": tenant.name}
        jobs = [
            await _submit_maintenance(
                engine, tenant.name, ERASURE, payload, f"{ERASURE}/{uuid.uuid4()}"
            )
        ]
    for name, job_id in jobs:
        print(f"jobs/{job_id}")
        print(f"submitted jobs/{job_id} for tenant {name!r}", file=sys.stderr)
    if not args.wait:
        return 0
    failed = 0
    for name, job_id in jobs:
        failed += not await _wait_maintenance(engine, name, job_id)
    return 1 if failed else 0


async def _submit_maintenance(
    engine: AsyncEngine, tenant: str, job_type: str, payload: dict[str, Any], request_id: str
) -> tuple[str, Any]:
    """Submit a maintenance job for ``tenant`` through the database (jobplane.submit_job)."""
    from jobplane import txn

    async with engine.begin() as conn:
        job_id = await txn.submit_job(
            conn, tenant=tenant, type=job_type, payload=payload, request_id=request_id
        )
    return tenant, job_id


async def _wait_maintenance(engine: AsyncEngine, tenant: str, job_id: Any) -> bool:
    """Print the job's progress until it ends; True when it succeeded."""
    from jobplane.store.db import Database
    from jobplane.store.jobs import JobStore
    from jobplane.store.maintenance import MaintenanceStore

    tenant_id = (await MaintenanceStore(engine).tenant_named(tenant)).id
    # The configured URL, not the engine's: that shows a URL of several hosts bare.
    async with Database(Settings.from_env().database_url, size=1) as db:
        return await _follow_maintenance(JobStore(engine, db), tenant_id, job_id)


async def _follow_maintenance(jobs: JobStore, tenant_id: Any, job_id: Any) -> bool:
    from jobplane.types import JobState

    said = ""
    while True:
        job = await jobs.get(tenant_id, job_id)
        line = f"jobs/{job_id} {job.state.name} {job.progress:.0%} {job.progress_message}"
        if line != said:
            print(line, file=sys.stderr)
            said = line
        if job.state.terminal:
            if job.result is not None:
                print(json.dumps(job.result, sort_keys=True))
            if job.error is not None:
                print(f"error: {job.error.code}: {job.error.message}", file=sys.stderr)
            return job.state is JobState.SUCCEEDED
        await asyncio.sleep(0.5)


# Far past any key's life, and keeps now() + SECONDS within Postgres' timestamps.
_KEY_SECONDS_MAX = 100 * 365 * 86_400


def _key_seconds(value: str, flag: str) -> float:
    """SECONDS of ``keys revoke --after`` and ``rotate --grace``, checked here rather than
    by argparse so that a bad one is a single line (ValueError) like the command's others."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds <= _KEY_SECONDS_MAX:  # also refuses nan and inf
        raise ValueError(
            f"{flag} must be a number of seconds from 0 to {_KEY_SECONDS_MAX:,}, got {value!r}"
        )
    return seconds


def _key_json(info: KeyInfo) -> dict[str, Any]:
    def when(value: datetime | None) -> str | None:
        return value.isoformat() if value else None

    return {
        "key_id": info.key_id,
        "tenant": info.tenant,
        "tenant_id": None if info.tenant_id is None else str(info.tenant_id),
        "scope": info.scope.value,
        "prefix": info.prefix,
        "create_time": when(info.create_time),
        "revoke_time": when(info.revoke_time),
        "last_used_time": when(info.last_used_time),
        "active": info.active,
    }


def _print_keys(listed: list[KeyInfo]) -> None:
    def when(value: datetime | None) -> str:
        return value.isoformat(timespec="seconds") if value else "-"

    rows = [("KEY ID", "TENANT", "PREFIX", "CREATED", "REVOKED", "LAST USED")]
    for info in listed:
        revoked = when(info.revoke_time) + ("" if not info.active or not info.revoke_time else "*")
        rows.append(
            (
                info.key_id,
                info.tenant or "(worker)",
                info.prefix,
                when(info.create_time),
                revoked,
                when(info.last_used_time),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    if any(info.active and info.revoke_time for info in listed):
        print(
            "* still valid until then (rotated with a grace period or revoked for later)",
            file=sys.stderr,
        )


async def _workers(args: argparse.Namespace) -> int:

    from jobplane.store.engine import create_engine
    from jobplane.store.workers import WorkerStore

    settings = Settings.from_env()
    configure(settings.log_level or "warning", settings.log_format)
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        workers = await WorkerStore(engine).list(dead_for=args.dead_for)
    finally:
        await engine.dispose()
    if args.json:
        for w in workers:
            print(
                json.dumps(
                    {
                        "id": str(w.id),
                        "status": w.status,
                        "host": w.host,
                        "pid": w.pid,
                        "types": list(w.types),
                        "queues": list(w.queues),
                        "concurrency": w.concurrency,
                        "version": w.version,
                        "start_time": w.start_time.isoformat(),
                        "heartbeat_time": w.heartbeat_time.isoformat(),
                        "stop_time": w.stop_time.isoformat() if w.stop_time else None,
                    },
                    sort_keys=True,
                )
            )
        return 0
    if not workers:
        print("no live workers", file=sys.stderr)
        return 0
    print(f"{'ID':<36}  {'STATUS':<7}  {'HOST:PID':<24}  {'CONC':>4}  {'LAST BEAT':<20}  TYPES")
    for w in workers:
        where = f"{w.host}:{w.pid}"
        beat = w.heartbeat_time.isoformat(timespec="seconds").replace("+00:00", "Z")
        print(
            f"{w.id!s:<36}  {w.status:<7}  {where:<24}  {w.concurrency:>4}  {beat:<20}  "
            f"{', '.join(w.types) or '-'}  (queues: {', '.join(w.queues)})"
        )
    return 0


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, for an operator's terminal (not a log)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


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
        print(
            f"declared exchange {topology.exchange} and queues {names}; "
            f"events exchange {topology.events_exchange}",
            file=sys.stderr,
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
            )
        except (DBAPIError, OSError) as exc:
            print(
                f"owner not recorded (Postgres: {_first_line(exc)}); "
                "the first relay or worker records it",
                file=sys.stderr,
            )
            return 0
        finally:
            await engine.dispose()
        ownership = await claim_ownership(
            connection, topology, deployment, take_over=args.take_ownership
        )
    if ownership.conflict:
        print(
            f"error: this topology is owned by deployment {ownership.describe_owner()}, not by "
            f"this one, {deployment}: both would consume the same queues. Give each its own "
            "vhost or topology names, or run `jobplane topology apply --take-ownership` if the "
            "other deployment is gone",
            file=sys.stderr,
        )
        return 1
    print(f"owner: deployment {deployment}", file=sys.stderr)
    return 0


def _async(fn: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]) -> Callable[..., int]:
    def call(args: argparse.Namespace) -> int:
        return _run(fn(args))

    return call


def _dispatch_repair_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--republish-after",
        type=float,
        default=600.0,
        help="seconds a QUEUED job's published dispatch may go unclaimed before it is "
        "published again (doubling with each re-publish)",
    )
    parser.add_argument(
        "--unroutable-after",
        type=float,
        default=300.0,
        help="seconds of returned (unroutable) publishes, at least 5, before a job fails "
        "with JOB_TYPE_UNROUTABLE",
    )


def _metrics_option(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        default=None,
        help="serve /metrics, /livez and /readyz here, or 'off' (default: "
        f"JOBPLANE_METRICS_LISTEN, else {METRICS_DEFAULTS[command]})",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``jobplane`` command."""
    parser = argparse.ArgumentParser(
        prog="jobplane",
        description="jobplane: durable jobs with live progress over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"jobplane {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("migrate", help="create the database if needed and migrate it").set_defaults(
        func=_async(_migrate)
    )
    serve = sub.add_parser("serve", help="run the gRPC server (and the dashboard, if asked)")
    serve.set_defaults(func=_async(_serve))
    serve.add_argument(
        "--ui-listen", help="serve the dashboard on host:port too (off: not); JOBPLANE_UI_LISTEN"
    )
    ui_cmd = sub.add_parser("ui", help="serve the dashboard alone (docs/dashboard.md)")
    ui_cmd.add_argument("--listen", help="host:port (default JOBPLANE_UI_LISTEN, 127.0.0.1:8080)")
    ui_cmd.set_defaults(func=_async(_ui))
    relay = sub.add_parser("relay", help="publish the outbox to RabbitMQ (and sweep)")
    relay.add_argument("--no-sweep", action="store_true", help="do not run the sweeper loop")
    relay.add_argument("--sweep-interval", type=float, default=5.0, help="seconds between sweeps")
    relay.add_argument(
        "--lease-grace", type=float, default=5.0, help="seconds past a lease before repair"
    )
    _dispatch_repair_options(relay)
    relay.set_defaults(func=_async(_relay))

    sweep = sub.add_parser("sweep", help="repair expired leases and stuck outbox rows")
    sweep.add_argument("--once", action="store_true", help="one pass, then exit")
    sweep.add_argument("--interval", type=float, default=5.0, help="seconds between passes")
    sweep.add_argument(
        "--lease-grace", type=float, default=5.0, help="seconds past a lease before repair"
    )
    _dispatch_repair_options(sweep)
    sweep.set_defaults(func=_async(_sweep))

    worker = sub.add_parser("worker", help="run job handlers")
    worker.add_argument("--handlers", help="package.module:registry to load")
    worker.add_argument("--demo", action="store_true", help="also load the demo handlers")
    worker.add_argument("--concurrency", type=int, default=8, help="handlers run at once")
    worker.add_argument("--prefetch", type=int, default=None, help="unacked messages held")
    worker.add_argument(
        "--reserve",
        type=int,
        default=None,
        help="slots only the highest-priority queues may use (default: a quarter)",
    )
    worker.add_argument("--queue", action="append", help="consume only this queue (repeatable)")
    worker.add_argument(
        "--no-maintenance",
        action="store_true",
        help="do not run the maintenance jobs (maintenance.retention, maintenance.erasure)",
    )
    worker.add_argument("--grace", type=float, default=10.0, help="seconds to finish on stop")
    worker.add_argument(
        "--lease-seconds", type=float, default=30.0, help="lease of an attempt; heartbeats at 1/3"
    )
    worker.add_argument(
        "--group-window",
        type=float,
        default=2.0,
        help="milliseconds concurrent claims and outcomes wait to go out as one statement "
        "(ADR-0028); 0: each alone",
    )
    worker.add_argument(
        "--group-max", type=int, default=64, help="the largest group: it goes out at once"
    )
    worker.set_defaults(func=_async(_worker))

    dev = sub.add_parser("dev", help="migrate, then serve + relay + worker in one command")
    dev.add_argument("--tenant", default="dev", help="tenant of the printed API key")
    dev.add_argument("--handlers", help="package.module:registry to load besides the demos")
    dev.add_argument("--concurrency", type=int, default=8, help="handlers run at once, per worker")
    dev.add_argument(
        "--processes",
        default="auto",
        help="1: all in this process; 2: server and relay here, a worker in a child "
        "process; N>2: the server here, the relay and N-2 workers in child processes; "
        "auto (the default): 1 on one CPU, else a worker per CPU but one beside the "
        "server and the relay (3 on two CPUs), at most 6",
    )
    # A part of `dev --processes N` (jobplane.devparts); not for users.
    dev.add_argument("--worker-part", type=int, default=None, help=argparse.SUPPRESS)
    dev.add_argument("--relay-part", action="store_true", help=argparse.SUPPRESS)
    dev.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    dev.add_argument("--metrics-fallback", action="store_true", help=argparse.SUPPRESS)
    dev.add_argument("--demo", action="store_true", help="submit a demo job and show it live")
    dev.add_argument("--demo-steps", type=int, default=20)
    dev.add_argument("--ui-listen", help="the dashboard's host:port (off: none; 127.0.0.1:8080)")
    dev.add_argument(
        "--no-maintenance", action="store_true", help="do not run the maintenance jobs"
    )
    dev.add_argument(
        "--ingest",
        action="append",
        metavar="FILE",
        help="also run the ingest handlers, then upload FILE and show its ingestion live "
        "(repeatable; needs JOBPLANE_S3_URL and JOBPLANE_TOPOLOGY=builtin:dev or builtin:ingest)",
    )
    dev.set_defaults(func=_dev_command)
    for parser_, command in ((serve, "serve"), (relay, "relay"), (worker, "worker")):
        _metrics_option(parser_, command)
    _metrics_option(sweep, "sweep")
    _metrics_option(dev, "dev")

    dlq = sub.add_parser("dlq", help="the failed (dead-letter) queue").add_subparsers(
        dest="dlq", required=True
    )
    dlq_list = dlq.add_parser("list", help="show failed messages (they stay queued)")
    dlq_list.add_argument("--limit", type=int, default=100)
    dlq_list.add_argument("--json", action="store_true")
    dlq_replay = dlq.add_parser("replay", help="re-dispatch their jobs through the outbox")
    dlq_replay.add_argument("--limit", type=int, default=100)
    dlq_purge = dlq.add_parser("purge", help="drop every failed message")
    dlq_purge.add_argument("--yes", action="store_true", help="really drop them")
    for parser_ in (dlq_list, dlq_replay, dlq_purge):
        parser_.set_defaults(func=_async(_dlq))

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys", required=True)
    create = keys.add_parser("create", help="create a key (and the tenant); prints the key")
    owner = create.add_mutually_exclusive_group(required=True)
    owner.add_argument("--tenant", help="a tenant key: JobService and EventService")
    owner.add_argument(
        "--worker",
        action="store_true",
        help="a worker key: WorkerService only, for every tenant's jobs (docs/workers.md)",
    )
    keys_list = keys.add_parser("list", help="list keys by id (never the keys themselves)")
    keys_list.add_argument("--tenant", help="only this tenant's keys")
    keys_list.add_argument("--json", action="store_true", help="one JSON object per key")
    revoke = keys.add_parser("revoke", help="revoke a key now or later, on every server")
    revoke.add_argument("key_id", metavar="KEY_ID", help="the key's id (key_...)")
    revoke.add_argument(
        "--after",
        metavar="SECONDS",
        default="0",
        help="the key keeps working this long (default: revoked at once)",
    )
    rotate = keys.add_parser(
        "rotate", help="create a new key for the key's tenant and revoke the old one"
    )
    rotate.add_argument("key_id", metavar="KEY_ID", help="the key's id (key_...)")
    rotate.add_argument(
        "--grace",
        metavar="SECONDS",
        default="0",
        help="the old key keeps working this long (default: revoked at once)",
    )
    for parser_ in (create, keys_list, revoke, rotate):
        parser_.set_defaults(func=_async(_keys))

    tenants = sub.add_parser(
        "tenants", help="tenants: retention horizons, retention runs, erasure"
    ).add_subparsers(dest="tenants", required=True)
    tenants_list = tenants.add_parser("list", help="tenants and their retention horizons")
    tenants_list.add_argument("--json", action="store_true", help="one JSON object per tenant")
    set_retention = tenants.add_parser(
        "set-retention",
        help="keep the tenant's finished jobs and events DAYS days ('none': for ever)",
    )
    set_retention.add_argument("tenant", metavar="TENANT")
    set_retention.add_argument("days", metavar="DAYS", type=_retention_days)
    retention = tenants.add_parser(
        "retention", help="submit maintenance.retention for tenants (at most one a day each)"
    )
    which = retention.add_mutually_exclusive_group(required=True)
    which.add_argument("tenant", metavar="TENANT", nargs="*", default=[])
    which.add_argument("--all", action="store_true", help="every tenant that has a horizon")
    erase = tenants.add_parser(
        "erase", help="submit maintenance.erasure: delete all of the tenant's data"
    )
    erase.add_argument("tenant", metavar="TENANT")
    erase.add_argument("--yes", action="store_true", help="really erase it")
    for parser_ in (retention, erase):
        parser_.add_argument("--wait", action="store_true", help="show progress until it ends")
    for parser_ in (tenants_list, set_retention, retention, erase):
        parser_.set_defaults(func=_async(_tenants))

    workers = sub.add_parser(
        "workers",
        help="list live workers (and those that stopped recently)",
        description="Workers register in Postgres: what they run, where, and when they last "
        "beat. 'stopped' ones said so; 'lost' ones stopped beating (killed, hung, cut off).",
    )
    workers.add_argument(
        "--dead-for",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="also list workers stopped or lost this recently (default 3600)",
    )
    workers.add_argument("--json", action="store_true", help="one JSON object per worker")
    workers.set_defaults(func=_async(_workers))

    topology = sub.add_parser("topology", help="RabbitMQ topology").add_subparsers(
        dest="topology", required=True
    )
    apply = topology.add_parser(
        "apply", help="declare exchanges and queues (needs an account that may configure)"
    )
    apply.add_argument(
        "--take-ownership",
        action="store_true",
        help="record this deployment as the topology's owner, replacing another",
    )
    apply.set_defaults(func=_async(_topology_apply))

    from jobplane.client.cli import register

    register(sub)
    return parser


_OPERATOR_COMMANDS = frozenset({"migrate", "keys", "tenants", "dlq", "topology", "sweep"})


def _service_of(exc: BaseException) -> str | None:
    """ "database" or "broker": whose driver raised ``exc`` (None: neither)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        modules = []
        while tb is not None:
            modules.append(str(tb.tb_frame.f_globals.get("__name__", "")))
            tb = tb.tb_next
        for module in reversed(modules):  # the innermost frame decides
            if module.startswith(("asyncpg", "sqlalchemy", "alembic")):
                return "database"
            if module.startswith(("aiormq", "aio_pika", "pamqp")):
                return "broker"
        current = current.__cause__ or current.__context__
    return None


def _fatal_message(exc: Exception) -> str | None:
    """One line for an operator when a service is down or refuses; None: a bug."""
    from jobplane.store.down import database_down, sqlstate

    settings = Settings.from_env()
    first = _first_line(exc)
    service = _service_of(exc)
    if service == "database":
        where = _without_password(settings.database_url)
        if database_down(exc):
            return f"cannot reach Postgres at {where}: {first}"
        state = sqlstate(exc)
        if state == "42P01":
            return f"the database at {where} has no jobplane tables: run `jobplane migrate`"
        if state == "3D000":
            return f"the database at {where} does not exist: run `jobplane migrate`"
        return f"Postgres at {where} refused: {first}"
    if service == "broker":
        where = _without_password(settings.amqp_url)
        import aiormq

        if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError):
            return f"RabbitMQ at {where} refused the login: {first}"
        if isinstance(exc, OSError | aiormq.exceptions.AMQPConnectionError | TimeoutError):
            return f"cannot reach RabbitMQ at {where}: {first}"
        return f"RabbitMQ at {where} refused: {first}"
    return None


def _without_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    from jobplane.store.dsn import SCHEMES, redacted

    if url.partition("://")[0] in SCHEMES:  # libpq's forms too (several hosts, ?password=)
        return redacted(url)

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an AMQP URL SQLAlchemy cannot parse: say only the scheme
        return url.rsplit("@", maxsplit=1)[-1] if "@" in url else url


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``jobplane`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in _OPERATOR_COMMANDS:
        # The drivers log a failed connect themselves; the command says it
        # once, in its own line.
        logging.getLogger("aiormq").setLevel(logging.CRITICAL)
    try:
        code = args.func(args)
    except (ConfigError, TopologyError) as exc:
        _error_line(str(exc))
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # The reader went away (``| head``): point stdout at /dev/null so the
        # flush at exit does not fail a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 1
    except Exception as exc:
        message = _fatal_message(exc)
        if message is None:
            raise
        _error_line(message)
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    raise SystemExit(code)
