"""The LISTEN connection a process's listeners share."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import asyncpg
from sqlalchemy.engine import make_url

from jobplane.store.listen import Listener, _Link
from tests.support import services
from tests.support.stack import eventually


async def _backends(database: str) -> list[int]:
    admin = await asyncpg.connect(services.PG_ADMIN_URL)
    try:
        rows = await admin.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            database,
        )
    finally:
        await admin.close()
    return [int(row["pid"]) for row in rows]


async def _notify(database_url: str, channel: str, payload: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("SELECT pg_notify($1, $2)", channel, payload)
    finally:
        await conn.close()


async def test_the_listeners_of_a_process_share_one_connection(database_url: str) -> None:
    database = make_url(database_url).database
    assert database
    channels = ("jp_test_a", "jp_test_b", "jp_test_c")
    listeners = [Listener(database_url, channel, reconnect_delay=0.1) for channel in channels]
    heard: dict[str, list[str]] = {channel: [] for channel in channels}
    for listener in listeners:
        listener.on_notify(heard[listener.channel].append)
        await listener.start()
    try:
        pids = await _backends(database)
        assert len(pids) == 1, pids  # three channels, one backend
        for channel in channels:
            await _notify(database_url, channel, f"to {channel}")
        await eventually(lambda: _all_heard(heard), timeout=10)
        assert heard == {channel: [f"to {channel}"] for channel in channels}

        # Lost, the one connection comes back listening on every channel, and
        # every listener wakes its subscribers.
        resets: list[str] = []
        for listener in listeners:
            listener.on_reset(_appender(resets, listener.channel))
        admin = await asyncpg.connect(services.PG_ADMIN_URL)
        try:
            await admin.execute("SELECT pg_terminate_backend($1)", pids[0])
        finally:
            await admin.close()

        async def back() -> bool:
            now = await _backends(database)
            return len(now) == 1 and now != pids and set(channels) <= set(resets)

        await eventually(back, timeout=20)
        for channel in channels:
            await _notify(database_url, channel, "again")
        await eventually(lambda: _all_heard(heard, 2), timeout=10)

        # The last listener out closes it; the others' stops leave it open.
        await listeners[0].stop()
        await listeners[1].stop()
        assert len(await _backends(database)) == 1
        await _notify(database_url, channels[2], "still")
        await eventually(lambda: _all_heard({channels[2]: heard[channels[2]]}, 3), timeout=10)
    finally:
        for listener in listeners:
            await listener.stop()
    await eventually(lambda: _none_left(database), timeout=10)


async def test_a_listener_starting_as_the_last_one_stops_takes_a_live_link(
    database_url: str,
) -> None:
    """The last listener's stop and another's start, queued on the link in that
    order: the new one must not attach to the link being closed (it would hold
    a connection no later listener shares, or none)."""
    database = make_url(database_url).database
    assert database
    first = Listener(database_url, "jp_test_first", reconnect_delay=0.1)
    second = Listener(database_url, "jp_test_second", reconnect_delay=0.1)
    third = Listener(database_url, "jp_test_third", reconnect_delay=0.1)
    heard: list[str] = []
    third.on_notify(heard.append)
    await first.start()
    link = _Link.of(database_url, 0.1)
    try:
        # Holding the link's lock queues the stop, then the start (asyncio's
        # lock is first come, first served): the start has resolved the link.
        async with link._lock:
            stopping = asyncio.create_task(first.stop())
            await asyncio.sleep(0.05)
            starting = asyncio.create_task(second.start())
            await asyncio.sleep(0.05)
        await asyncio.wait_for(stopping, timeout=10)
        await asyncio.wait_for(starting, timeout=30)
        assert second._link is not link
        assert second._link is _Link.of(database_url, 0.1)
        # A later listener shares the second's connection and hears at once.
        await asyncio.wait_for(third.start(), timeout=10)
        assert third._link is second._link
        await eventually(lambda: _one_backend(database), timeout=10)
        await _notify(database_url, "jp_test_third", "heard")
        await eventually(lambda: _all_heard({"third": heard}), timeout=10)
    finally:
        for listener in (first, second, third):
            await listener.stop()
    await eventually(lambda: _none_left(database), timeout=10)


async def test_a_listen_task_ending_late_keeps_a_newer_connection(database_url: str) -> None:
    """A link's task cancelled after another connection took its place leaves that
    connection the link's: later listeners LISTEN on it at once."""
    listener = Listener(database_url, "jp_test_late", reconnect_delay=0.1)
    await listener.start()
    link = listener._link
    assert link is not None and link._task is not None
    newer = await asyncpg.connect(database_url)
    try:
        old_task = link._task
        link._conn = newer
        old_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await old_task
        assert link._conn is newer
    finally:
        link._conn = None
        await listener.stop()
        await newer.close()


async def _one_backend(database: str) -> bool:
    return len(await _backends(database)) == 1


def _appender(into: list[str], item: str) -> Callable[[], None]:
    return lambda: into.append(item)


async def _all_heard(heard: dict[str, list[str]], count: int = 1) -> bool:
    await asyncio.sleep(0)
    return all(len(payloads) >= count for payloads in heard.values())


async def _none_left(database: str) -> bool:
    return not await _backends(database)
