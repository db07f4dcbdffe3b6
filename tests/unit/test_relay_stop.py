"""A relay stopped before its start finished: a process told to stop while it is
still starting (its database or broker not answering yet) stops cleanly and
closes what the relay owns, and only that."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.db import Database
from jobplane.store.listen import Listener
from jobplane.topology import load_topology
from jobplane.workers import relay as relay_module
from jobplane.workers.relay import Relay

_URL = "postgresql://jobplane@127.0.0.1:1/jobplane"


class _Pool:
    """Stands in for a :class:`Database`: whether it is open."""

    def __init__(self, url: str = _URL, **_: Any) -> None:
        self.url = url
        self.open_now = False
        self.closes = 0

    async def open(self) -> None:
        self.open_now = True

    async def close(self) -> None:
        self.open_now = False
        self.closes += 1


class _Listener:
    """Stands in for a :class:`Listener`; ``hang``: its start waits for ever (a
    database that does not answer the LISTEN)."""

    def __init__(self, *, hang: bool = False) -> None:
        self.hang = hang
        self.listening = False
        self.stops = 0

    async def start(self) -> None:
        if self.hang:
            await asyncio.Event().wait()
        self.listening = True

    async def stop(self) -> None:
        self.listening = False
        self.stops += 1


def _relay(monkeypatch: pytest.MonkeyPatch, *, db: _Pool | None = None) -> tuple[Relay, _Pool]:
    """A relay whose pool (its own, or ``db``) and listeners are the fakes above."""
    made: list[_Pool] = []

    def pool(url: str, **kwargs: Any) -> _Pool:
        made.append(_Pool(url, **kwargs))
        return made[-1]

    monkeypatch.setattr(relay_module, "Database", pool)
    relay = Relay(
        cast(AsyncEngine, None),
        _URL,
        "amqp://unused",
        load_topology(),
        db=cast(Database, db),
    )
    relay._wakeups = cast(Listener, _Listener())
    relay._event_wakeups = cast(Listener, _Listener())
    assert len(made) == (0 if db is not None else 1)
    return relay, db or made[0]


def _listeners(relay: Relay) -> list[_Listener]:
    return [cast(_Listener, relay._wakeups), cast(_Listener, relay._event_wakeups)]


async def test_a_relay_never_started_stops_and_closes_its_own_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay, pool = _relay(monkeypatch)
    await relay.stop()
    assert pool.closes == 1
    assert [listener.stops for listener in _listeners(relay)] == [1, 1]
    assert not relay.connected
    # Stopped again (on a signal, then at the process's exit): as harmless.
    await relay.stop()
    assert not pool.open_now and not relay.connected
    assert (relay.published, relay.events_published, relay.database_errors) == (0, 0, 0)


async def test_a_relay_whose_start_was_cancelled_stops_and_closes_what_it_opened(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    relay, pool = _relay(monkeypatch)
    outbox, events = _listeners(relay)
    events.hang = True
    starting = asyncio.create_task(relay.start())
    for _ in range(100):
        if outbox.listening:
            break
        await asyncio.sleep(0)
    # The pool is open and the outbox's LISTEN in place; the events' LISTEN waits.
    assert pool.open_now and outbox.listening and not starting.done()
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    await relay.stop()
    assert (pool.open_now, pool.closes) == (False, 1)
    assert not outbox.listening and (outbox.stops, events.stops) == (1, 1)
    assert not relay.connected


async def test_a_relay_stopped_before_its_start_leaves_the_callers_pool_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    theirs = _Pool()
    await theirs.open()
    relay, pool = _relay(monkeypatch, db=theirs)
    assert pool is theirs
    await relay.stop()
    assert (theirs.open_now, theirs.closes) == (True, 0)
    assert [listener.stops for listener in _listeners(relay)] == [1, 1]
