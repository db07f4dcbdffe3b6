"""Commands of ``jobplane`` run in the test's process, their long-running parts
stand-ins that record how they were made and run (tests/unit/test_worker_commands.py,
tests/unit/test_dev_parts_run.py). The engine, pools and ops listener are real:
nothing connects until a part would use them."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections.abc import Callable, Coroutine, Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import aiohttp
import pytest

from jobplane.cli import build_parser
from jobplane.faults import FaultPoints, InjectedFault
from jobplane.process import _run, _start_ops
from jobplane.workers.handlers import JobContext, Registry
from jobplane.workers.maintenance import Maintenance

#: Handlers ``--handlers tests.support.commands:registry`` loads.
registry = Registry()


@registry.handler("tests.render")
async def _render(ctx: JobContext) -> dict[str, Any]:
    return {}


#: Handlers that register a maintenance type of their own.
clashing = Registry()


@clashing.handler("maintenance.retention")
async def _retention(ctx: JobContext) -> dict[str, Any]:
    return {}


HERE = "tests.support.commands"
#: A command's environment: addresses nothing answers on (no part here connects to
#: them), and settings whose way into the parts a test can see.
ENV = {
    "JOBPLANE_DATABASE_URL": "postgresql://jp:pw@127.0.0.1:1/jp_nowhere",
    "JOBPLANE_DATABASE_DIRECT_URL": "postgresql://jp:pw@127.0.0.1:2/jp_direct",
    "JOBPLANE_AMQP_URL": "amqp://guest:guest@127.0.0.1:3/",
    "JOBPLANE_METRICS_LISTEN": "127.0.0.1:0",
    "JOBPLANE_MAX_PAYLOAD_BYTES": "300000",
    "JOBPLANE_SYNC_THREADS": "3",
    "JOBPLANE_DB_POOL_SIZE": "9",
    "JOBPLANE_DB_ENGINE_POOL_SIZE": "6",
    "JOBPLANE_FAULTS": "relay.after_publish",
    "JOBPLANE_S3_URL": "http://127.0.0.1:4",
    "JOBPLANE_QDRANT_URL": "http://127.0.0.1:5",
}
DEMOS = {"demo.echo", "demo.progress", "demo.fail"}
MAINTENANCE = {"maintenance.retention", "maintenance.erasure"}


class Part:
    """A worker, relay, sweeper or scheduler that records how it was made and run."""

    def __init__(self, kind: str, made: list[Part], *args: Any, **kwargs: Any) -> None:
        self.kind, self.args, self.kwargs = kind, args, kwargs
        self.calls: list[Any] = []
        self.connected = False
        self.scheduler: Part | None = None
        self.deadlines: Part | None = None
        self.drained = asyncio.Event()
        made.append(self)

    async def start(self) -> None:
        self.calls.append("start")
        self.connected = True

    async def stop(self, *grace: float) -> None:
        self.calls.append(("stop", *grace))

    def not_ready(self) -> str | None:
        return "the stand-in does not consume"

    async def sweep_once(self) -> Any:
        self.calls.append("sweep_once")
        return SimpleNamespace(requeued=1, failed=2, republished=3, stuck_outbox=4)

    async def tick_once(self) -> None:
        self.calls.append("tick_once")

    async def drain_once(self) -> int:
        self.calls.append("drain_once")
        self.drained.set()
        return 5

    async def __aenter__(self) -> Part:
        self.calls.append("enter")
        return self

    async def __aexit__(self, *_: object) -> None:
        self.calls.append("exit")


def environment(monkeypatch: pytest.MonkeyPatch, values: dict[str, str]) -> None:
    """Exactly ``values`` of jobplane's variables: none the shell running the tests
    exported (``make dev``'s JOBPLANE_TOPOLOGY, a JSON log format) reaches a command."""
    for name in [n for n in os.environ if n.startswith("JOBPLANE_")]:
        monkeypatch.delenv(name)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


class CommandRun:
    """One command run in this process, with the parts it made and its /readyz."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        module: ModuleType,
        commands: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, int]]],
    ) -> None:
        self._commands = commands
        self.parent: list[int] = []
        self.made: list[Part] = []
        self.ready: tuple[int, dict[str, Any]] | None = None
        self.metrics = ""
        self.unready: tuple[int, dict[str, Any]] | None = None
        self.ops: list[Any] = []
        self.traced: list[str] = []
        self.maintenance: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
        self._monkeypatch = monkeypatch
        for where, name in (
            ("jobplane.workers.runtime", "Worker"),
            ("jobplane.workers.relay", "Relay"),
            ("jobplane.workers.sweeper", "Sweeper"),
        ):
            monkeypatch.setattr(f"{where}.{name}", self._maker(name))
        monkeypatch.setattr(
            "jobplane.observe.tracing.configure_tracing", lambda name, _: self.traced.append(name)
        )
        maintenance = Maintenance

        def made(*args: Any, **kwargs: Any) -> Maintenance:
            self.maintenance.append((args, kwargs))
            return maintenance(*args, **kwargs)

        monkeypatch.setattr("jobplane.workers.maintenance.Maintenance", made)
        if hasattr(module, "_until_signal"):
            monkeypatch.setattr(module, "_until_signal", self._served)
            monkeypatch.setattr(module, "_stop_signals", self._stop_after_a_drain)
        if hasattr(module, "parent_gone"):
            monkeypatch.setattr(module, "parent_gone", self._parent_gone)
        start_ops = _start_ops

        async def started(stack: Any, ops: Any) -> None:
            self.ops.append(ops)
            await start_ops(stack, ops)

        monkeypatch.setattr(module, "_start_ops", started)

    @contextlib.contextmanager
    def _stop_after_a_drain(self) -> Iterator[asyncio.Event]:
        """The loop of ``sweep`` stops (as at a SIGTERM) once its relay drained once."""
        yield self.of("Relay").drained

    def _maker(self, kind: str) -> Callable[..., Part]:
        def make(*args: Any, **kwargs: Any) -> Part:
            part = Part(kind, self.made, *args, **kwargs)
            if kind == "Sweeper":
                part.scheduler = Part("Scheduler", self.made)
                part.deadlines = Part("Deadlines", self.made)
            return part

        return make

    async def _parent_gone(self, pid: int) -> None:
        """A dev part's parent exits once the part served: what the part was told."""
        self.parent.append(pid)
        await self._served()

    async def _served(self) -> None:
        """While the command serves: what its ops listener says of readiness."""
        ops = self.ops[-1]
        if ops is None:
            return
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://{ops.address}/readyz") as answer,
        ):
            self.ready = (answer.status, json.loads(await answer.read()))
            for part in self.made:
                part.connected = False  # as when the broker goes away
            async with session.get(f"http://{ops.address}/readyz") as again:
                self.unready = (again.status, json.loads(await again.read()))
            async with session.get(f"http://{ops.address}/metrics") as scraped:
                self.metrics = await scraped.text()

    def of(self, kind: str) -> Part:
        (part,) = (p for p in self.made if p.kind == kind)
        return part

    def __call__(self, argv: list[str]) -> int:
        self.args = args = build_parser({argv[0]}).parse_args(argv)
        return _run(self._commands[argv[0]](args))


def armed(faults: FaultPoints) -> bool:
    """Whether JOBPLANE_FAULTS's point reached ``faults``."""
    try:
        faults.hit("relay.after_publish")
    except InjectedFault:
        return True
    return False


async def tenants_command(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``jobplane tenants ARGV`` in this process: its exit status, stdout and stderr
    (``JOBPLANE_DATABASE_URL`` names the database)."""
    from jobplane.server import admin

    capsys.readouterr()
    code = await admin._tenants(build_parser().parse_args(["tenants", *argv]))
    out, err = capsys.readouterr()
    return code, out, err
