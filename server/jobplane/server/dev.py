"""``jobplane dev``: migrate, then the server, the relay (and sweeper), the
workers and the dashboard of a laptop in one command, with an API key printed.

Its parts (``--processes N``) are in jobplane.server.devparts; each part is this
command run again with a hidden flag, so it lands here first.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import os
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from jobplane import heap
from jobplane.config import DEFAULT_WORKER_CONCURRENCY
from jobplane.errors import JobplaneError
from jobplane.faults import FaultPoints
from jobplane.logs import json_line, json_lines
from jobplane.process import (
    _answer,
    _blob_store,
    _cancelled,
    _database,
    _error_line,
    _failed_queue_depth,
    _metrics_option,
    _ops,
    _relay_interceptors,
    _run,
    _settings_and_topology,
    _start_ops,
    _started,
    _stop_signals,
    _tracing,
    _until_stopped,
)
from jobplane.server.cli import _server, _server_dashboard
from jobplane.server.devparts import (
    GRACE,
    Layout,
    _dev_part,
    _dev_parts,
    _dev_relay_part,
    _dev_worker,
    _stopped_in_order,
    _until_stopped_or_part_exit,
    _with_ingest,
    resolve_processes,
)
from jobplane.workers.cli import _registry_or_none, _with_maintenance, positive_count

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.config import Settings
    from jobplane.observe.http import OpsServer
    from jobplane.observe.metrics import Metrics
    from jobplane.server import JobplaneServer
    from jobplane.store.db import Database
    from jobplane.topology import Topology


async def _dev(args: argparse.Namespace) -> int:
    from jobplane.store.engine import create_engine, migrate

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
    await migrate(settings.direct_url)
    engine = create_engine(settings.database_url, pool_size=settings.db_engine_pool_size)
    async with AsyncExitStack() as stack:
        stack.push(_stopped_in_order(args))
        stack.push_async_callback(engine.dispose)
        return await _dev_in(stack, args, settings, topology, engine, registry, processes, ingest)


async def _dev_in(
    stack: AsyncExitStack,
    args: argparse.Namespace,
    settings: Settings,
    topology: Topology,
    engine: AsyncEngine,
    registry: Any,
    processes: int,
    ingest: list[Path],
) -> int:
    """Start dev's processes on ``stack`` (stopped with it), then :func:`_dev_up`."""
    from jobplane.broker import until_up
    from jobplane.observe.metrics import watch_outbox
    from jobplane.topology import apply
    from jobplane.topology import log as topology_log

    # One Ctrl-C (a SIGINT to every process of the group) stops every phase
    # (the start, the demo, the ingestion, serving) in order and within
    # jobplane.server.devparts.GRACE a part; a second stops at once.
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
    dispatch = _dev_relay(settings, topology, engine, db, metrics, layout)
    relay, sweeper = dispatch if dispatch is not None else (None, None)
    worker = (
        _dev_worker(settings, topology, engine, db, registry, args, blobs, metrics)
        if processes == 1
        else None
    )
    _dev_checks(ops, server, relay, worker)
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
    if relay is not None and sweeper is not None:
        await _started(stack, relay.start, relay.stop)
        await stack.enter_async_context(sweeper)
    if worker is not None:
        await _started(stack, worker.start, lambda: worker.stop(GRACE))
    if parts is not None:
        stack.push_async_callback(parts.stop)
    return await _dev_up(stack, args, settings, server, stop, layout, parts, ingest)


def _dev_relay(
    settings: Settings,
    topology: Topology,
    engine: AsyncEngine,
    db: Database,
    metrics: Metrics,
    layout: Layout,
) -> Any:
    """The relay and the sweeper in dev's own process; None when a part runs them."""
    from jobplane.workers.relay import Relay, relay_in_flight
    from jobplane.workers.sweeper import Sweeper

    if layout.relay_apart:
        return None
    observed = _relay_interceptors(metrics)
    faults = FaultPoints(settings.faults)
    relay = Relay(
        engine,
        settings.database_url,
        settings.amqp_url,
        topology,
        faults=faults,
        interceptors=observed,
        db=db,
        in_flight=relay_in_flight(db.size),
        listen_url=settings.direct_url,
    )
    return relay, Sweeper(engine, topology=topology, interceptors=observed, faults=faults)


def _dev_checks(ops: OpsServer | None, server: JobplaneServer, relay: Any, worker: Any) -> None:
    """The readiness checks of dev's ops listener: its server, and the relay and
    worker when they run in this process (the parts add theirs)."""
    if ops is not None:
        ops.add_check("grpc", server.not_ready)
        if relay is not None:
            in_process = relay
            ops.add_check("relay", lambda: None if in_process.connected else "no broker channel")
        if worker is not None:
            ops.add_check("worker", worker.not_ready)


async def _dev_up(
    stack: AsyncExitStack,
    args: argparse.Namespace,
    settings: Settings,
    server: JobplaneServer,
    stop: asyncio.Event,
    layout: Layout,
    parts: Any,
    ingest: list[Path],
) -> int:
    """Once started: the keys and the dashboard, the lines that say so, the demo and
    the ingestion, then serving until stopped (or a part exits)."""
    from jobplane.config import DEFAULT_UI_LISTEN

    key, _tenant = await server.keys.create_key(args.tenant)
    worker_key = (await server.keys.create_worker()).key
    ui = await _server_dashboard(stack, settings, server, args.ui_listen, default=DEFAULT_UI_LISTEN)
    if stop.is_set():
        return 0
    _dev_ready(args, server.address, key, worker_key, ui, layout, parts)
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


def _dev_ready(
    args: argparse.Namespace,
    address: str,
    key: str,
    worker_key: str,
    ui: Any,
    layout: Layout,
    parts: Any,
) -> None:
    """Say dev is up, and how to reach it: its address, processes, keys and dashboard
    (one ``dev.ready`` JSON line with JSON logs)."""
    processes = layout.processes
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
            address=address,
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
            f"  address:  {address}\n"
            f"  processes: {shown}\n"
            f"  api key:  {key}   (tenant {args.tenant!r})\n"
            f"{ui_line}"
            f"  worker key: {worker_key}   (WorkerService, docs/workers.md)\n\n"
            f"  export JOBPLANE_ADDRESS={address} JOBPLANE_API_KEY={key}\n"
            f"  {_jobplane_command()} submit demo.progress"
            f' --payload \'{{"steps": 20, "interval_ms": 150}}\''
            " --watch\n",
            flush=True,
        )


def _dev_command(args: argparse.Namespace) -> int:
    """``jobplane dev`` (and its parts), which end without the interpreter's teardown."""
    code = _run(_dev(args))
    if getattr(args, "stopped_in_order", False):
        _exit_now(code)
    return code


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
        # The text's blank line ends the terminal's "^C" line.
        _answer("dev.stopping_at_once", "\nstopping at once")
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


# -- Arguments -------------------------------------------------------------


def register(parser: argparse.ArgumentParser) -> None:
    """``jobplane dev``'s arguments (and its parts' hidden ones)."""
    parser.add_argument("--tenant", default="dev", help="tenant of the printed API key")
    parser.add_argument("--handlers", help="package.module:registry to load besides the demos")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_WORKER_CONCURRENCY,
        help=f"handlers run at once, per worker (default {DEFAULT_WORKER_CONCURRENCY})",
    )
    parser.add_argument(
        "--processes",
        default="auto",
        help="1: all in this process; 2: server and relay here, a worker in a child "
        "process; N>2: the server here, the relay and N-2 workers in child processes; "
        "auto (the default): 1 on one CPU, else a worker per CPU but one beside the "
        "server and the relay (3 on two CPUs), at most 6",
    )
    # A part of `dev --processes N` (jobplane.server.devparts); not for users.
    parser.add_argument("--worker-part", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--relay-part", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--metrics-fallback", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--demo", action="store_true", help="submit a demo job and show it live")
    parser.add_argument(
        "--demo-steps",
        type=positive_count,
        default=20,
        help="progress steps of the demo job, 150 ms each (default 20)",
    )
    parser.add_argument("--ui-listen", help="the dashboard's host:port (off: none; 127.0.0.1:8080)")
    parser.add_argument(
        "--no-maintenance", action="store_true", help="do not run the maintenance jobs"
    )
    parser.add_argument(
        "--ingest",
        action="append",
        metavar="FILE",
        help="also run the ingest handlers, then upload FILE and show its ingestion live "
        "(repeatable; needs JOBPLANE_S3_URL and JOBPLANE_TOPOLOGY=builtin:dev or builtin:ingest)",
    )
    parser.set_defaults(func=_dev_command)
    _metrics_option(parser, "dev")
