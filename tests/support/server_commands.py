"""``jobplane serve``, ``ui``, ``migrate`` and ``dev`` run in the test's process
(tests/unit/test_server_commands.py, test_dev_command_run.py): the server is a real
:class:`JobplaneServer` whose start and stop only record and bind nothing, the
dashboard a stand-in recording how it was made, and what would reach Postgres or
the broker (migrations, submit rules, the topology, keys) records its call."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from jobplane.config import ListenAddress
from jobplane.server import JobplaneServer

#: The port the stand-in start "binds".
PORT = 7443


class Board:
    """A dashboard that records how it was made, started and stopped."""

    def __init__(self, run: ServerRun, backend: Any, **kwargs: Any) -> None:
        self.backend, self.kwargs = backend, kwargs
        self._calls = run.calls
        run.boards.append(self)

    @property
    def url(self) -> str:
        listen: ListenAddress = self.kwargs["listen"]
        return f"http://{listen}/"

    async def start(self) -> None:
        self._calls.append("ui.start")

    async def stop(self) -> None:
        self._calls.append("ui.stop")


async def readyz(ops: Any) -> tuple[int, dict[str, Any]]:
    """What the ops listener's /readyz answers now."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{ops.address}/readyz") as answer,
    ):
        return answer.status, json.loads(await answer.read())


class ServerRun:
    """The server, dashboard and outside calls of one command run in this process.

    ``stop`` is the event the command's stop signals give; with ``stop_at_serving``
    it is set once the server reports SERVING.
    """

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, opened: list[Any], *, stop_at_serving: bool = True
    ) -> None:
        self._opened = opened  # the ops listeners the command started (CommandRun.ops)
        self.servers: list[JobplaneServer] = []
        self.boards: list[Board] = []
        self.calls: list[Any] = []
        self.ready_at_start: tuple[int, dict[str, Any]] | None = None
        self.ready_serving: tuple[int, dict[str, Any]] | None = None
        self.stop = asyncio.Event()
        self.signals: list[dict[str, Any]] = []
        run = self

        async def start(server: JobplaneServer, *, report_serving: bool = True) -> None:
            run.servers.append(server)
            run.calls.append(("start", report_serving))
            server.port = PORT
            if run.ops is not None:
                run.ready_at_start = await readyz(run.ops)
            if report_serving:
                await server.report_serving()

        async def report_serving(server: JobplaneServer) -> None:
            run.calls.append("serving")
            server._serving = True
            if run.ops is not None:
                run.ready_serving = await readyz(run.ops)
            if stop_at_serving:
                run.stop.set()

        async def stop(server: JobplaneServer, grace: float = 5.0) -> None:
            run.calls.append(("stop", grace))

        monkeypatch.setattr(JobplaneServer, "start", start)
        monkeypatch.setattr(JobplaneServer, "report_serving", report_serving)
        monkeypatch.setattr(JobplaneServer, "stop", stop)
        monkeypatch.setattr(
            "jobplane.server.dashboard.Dashboard",
            lambda backend, **kwargs: Board(self, backend, **kwargs),
        )

    @property
    def ops(self) -> Any:
        """The command's ops listener (None: none, or not started yet)."""
        return self._opened[-1] if self._opened else None

    @contextlib.contextmanager
    def stop_signals(self, **kwargs: Any) -> Iterator[asyncio.Event]:
        """The command's stop signals: the event :attr:`stop`."""
        self.signals.append(kwargs)
        yield self.stop

    def record(self, name: str, answer: Any = None) -> Any:
        """An async stand-in that records its call as ``(name, args, kwargs)``."""

        async def called(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return answer

        return called

    def of(self, name: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The one recorded call named ``name``: its args and kwargs."""
        (found,) = [c[1:] for c in self.calls if isinstance(c, tuple) and c[0] == name]
        return found[0], found[1]

    @property
    def server(self) -> JobplaneServer:
        (server,) = self.servers
        return server

    @property
    def board(self) -> Board:
        (board,) = self.boards
        return board
