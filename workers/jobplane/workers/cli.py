"""The worker side's commands of ``jobplane``: ``worker`` (job handlers),
``relay`` (the outbox to RabbitMQ, and the sweeper), ``sweep`` (repairs and
recurring schedules, once or in a loop) and ``dlq`` (the failed queue), each with its arguments.

jobplane.cli imports this module only when one of them runs (or for the whole
parser); with the worker install (ADR-0033) ``jobplane worker`` runs from it
without the server's libraries, so it imports none of the server's modules.
``jobplane dev`` (jobplane.server.dev) loads its handlers with
:func:`_registry_or_none` and :func:`_with_maintenance`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from jobplane.config import DEFAULT_WORKER_CONCURRENCY, Settings
from jobplane.faults import FaultPoints
from jobplane.process import (
    _answer,
    _async,
    _blob_store,
    _database,
    _error_line,
    _failed_queue_depth,
    _metrics_option,
    _ops,
    _relay_interceptors,
    _say,
    _settings_and_topology,
    _start_ops,
    _started,
    _stop_signals,
    _tracing,
    _until_signal,
    _worker_interceptors,
)
from jobplane.workers.fairness import FairSettings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.blobs import BlobStore
    from jobplane.store.db import Database
    from jobplane.workers.relay import Relay
    from jobplane.workers.sweeper import Sweeper, SweepReport


def _relay_pool(stack: AsyncExitStack, settings: Settings) -> tuple[Database, int]:
    """A relay's pool (at most JOBPLANE_DB_POOL_SIZE) and the batches in flight it
    has the connections for: more batches than connections would wait for one
    another's, and time out as a full pool."""
    from jobplane.workers.relay import relay_in_flight, relay_pool_size

    size = min(settings.db_pool_size, relay_pool_size())
    return _database(stack, settings, size), relay_in_flight(size)


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
        faults = FaultPoints(settings.faults)
        relay = Relay(
            engine,
            settings.database_url,
            settings.amqp_url,
            topology,
            faults=faults,
            unroutable_after=args.unroutable_after,
            interceptors=observed,
            db=relay_db,
            in_flight=in_flight,
            fair=_fair_settings(args),
            listen_url=settings.direct_url,
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
                faults=faults,
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
    from jobplane.observe.metrics import NO_METRICS, watch_outbox
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
        faults = FaultPoints(settings.faults)
        sweeper = Sweeper(
            engine,
            topology=topology,
            lease_grace=args.lease_grace,
            republish_after=args.republish_after,
            interceptors=_relay_interceptors(metrics),
            faults=faults,
        )
        scheduler = sweeper.scheduler
        if not args.once:
            # Schedules tick beside the passes, every second, and deadlines are looked
            # at on a clock of their own (about a second), as in a relay's sweeper.
            if scheduler is not None:
                await _started(stack, scheduler.start, scheduler.stop)
            await _started(stack, sweeper.deadlines.start, sweeper.deadlines.stop)
        relay_db, in_flight = _relay_pool(stack, settings)
        # Its one pass traces as the relay does; its rows are counted by the relays.
        relay = Relay(
            engine,
            settings.database_url,
            settings.amqp_url,
            topology,
            faults=faults,
            unroutable_after=args.unroutable_after,
            interceptors=_relay_interceptors(NO_METRICS),
            db=relay_db,
            in_flight=in_flight,
            fair=_fair_settings(args),
            listen_url=settings.direct_url,
        )
        if args.once:
            await _sweep_pass(sweeper, relay, args)
            return 0
        # SIGTERM (a pod's stop) ends the loop between passes: a pass is not cut short.
        with _stop_signals() as stop:
            while not stop.is_set():
                if not await _sweep_pass(sweeper, relay, args, stop):
                    continue  # the database was down: _swept waited already
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.interval)
        return 0
    finally:
        await stack.aclose()
        await engine.dispose()


async def _sweep_pass(
    sweeper: Sweeper, relay: Relay, args: argparse.Namespace, stop: asyncio.Event | None = None
) -> bool:
    """One pass of ``jobplane sweep``, said as ``sweep.done``; False when the
    database was down (said so, and waited ``--interval``)."""
    report = await _swept(sweeper, args, stop)
    if report is None:
        return False
    if args.once and sweeper.scheduler is not None:
        await sweeper.scheduler.tick_once()
    published = await _drained(relay, args)
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
    return True


async def _swept(
    sweeper: Sweeper, args: argparse.Namespace, stop: asyncio.Event | None
) -> SweepReport | None:
    """One pass of ``sweeper``; None when the loop of ``jobplane sweep`` could not
    sweep (said so and waited ``--interval``, or less if ``stop`` is set: the next
    pass comes at once)."""
    from jobplane.logs import describe_error
    from jobplane.store.down import database_down, database_transient

    try:
        return await sweeper.sweep_once()
    except Exception as exc:
        # A loop outlives a database restart, a failover or a full disk, as a
        # relay's sweeper does; a single pass reports it (main).
        if args.once:
            raise
        error = describe_error(exc)
        if database_down(exc):
            _said_retry(
                "database.unavailable", f"database unavailable, not swept: {error}", error, args
            )
        elif database_transient(exc):
            _said_retry("sweeper.db.error", f"sweep failed, trying again: {error}", error, args)
        else:
            _said_retry(
                "sweeper.error", f"sweep failed, trying again: {error}", error, args, level="error"
            )
        await _waited(stop, args.interval)
        return None


def _said_retry(
    event: str, text: str, error: str, args: argparse.Namespace, *, level: str = "warning"
) -> None:
    """Tell the operator a pass of ``jobplane sweep`` failed and is tried again."""
    _say(event, text, level=level, error=error, retry_in=args.interval)


async def _waited(stop: asyncio.Event | None, seconds: float) -> None:
    """Sleep ``seconds``, or until ``stop`` is set."""
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def _drained(relay: Relay, args: argparse.Namespace) -> int:
    """The outbox rows one drain of ``relay`` published; 0 when the loop of
    ``jobplane sweep`` found the broker or the database down (said so)."""
    from jobplane import broker
    from jobplane.logs import describe_error
    from jobplane.store.down import database_unavailable

    try:
        return await relay.drain_once()
    except Exception as exc:
        # A loop outlives a broker restart or a database error; a single pass
        # reports it (main). The rows stay in the outbox for the next drain.
        if args.once:
            raise
        error = describe_error(exc)
        if broker.broker_down(exc):
            text = f"broker unavailable, outbox not drained: {exc!r}"
            _said_retry("broker.unavailable", text, repr(exc), args)
        elif database_unavailable(exc):
            text = f"database unavailable, outbox not drained: {error}"
            _said_retry("database.unavailable", text, error, args)
        else:
            text = f"outbox not drained, trying again: {error}"
            _said_retry("outbox.drain.failed", text, error, args, level="error")
        return 0


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
            listen_url=settings.direct_url,
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
        for name in report.waiting:
            print(f"waiting   {name} (other jobs' ends dispatch it; message dropped)")
        for name in report.kept:
            print(f"kept      {name} (no job to re-dispatch, or a live attempt holds it)")
        return 0
    if not args.yes:
        _error_line("purge drops every failed message; add --yes")
        return 2
    purged = await failed.purge()
    _answer("dlq.purged", f"purged {purged} messages", messages=purged)
    return 0


# -- Arguments -------------------------------------------------------------


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


def register_relay(parser: argparse.ArgumentParser) -> None:
    """``jobplane relay``'s arguments."""
    parser.add_argument("--no-sweep", action="store_true", help="do not run the sweeper loop")
    parser.add_argument("--sweep-interval", type=float, default=5.0, help="seconds between sweeps")
    parser.add_argument(
        "--lease-grace", type=float, default=5.0, help="seconds past a lease before repair"
    )
    _dispatch_repair_options(parser)
    _fair_options(parser)
    parser.set_defaults(func=_async(_relay))
    _metrics_option(parser, "relay")


def register_sweep(parser: argparse.ArgumentParser) -> None:
    """``jobplane sweep``'s arguments."""
    parser.add_argument("--once", action="store_true", help="one pass, then exit")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between passes")
    parser.add_argument(
        "--lease-grace", type=float, default=5.0, help="seconds past a lease before repair"
    )
    _dispatch_repair_options(parser)
    _fair_options(parser)
    parser.set_defaults(func=_async(_sweep))
    _metrics_option(parser, "sweep")


def _fair_options(parser: argparse.ArgumentParser) -> None:
    """The relay's flow control of job dispatches (docs/flow-control.md, "Fairness")."""
    d = FairSettings()
    parser.add_argument(
        "--no-fair",
        action="store_true",
        help="publish every due dispatch at once, longest due first: no credit per queue, "
        "no turns across tenants or priorities",
    )
    for flag, kind, default, says in (
        ("--credit-min", int, d.min_backlog, "ready messages a queue is given at least"),
        ("--credit-per-consumer", int, d.per_consumer, "ready messages per consumer"),
        ("--credit-horizon", float, d.horizon_seconds, "seconds of measured work kept ready"),
        ("--credit-max", int, d.max_backlog, "ready messages a queue is given at most"),
    ):
        parser.add_argument(flag, type=kind, default=default, help=f"{says} (default {default})")


def _fair_settings(args: argparse.Namespace) -> FairSettings:
    try:
        return FairSettings(
            enabled=not args.no_fair,
            min_backlog=args.credit_min,
            per_consumer=args.credit_per_consumer,
            horizon_seconds=args.credit_horizon,
            max_backlog=args.credit_max,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def register_worker(parser: argparse.ArgumentParser) -> None:
    """``jobplane worker``'s arguments."""
    parser.add_argument("--handlers", help="package.module:registry to load")
    parser.add_argument("--demo", action="store_true", help="also load the demo handlers")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_WORKER_CONCURRENCY,
        help=f"handlers run at once (default {DEFAULT_WORKER_CONCURRENCY})",
    )
    parser.add_argument("--prefetch", type=int, default=None, help="unacked messages held")
    parser.add_argument(
        "--reserve",
        type=int,
        default=None,
        help="slots only the highest-priority queues may use (default: a quarter)",
    )
    parser.add_argument("--queue", action="append", help="consume only this queue (repeatable)")
    parser.add_argument(
        "--no-maintenance",
        action="store_true",
        help="do not run the maintenance jobs (maintenance.retention, maintenance.erasure)",
    )
    parser.add_argument("--grace", type=float, default=10.0, help="seconds to finish on stop")
    parser.add_argument(
        "--lease-seconds", type=float, default=30.0, help="lease of an attempt; heartbeats at 1/3"
    )
    parser.add_argument(
        "--group-window",
        type=float,
        default=2.0,
        help="milliseconds concurrent claims and outcomes wait to go out as one statement "
        "(ADR-0028; a claim waits only while a claim group is running, ADR-0053); 0: each alone",
    )
    parser.add_argument(
        "--group-max", type=int, default=64, help="the largest group: it goes out at once"
    )
    parser.set_defaults(func=_async(_worker))
    _metrics_option(parser, "worker")


def positive_count(value: str) -> int:
    """A count option's value (``dlq --limit``, ``dev --demo-steps``): a whole number, 1 or more."""
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {value!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {count}")
    return count


def register_dlq(parser: argparse.ArgumentParser) -> None:
    """``jobplane dlq``'s subcommands and their arguments."""
    dlq = parser.add_subparsers(dest="dlq", required=True)
    dlq_list = dlq.add_parser("list", help="show failed messages (they stay queued)")
    dlq_list.add_argument(
        "--limit", type=positive_count, default=100, help="show at most this many (default 100)"
    )
    dlq_list.add_argument("--json", action="store_true", help="one JSON object per message")
    dlq_replay = dlq.add_parser("replay", help="re-dispatch their jobs through the outbox")
    dlq_replay.add_argument(
        "--limit",
        type=positive_count,
        default=100,
        help="take at most this many messages (default 100)",
    )
    dlq_purge = dlq.add_parser("purge", help="drop every failed message")
    dlq_purge.add_argument("--yes", action="store_true", help="really drop them")
    for parser_ in (dlq_list, dlq_replay, dlq_purge):
        parser_.set_defaults(func=_async(_dlq))
