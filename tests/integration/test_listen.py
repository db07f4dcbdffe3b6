"""The LISTEN connection a process's listeners share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
from sqlalchemy.engine import make_url

from jobplane.store.listen import Listener
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


def _appender(into: list[str], item: str) -> Callable[[], None]:
    return lambda: into.append(item)


async def _all_heard(heard: dict[str, list[str]], count: int = 1) -> bool:
    await asyncio.sleep(0)
    return all(len(payloads) >= count for payloads in heard.values())


async def _none_left(database: str) -> bool:
    return not await _backends(database)
