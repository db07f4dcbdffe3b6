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


_DOWN = "asyncpg.exceptions.CannotConnectNowError: the database system is starting up"


async def _each_kind_of_failed_pass() -> None:
    """A failed drain and a failed sweep of every kind the loop tells apart."""
    args = _args(once=False, interval=0.01)
    drains: tuple[Exception, ...] = (
        RuntimeError("a bug in a drain"),
        ConnectionRefusedError("refused"),
        asyncpg.CannotConnectNowError("the database system is starting up"),
    )
    for exc in drains:
        await cli._drained(_Failing(exc), args)  # type: ignore[arg-type]
    sweeps: tuple[Exception, ...] = (
        asyncpg.CannotConnectNowError("the database system is starting up"),
        asyncpg.DeadlockDetectedError("deadlock"),
        RuntimeError("a bug in a sweep"),
    )
    for exc in sweeps:
        await cli._swept(_Failing(exc), args, None)  # type: ignore[arg-type]


def _logged(monkeypatch: pytest.MonkeyPatch, fmt: str) -> str:
    """What :func:`_each_kind_of_failed_pass` writes to stderr, logging at info in ``fmt``.

    Called from the test's own body: the runner replaces stderr for each phase."""
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    configure("info", fmt)
    asyncio.run(_each_kind_of_failed_pass())
    return stderr.getvalue()


@pytest.mark.usefixtures("logs_back")
def test_a_failed_pass_is_logged_with_its_level_and_when_it_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = [json.loads(line) for line in _logged(monkeypatch, "json").splitlines()]
    assert [(line["event"], line["level"], line["error"], line["retry_in"]) for line in lines] == [
        ("outbox.drain.failed", "error", "RuntimeError: a bug in a drain", 0.01),
        ("broker.unavailable", "warning", "ConnectionRefusedError('refused')", 0.01),
        ("database.unavailable", "warning", _DOWN, 0.01),
        ("database.unavailable", "warning", _DOWN, 0.01),
        (
            "sweeper.db.error",
            "warning",
            "asyncpg.exceptions.DeadlockDetectedError: [message withheld: sqlstate=40P01]",
            0.01,
        ),
        ("sweeper.error", "error", "RuntimeError: a bug in a sweep", 0.01),
    ]


@pytest.mark.usefixtures("logs_back")
def test_a_failed_pass_is_one_line_of_text_without_json_logs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _logged(monkeypatch, "console").splitlines() == [
        "outbox not drained, trying again: RuntimeError: a bug in a drain",
        "broker unavailable, outbox not drained: ConnectionRefusedError('refused')",
        f"database unavailable, outbox not drained: {_DOWN}",
        f"database unavailable, not swept: {_DOWN}",
        "sweep failed, trying again: "
        "asyncpg.exceptions.DeadlockDetectedError: [message withheld: sqlstate=40P01]",
        "sweep failed, trying again: RuntimeError: a bug in a sweep",
    ]
