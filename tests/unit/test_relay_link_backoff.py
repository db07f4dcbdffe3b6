"""How the relay's outbox loop backs off while the broker is down, and starts again
from half a second once a link it opened closed."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.logs import describe_error
from jobplane.topology import TopologyMissing, load_topology
from jobplane.workers import relay_link
from jobplane.workers.relay import Relay
from tests.support.logs import capture_every_level


class _Deadlock(Exception):
    sqlstate = "40P01"


class _Stop(Exception):
    """Ends the test's run of the loop."""


class _Link:
    def __init__(self) -> None:
        self.closed = False
        self.was_closed = 0

    async def close(self) -> None:
        self.was_closed += 1


async def test_the_loop_backs_off_to_ten_seconds_and_restarts_after_a_closed_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A logger not used before: a cached one would write past capture_logs.
    monkeypatch.setattr(relay_link, "log", structlog.get_logger("jobplane.relay.backoff"))
    relay = Relay(cast(AsyncEngine, None), "postgresql://u@h/d", "amqp://u", load_topology())
    link = _Link()
    refused = ConnectionRefusedError("refused")
    missing = TopologyMissing("queue jobs.default is missing")
    deadlock, bug = _Deadlock("deadlock detected"), RuntimeError("a bug")
    opens: list[Any] = [refused] * 7 + [link, missing, deadlock, deadlock, bug, refused]

    async def open_link() -> Any:
        answer = opens.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def pipeline(opened: Any, wakeup: Any) -> None:
        assert opened is link and wakeup is not None
        link.closed = True  # the channel closed under the batches

    slept: list[float] = []
    real_sleep = asyncio.sleep
    relay_task = asyncio.current_task()  # the loop runs in this test's task

    async def sleep(delay: float) -> None:
        if asyncio.current_task() is not relay_task:  # another test's leftover task
            return await real_sleep(delay)
        slept.append(delay)
        if len(slept) == 13:
            raise _Stop
        await real_sleep(0)

    relay._open = open_link  # type: ignore[method-assign]
    relay._pipeline = pipeline  # type: ignore[method-assign,assignment]
    monkeypatch.setattr(asyncio, "sleep", sleep)
    with capture_every_level() as logs, pytest.raises(_Stop):
        await relay._run()
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0]
    down = ("broker.unavailable", "ConnectionRefusedError('refused')")
    assert [(line["event"], line["error"], line["retry_in"]) for line in logs] == [
        *[(*down, delay) for delay in slept[:7]],
        ("broker.unavailable", "the channel closed", 0.5),
        ("relay.topology.missing", "queue jobs.default is missing", 1.0),
        ("relay.db.error", describe_error(deadlock), 2.0),
        ("relay.db.error", describe_error(deadlock), 4.0),
        ("relay.error", describe_error(bug), 8.0),
        (*down, 10.0),
    ]
    assert [line["log_level"] for line in logs[7:12]] == [
        "warning",
        "error",
        "warning",
        "warning",
        "error",
    ]
    assert logs[11]["exc_info"] is bug
    assert relay.database_errors == 2
    # The closed link was dropped: the next pass opens a new one.
    assert link.was_closed == 1 and relay._link is None
