"""The loop of ``jobplane sweep`` outlives a failed pass; one pass (``--once``) reports it."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import asyncpg
import pytest

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
