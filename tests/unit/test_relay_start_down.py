"""A relay started while its database refuses connections for a while (starting up,
its LISTENs in place): ``start`` says so in one ``relay.db.error`` warning,
returns, and the relay keeps trying in the background."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.logs import describe_error
from jobplane.store.deployment import Deployment
from jobplane.store.engine import create_engine
from jobplane.store.listen import Listener
from jobplane.store.rows import DOMAIN_EVENTS_CHANNEL, OUTBOX_CHANNEL
from jobplane.topology import load_topology
from jobplane.workers import relay as relay_module
from jobplane.workers import relay_link
from jobplane.workers.relay import Relay
from tests.support.db_errors import asyncpg_error, through_sqlalchemy
from tests.support.logs import capture_every_level

_URL = "postgresql://jobplane@127.0.0.1:1/jobplane"
#: What Postgres answers a connection while it starts (SQLSTATE 57P03), as the
#: engine raises it.
_STARTING = through_sqlalchemy(
    asyncpg_error("57P03", "the database system is starting up", severity="FATAL")
)


class _Listening(Listener):
    """A LISTEN in place at once (its connection is not the one refused)."""

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        self.wake_all()


async def test_a_relay_started_on_a_database_that_refuses_says_so_and_keeps_trying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Loggers not used before: a cached one would write past the capture.
    monkeypatch.setattr(relay_module, "log", structlog.get_logger("jobplane.relay.start_down"))
    monkeypatch.setattr(relay_link, "log", structlog.get_logger("jobplane.relay.start_down.loop"))
    tries: list[AsyncEngine] = []

    async def refused(engine: AsyncEngine) -> Deployment:
        tries.append(engine)
        raise _STARTING

    monkeypatch.setattr(relay_link, "this_deployment", refused)
    engine = create_engine(_URL, pool_size=1)  # never connects: the stand-in above refuses
    relay = Relay(engine, _URL, "amqp://unused", load_topology())
    relay._wakeups = _Listening(_URL, OUTBOX_CHANNEL)
    relay._event_wakeups = _Listening(_URL, DOMAIN_EVENTS_CHANNEL)
    try:
        with capture_every_level() as lines:
            await relay.start()  # returns: the database is waited for
            assert relay._task is not None and not relay._task.done()
            # The outbox loop's first try in the background, refused too.
            for _ in range(500):
                if len(lines) >= 2:
                    break
                await asyncio.sleep(0.01)
            assert relay._task is not None and not relay._task.done()
            said: list[dict[str, Any]] = [dict(line) for line in lines]
    finally:
        await relay.stop()
        await engine.dispose()
    assert len(said) >= 2, said
    start, loop = said[0], said[1]
    assert start.keys() == {"event", "log_level", "error", "retry"}
    assert (start["event"], start["log_level"], start["retry"]) == (
        "relay.db.error",
        "warning",
        "in the background",
    )
    assert start["error"] == describe_error(_STARTING)
    assert "the database system is starting up" in start["error"]
    # The loop says the same error, when it tries next, and counts it.
    assert (loop["event"], loop["error"], loop["retry_in"]) == (
        "relay.db.error",
        start["error"],
        0.5,
    )
    assert relay.database_errors >= 1 and tries[:2] == [engine, engine]
    assert not relay.connected
