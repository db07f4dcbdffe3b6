"""What the process commands of ``jobplane`` share: the event loop, the stop
signals, the settings and the logging they set up, the ops listener, tracing
and the observers a worker or relay is handed, and the pools and blob store a
process owns (closed with its exit stack).

The commands' own modules (jobplane.server.cli, jobplane.server.admin,
jobplane.server.dev, jobplane.workers.cli) build their processes with these.
Nothing here imports a server or worker module before it is called, so the
worker install (ADR-0033) loads it. The names keep their underscore: they are
the commands' helpers, not an API.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from jobplane import heap
from jobplane.config import (
    OTLP_GRPC_MODULE,
    ConfigError,
    Settings,
    parse_listen,
    requested_log_format,
)
from jobplane.console import extra_install, missing_modules
from jobplane.logs import configure, json_line, json_lines, scrub, set_job_prefixes
from jobplane.topology import Topology, load_topology

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.blobs import BlobStore
    from jobplane.observe.http import OpsServer
    from jobplane.observe.metrics import Metrics
    from jobplane.store.db import Database
    from jobplane.workers.interceptors import Interceptor, RelayInterceptor


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(coro)
    return uvloop.run(coro)


def _async(fn: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]) -> Callable[..., int]:
    def call(args: argparse.Namespace) -> int:
        return _run(fn(args))

    return call


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

        # The command's logger, whichever module says it: the lines stay as they were.
        getattr(structlog.get_logger("jobplane.cli"), level)(event, **fields)


def _json_asked() -> bool:
    """Whether JSON logs were configured or, the settings unread, asked for."""
    return json_lines() or requested_log_format() == "json"


def _answer(event: str, text: str, *, level: str = "info", **fields: Any) -> None:
    """The command's answer on stderr: ``text``; with JSON logs, one ``event`` line
    with ``fields`` (their text scrubbed). Shown whatever the log level: it is what
    the operator asked for, not a log line. Never a secret: a key goes to stdout."""
    if _json_asked():
        values = {k: scrub(v) if isinstance(v, str) else v for k, v in fields.items()}
        print(json_line(event, level, **values), file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)


def _error_line(message: str) -> None:
    """``error: message`` on stderr: a ``command.failed`` JSON line when JSON logs were
    asked for (the settings may be what failed, so asked of the environment)."""
    if _json_asked():
        print(json_line("command.failed", "error", error=scrub(message)), file=sys.stderr)
    else:
        print(f"error: {message}", file=sys.stderr)


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, for an operator's terminal (not a log)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:300]


#: Each command's ops listener (/metrics, /livez, /readyz) when JOBPLANE_METRICS_LISTEN is
#: unset: apart, so the processes of one host do not collide.
METRICS_DEFAULTS = {
    "serve": "127.0.0.1:9460",
    "relay": "127.0.0.1:9461",
    "worker": "127.0.0.1:9462",
    "sweep": "127.0.0.1:9463",
    "dev": "127.0.0.1:9464",
}


def _metrics_option(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        default=None,
        help="serve /metrics, /livez and /readyz here, or 'off' (default: "
        f"JOBPLANE_METRICS_LISTEN, else {METRICS_DEFAULTS[command]})",
    )


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


async def _started(
    stack: AsyncExitStack, start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]
) -> None:
    await start()
    stack.push_async_callback(stop)


async def _cancelled(task: asyncio.Task[Any]) -> None:
    from jobplane.tasks import cancel_and_wait

    await cancel_and_wait(task)


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
