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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from jobplane.config import ListenAddress
from jobplane.topology import Topology

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
