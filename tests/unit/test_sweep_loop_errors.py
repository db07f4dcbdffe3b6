"""The loop of ``jobplane sweep`` outlives a failed pass; one pass (``--once``) reports it."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from jobplane.logs import configure
from jobplane.workers import cli


class _Failing:
    """A sweeper (or relay) whose every pass raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.calls = 0

    async def sweep_once(self) -> Any:
        self.calls += 1
        raise self.exc

    async def drain_once(self) -> int:
        self.calls += 1
        raise self.exc


def _args(*, once: bool, interval: float = 0.01) -> argparse.Namespace:
    return argparse.Namespace(once=once, interval=interval)


@pytest.mark.parametrize(
    "exc",
    [
        asyncpg.DiskFullError("could not extend file"),
        asyncpg.DeadlockDetectedError("deadlock detected"),
        asyncpg.QueryCanceledError("canceling statement due to statement timeout"),
        RuntimeError("a bug in a pass"),
    ],
)
async def test_the_loop_waits_out_a_failed_pass(exc: BaseException) -> None:
    sweeper = _Failing(exc)
    assert await cli._swept(sweeper, _args(once=False), None) is None  # type: ignore[arg-type]
    assert sweeper.calls == 1
    relay = _Failing(exc)
    assert await cli._drained(relay, _args(once=False)) == 0  # type: ignore[arg-type]


async def test_one_pass_reports_the_failure() -> None:
    with pytest.raises(asyncpg.DiskFullError):
        await cli._swept(_Failing(asyncpg.DiskFullError("full")), _args(once=True), None)  # type: ignore[arg-type]
    with pytest.raises(asyncpg.DiskFullError):
        await cli._drained(_Failing(asyncpg.DiskFullError("full")), _args(once=True))  # type: ignore[arg-type]


async def test_a_stop_ends_the_wait_after_a_failed_pass() -> None:
    stop = asyncio.Event()
    stop.set()
    sweeper = _Failing(asyncpg.DiskFullError("full"))
    # An hour's interval: only the stop can end the wait within the timeout.
    result = await asyncio.wait_for(cli._swept(sweeper, _args(once=False, interval=3600), stop), 5)  # type: ignore[arg-type]
    assert result is None


@pytest.fixture
def logs_back() -> Iterator[None]:
    yield
    configure("warning")


@pytest.mark.usefixtures("logs_back")
def test_a_failed_pass_is_logged_with_its_level_and_when_it_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # JSON logs, in the test's own body: the runner replaces stderr for each phase.
    json_logs = io.StringIO()
    monkeypatch.setattr(sys, "stderr", json_logs)
    configure("info", "json")

    async def passes() -> None:
        args = _args(once=False, interval=0.01)
        await cli._drained(_Failing(RuntimeError("a bug in a drain")), args)  # type: ignore[arg-type]
        await cli._drained(_Failing(ConnectionRefusedError("refused")), args)  # type: ignore[arg-type]
        await cli._swept(_Failing(asyncpg.DeadlockDetectedError("deadlock")), args, None)  # type: ignore[arg-type]

    asyncio.run(passes())
    lines = [json.loads(line) for line in json_logs.getvalue().splitlines()]
    assert [(line["event"], line["level"], line["retry_in"]) for line in lines] == [
        ("outbox.drain.failed", "error", 0.01),
        ("broker.unavailable", "warning", 0.01),
        ("sweeper.db.error", "warning", 0.01),
    ]
    assert lines[0]["error"] == "RuntimeError: a bug in a drain"
