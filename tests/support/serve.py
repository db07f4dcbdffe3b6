"""`jobplane serve` (and other commands) as a process of its own, with everything it
writes to stderr."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Serve:
    """A `jobplane serve` process and every line it wrote to stderr."""

    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    address: str = ""
    reader: asyncio.Task[None] | None = None

    async def read(self, started: asyncio.Event) -> None:
        """Collect stderr lines; set ``started`` at the "serving on" line (its
        ``server.started`` log line with JSON logs)."""
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            if line.startswith("jobplane serving on "):
                self.address = line.split()[3]
                started.set()
            elif line.startswith("{") and '"server.started"' in line:
                self.address = str(json.loads(line)["address"])
                started.set()

    def records(self) -> list[dict[str, object]]:
        """The JSON log records among the lines."""
        return [json.loads(line) for line in self.lines if line.startswith("{")]

    async def stop(self) -> None:
        """SIGTERM; wait for the process to exit and its last lines to be read."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(self.process.wait(), timeout=30)
        if self.reader is not None:
            await asyncio.wait_for(self.reader, timeout=10)


async def start_serve(
    database_url: str, *, stdout: Any = None, **env: str
) -> asyncio.subprocess.Process:
    """`jobplane serve` on a free port of loopback with ``env`` added, its stderr piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        "serve",
        env={
            **os.environ,
            "JOBPLANE_DATABASE_URL": database_url,
            "JOBPLANE_LISTEN": "127.0.0.1:0",
            **env,
        },
        stdout=stdout,
        stderr=asyncio.subprocess.PIPE,
    )


async def interrupt(process: asyncio.subprocess.Process) -> None:
    """A Ctrl-C (SIGINT) to ``process`` if it still runs; SIGKILL if it has not
    exited 30 seconds later."""
    if process.returncode is None:
        process.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(process.wait(), timeout=30)
        except TimeoutError:
            process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def serve_process(database_url: str, **env: str) -> AsyncIterator[Serve]:
    """Run `jobplane serve` on a free port of loopback with ``env`` added."""
    process = await start_serve(database_url, **env)
    running = Serve(process)
    started = asyncio.Event()
    reader = running.reader = asyncio.create_task(running.read(started))
    waiting = asyncio.create_task(started.wait())
    try:
        # The reader ends first if the process exits before it serves.
        await asyncio.wait([reader, waiting], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():
            raise AssertionError("jobplane serve did not start:\n" + "\n".join(running.lines))
        yield running
    finally:
        waiting.cancel()
        await running.stop()
