"""What the relay's event feed says when the database fails under a pass: a
``relay.db.error`` warning naming the feed and the error, counted, and the
loop goes on (it tries again after a pause, with the broker link kept)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import aiormq
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.topology import load_topology
from jobplane.workers import relay_feed
from jobplane.workers.relay import Relay
from jobplane.workers.relay_link import Link
from tests.support.logs import module_lines

# Nothing listens on port 1: every connection the feed's pass makes is refused.
_DOWN = "postgresql://jobplane@127.0.0.1:1/jobplane"


class _Raw(aiormq.Channel):
    """An aiormq channel with no connection under it: the feed's pass fails before
    it publishes anything."""

    def __init__(self) -> None:  # aiormq's would open a channel
        pass


class _FeedChannel:
    async def get_underlay_channel(self) -> _Raw:
        return _Raw()


class _Link:
    """An open broker link: the feed does not wait for the outbox loop to open one."""

    def __init__(self) -> None:
        self.closed = False
        self.feed_channel = _FeedChannel()

    async def close(self) -> None:
        self.closed = True


async def test_a_database_down_under_a_feed_pass_is_logged_with_the_feed_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay = Relay(cast(AsyncEngine, None), _DOWN, "amqp://unused", load_topology())
    link = cast(Link, _Link())
    relay._link = link
    with module_lines(monkeypatch, relay_feed, "jobplane.relay.feed_errors") as lines:
        feed = asyncio.create_task(relay._run_feed())
        try:
            # Two passes (the second after the loop's half-second pause).
            for _ in range(500):
                if len(lines) >= 2 or feed.done():
                    break
                await asyncio.sleep(0.01)
            # Still running, its link kept for the next pass: the database
            # failed, not the broker.
            assert not feed.done()
            assert relay._link is link and not link.closed
        finally:
            feed.cancel()
            await asyncio.gather(feed, return_exceptions=True)
            await relay.stop()
        said: list[dict[str, Any]] = [dict(line) for line in lines]
    assert len(said) >= 2, said
    first = said[0]
    assert first.keys() == {"event", "log_level", "feed", "error"}
    assert (first["event"], first["log_level"], first["feed"]) == (
        "relay.db.error",
        "warning",
        "events",
    )
    # The driver's error inside the wrapper, named: the database refused the connection.
    refused = "sqlalchemy.exc.DBAPIError from ConnectionRefusedError: "
    assert first["error"].startswith(refused), first["error"]
    assert first["error"].endswith("Connect call failed ('127.0.0.1', 1)"), first["error"]
    # Each pass that failed says so alike and counts once; nothing else was said.
    assert all(line == first for line in said)
    assert relay.database_errors == len(said)
