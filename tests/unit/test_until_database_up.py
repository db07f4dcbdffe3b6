"""Waiting for the database to come up: a growing, bounded backoff over an outage
or a full pool; anything else is raised at once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import structlog
from structlog.testing import capture_logs

from jobplane.store import down
from jobplane.store.down import PoolExhausted, until_database_up


async def test_until_database_up_waits_out_an_outage_with_a_growing_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    # This module's sleeps only, not the loop's.
    monkeypatch.setattr(down, "asyncio", SimpleNamespace(sleep=sleep))
    outcomes: list[Exception | str] = [
        PoolExhausted("all in use"),
        ConnectionRefusedError(111, "refused"),
        ConnectionRefusedError(111, "refused"),
        ConnectionRefusedError(111, "refused"),
        "up",
    ]

    async def op() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    log = structlog.get_logger("test")
    with capture_logs() as lines:
        assert await until_database_up(op, log, max_delay=1.5) == "up"
    assert slept == [0.5, 1.0, 1.5, 1.5]
    assert [(line["event"], line["retry_in"]) for line in lines] == [
        ("database.unavailable", delay) for delay in slept
    ]
    assert lines[0]["error"].endswith("PoolExhausted: all in use")

    async def bug() -> str:
        raise KeyError("k")

    with pytest.raises(KeyError):
        await until_database_up(bug, log)
    assert len(slept) == 4  # a failure that is not the database's is raised at once


async def test_a_long_outage_is_retried_at_most_every_ten_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(down, "asyncio", SimpleNamespace(sleep=sleep))
    tries = 0

    async def op() -> str:
        nonlocal tries
        tries += 1
        if tries <= 8:
            raise ConnectionRefusedError(111, "refused")
        return "up"

    with capture_logs():
        assert await until_database_up(op, structlog.get_logger("test")) == "up"
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
