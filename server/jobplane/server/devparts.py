"""``jobplane dev --processes N``: one command, its parts in N processes.

A Python process runs on one core at a time, and the server, the relay and
a worker each batch what arrives while they are busy (ADR-0028, ADR-0030):
one that waits for another on a shared event loop batches less and costs
more a job. With ``--processes`` 2, ``jobplane dev`` keeps the server, the
relay (and sweeper) and the dashboard in its own process and runs one worker
as a child process; with 3 or more (``auto`` on two CPUs or more), the relay
runs in a child process of its own too, and the workers in the rest (see
:class:`Layout`). Worker part 0 has every handler dev has (the demos,
``--handlers``, maintenance, ``--ingest``'s stages), parts 1.. the demos and
``--handlers`` on every queue but the ingest stages' own (their local-mode
index allows one process: :func:`part_queues`). A maintenance job a part
without its handler receives is handed back to one that has it (ADR-0007).

The parts stop with the command: on Ctrl-C or SIGTERM the parent stops its
workers first (SIGTERM, then SIGKILL after :data:`KILL_AFTER`), and a part whose
parent is gone (killed outright) stops by itself. A part that
exits on its own ends the command, with its exit status.

What the parts run is here too: :func:`_dev_part` and :func:`_dev_relay_part`
(``jobplane dev --worker-part`` and ``--relay-part``, which jobplane.server.dev
hands over to), the worker and the ingest handlers they share with the command,
and how the command starts and watches them (:func:`_dev_parts`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobplane.config import ListenAddress, Settings
from jobplane.faults import FaultPoints
from jobplane.process import (
    _blob_store,
    _database,
    _error_line,
    _ops,
    _relay_interceptors,
    _settings_and_topology,
    _start_ops,
    _started,
    _stop_signals,
    _tracing,
    _until_stopped,
    _worker_interceptors,
)
from jobplane.topology import Topology
from jobplane.workers.cli import _registry_or_none, _relay_pool, _with_maintenance

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.blobs import BlobStore
    from jobplane.observe.http import OpsServer
    from jobplane.observe.metrics import Metrics
    from jobplane.store.db import Database

#: ``--processes auto`` uses no more processes than this.
MOST_AUTO = 6
#: The most ``--processes`` takes.
MOST = 64
#: Seconds a part (the command too) gives its handlers and calls to finish once
#: asked to stop; a handler cut short runs again, as after a crash. Short: one
#: Ctrl-C normally stops every part within two seconds.
GRACE = 0.5
#: Seconds the command waits for its parts to stop before it kills them: well past
#: :data:`GRACE`, so a part that cut its handlers short still writes their outcome
#: (a stop refunds the attempt; a part killed before it does leaves the job to the
#: sweeper, and an expired lease counts the attempt) on a loaded machine.
KILL_AFTER = 3.0


def resolve_processes(value: str, cpus: int | None = None) -> int:
    """``--processes``: ``auto`` or 1..:data:`MOST`.

    ``auto``: 1 on one CPU; on more, the server, the relay and a worker per
    CPU but the first, each in a process of its own (3 on two CPUs), at most
    :data:`MOST_AUTO`. Anything else raises ValueError saying what is allowed.
    """
    raw = value.strip().lower()
    if raw == "auto":
        found = (os.cpu_count() if cpus is None else cpus) or 1
        return 1 if found <= 1 else min(found + 1, MOST_AUTO)
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MOST:
        raise ValueError(f"--processes must be auto or a number of 1..{MOST}, not {value!r}")
    return int(raw)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the parts of ``jobplane dev --processes N`` run.

    1: all in the command's process. 2: the server and the relay in it, a
    worker in a child process. 3 or more: the server in it, the relay in a
    child process, workers in the rest.
    """

    processes: int

    @property
    def relay_apart(self) -> bool:
        """Whether the relay (and sweeper) runs in a child process of its own."""
        return self.processes >= 3

    @property
    def workers(self) -> int:
        """Worker parts in child processes (0: the worker runs in the command)."""
        if self.processes == 1:
            return 0
        return self.processes - 1 - int(self.relay_apart)


def part_queues(topology: Topology) -> list[str]:
    """The queues of worker parts 1..: all but the ingest stages' own (a queue bound
    only to ``ingest.*`` types), which part 0 alone serves."""
    return [
        q.name
        for q in topology.queues
        if not q.bindings or not all(b.startswith("ingest.") for b in q.bindings)
    ]


def part_metrics(parent: ListenAddress | None, part: int) -> str:
    """The ``--metrics-listen`` of worker part ``part``: the port after the
    command's own (and the parts' before it); any free one for port 0; off when
    the command serves none."""
    if parent is None:
        return "off"
    port = 0 if parent.port == 0 else parent.port + 1 + part
    host = f"[{parent.host}]" if ":" in parent.host else parent.host
    return f"{host}:{port}"


def part_command(
    part: int,
    *,
    parent_pid: int,
    metrics_listen: str,
    handlers: str | None,
    concurrency: int,
    no_maintenance: bool,
    ingest: Sequence[str],
    metrics_fallback: bool = False,
) -> list[str]:
    """The command line of worker part ``part`` (``jobplane dev --worker-part``).

    ``metrics_fallback``: ``metrics_listen`` derives from a default, and a free
    port does when it is taken.
    """
    command = [
        sys.executable,
        "-m",
        "jobplane",
        "dev",
        "--worker-part",
        str(part),
        "--parent-pid",
        str(parent_pid),
        "--concurrency",
        str(concurrency),
        "--metrics-listen",
        metrics_listen,
    ]
    if metrics_fallback:
        command.append("--metrics-fallback")
    if handlers:
        command += ["--handlers", handlers]
    if no_maintenance:
        command.append("--no-maintenance")
    for path in ingest:
        command += ["--ingest", path]
    return command


def relay_command(
    *, parent_pid: int, metrics_listen: str, metrics_fallback: bool = False
) -> list[str]:
    """The command line of the relay part (``jobplane dev --relay-part``)."""
    return [
        sys.executable,
        "-m",
        "jobplane",
        "dev",
        "--relay-part",
        "--parent-pid",
        str(parent_pid),
        "--metrics-listen",
        metrics_listen,
        *(["--metrics-fallback"] if metrics_fallback else []),
    ]


@dataclass
class Parts:
    """The parts of one ``jobplane dev``: started, watched, stopped.

    ``names`` say which part each command is ("worker part 0", "relay part").
    """

    commands: list[list[str]]
    names: list[str]
    grace: float = KILL_AFTER
    _procs: list[asyncio.subprocess.Process] = field(default_factory=list)

    async def start(self) -> None:
        """Start every part (their output goes where the command's does)."""
        for command in self.commands:
            self._procs.append(await asyncio.create_subprocess_exec(*command))

    @property
    def pids(self) -> list[int]:
        """The parts' process ids, in part order."""
        return [p.pid for p in self._procs]

    def not_ready(self) -> str | None:
        """A readiness check: None while every part runs, else which one exited."""
        for name, proc in zip(self.names, self._procs, strict=True):
            if proc.returncode is not None:
                return f"{name} exited (status {proc.returncode})"
        return None

    async def exited(self) -> tuple[str, int]:
        """Wait until a part exits; (its name, its exit status)."""
        waits = {asyncio.ensure_future(p.wait()): i for i, p in enumerate(self._procs)}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        first = min(done, key=lambda t: waits[t])
        return self.names[waits[first]], first.result()

    def kill(self) -> None:
        """SIGKILL every part still running, now."""
        for proc in self._procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()

    async def stop(self) -> None:
        """SIGTERM every part still running; SIGKILL what is left after the grace."""
        running = [p for p in self._procs if p.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        if not running:
            return
        waits = [asyncio.ensure_future(p.wait()) for p in running]
        _, late = await asyncio.wait(waits, timeout=self.grace)
        for task in late:
            task.cancel()
        for proc in running:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


async def parent_gone(parent_pid: int) -> None:
    """Return once process ``parent_pid`` (this one's parent) has exited.

    A pidfd (Linux) becomes readable when its process exits; where there is
    none, the parent is checked once a second (a child whose parent died is
    handed to another).
    """
    try:
        pidfd = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):  # not Linux, or the parent is gone already
        while os.getppid() == parent_pid:  # noqa: ASYNC110 - nothing to wait on but time
            await asyncio.sleep(1.0)
        return
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    loop.add_reader(pidfd, exited.set)
    try:
        await exited.wait()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


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


def _stopped_in_order(args: argparse.Namespace) -> Callable[..., None]:
    """An exit callback of the outermost stack: marks ``args`` when it closed without
    an error (every part it started stopped)."""

    def closed(exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            args.stopped_in_order = True

    return closed


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
        listen_url=settings.direct_url,
    )


async def _dev_parts(
    stack: AsyncExitStack, args: argparse.Namespace, layout: Layout, ops: OpsServer | None
) -> Any:
    """Start the worker parts (and the relay's, when apart) of ``layout``
    (below), stopped with ``stack``."""
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
    """The relay part of ``jobplane dev --processes N`` (below): the relay
    and the sweeper."""
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
        faults = FaultPoints(settings.faults)
        relay = Relay(
            engine,
            settings.database_url,
            settings.amqp_url,
            topology,
            faults=faults,
            interceptors=observed,
            db=relay_db,
            in_flight=in_flight,
            listen_url=settings.direct_url,
        )
        sweeper = Sweeper(engine, topology=topology, interceptors=observed, faults=faults)
        if ops is not None:
            ops.add_check("relay", lambda: None if relay.connected else "no broker channel")
        await _start_ops(stack, ops)
        # Caught until the part has stopped: the parent's SIGTERM after a Ctrl-C
        # must not end it halfway through stopping.
        stop = stack.enter_context(_stop_signals())
        await _started(stack, relay.start, relay.stop)
        await stack.enter_async_context(sweeper)
        await _until_stopped(stop, parent_gone(args.parent_pid or os.getppid()))
    return 0


async def _dev_part(args: argparse.Namespace) -> int:
    """One worker part of ``jobplane dev --processes N`` (below)."""
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
