"""What the relay's event feed says when the database fails under a pass: a
``relay.db.error`` warning naming the feed and the error, counted, and the
loop goes on (it tries again after a pause, with the broker link kept); the
pauses double up to ten seconds while the passes fail."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import aiormq
import pytest
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.topology import load_topology
from jobplane.workers import relay_feed
from jobplane.workers.relay import Relay
from jobplane.workers.relay_feed import FeedPass
from jobplane.workers.relay_link import Link
from tests.support.db_errors import asyncpg_error, through_sqlalchemy
from tests.support.logs import capture_every_level, module_lines

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


class _Stop(Exception):
    """Ends the test's run of the feed loop."""


async def test_the_feed_backs_off_to_ten_seconds_and_starts_again_after_a_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay_feed, "log", structlog.get_logger("jobplane.relay.feed_backoff"))
    relay = Relay(
        cast(AsyncEngine, None), _DOWN, "amqp://unused", load_topology(), poll_seconds=0.001
    )
    relay._link = cast(Link, _Link())
    refused = through_sqlalchemy(asyncpg_error("57P03", "the database system is starting up"))
    passes: list[Any] = [refused] * 7 + [FeedPass(published=3)] + [refused] * 3

    async def publish_events_once(channel: Any) -> FeedPass:
        answer = passes.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return cast(FeedPass, answer)

    slept: list[float] = []
    real_sleep = asyncio.sleep
    feed_task = asyncio.current_task()  # the loop runs in this test's task

    async def sleep(delay: float) -> None:
        if asyncio.current_task() is not feed_task:  # another test's leftover task
            return await real_sleep(delay)
        slept.append(delay)
        if not passes:
            raise _Stop
        await real_sleep(0)

    relay.publish_events_once = publish_events_once  # type: ignore[method-assign]
    monkeypatch.setattr(asyncio, "sleep", sleep)
    with capture_every_level() as lines, pytest.raises(_Stop):
        await relay._run_feed()
    # Doubling from half a second to ten; the pass that published starts it again
    # (its own short linger for more commits between).
    linger = relay_feed._FEED_LINGER_SECONDS
    assert slept == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, linger, 0.5, 1.0, 2.0]
    assert [line["event"] for line in lines] == ["relay.db.error"] * 10
    assert relay.database_errors == 10


async def test_a_bug_under_a_feed_pass_is_an_error_naming_the_feed_and_the_loop_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay_feed, "log", structlog.get_logger("jobplane.relay.feed_bug"))
    relay = Relay(cast(AsyncEngine, None), _DOWN, "amqp://unused", load_topology())
    relay._link = cast(Link, _Link())
    bug = RuntimeError("a bug")

    async def publish_events_once(channel: Any) -> FeedPass:
        raise bug

    feed_task = asyncio.current_task()
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        if asyncio.current_task() is not feed_task:
            return await real_sleep(delay)
        raise _Stop  # the pause after the failed pass: the loop went on

    relay.publish_events_once = publish_events_once  # type: ignore[method-assign]
    monkeypatch.setattr(asyncio, "sleep", sleep)
    with capture_every_level() as lines, pytest.raises(_Stop):
        await relay._run_feed()
    assert [dict(line) for line in lines] == [
        {
            "event": "relay.error",
            "log_level": "error",
            "feed": "events",
            "error": "RuntimeError: a bug",
            "exc_info": bug,
        }
    ]
    assert relay.database_errors == 0
