"""API keys: ids, revocation reaching every server, rotation, and the `keys` commands."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import AsyncClient
from jobplane.store.keys import KeyNotFound, KeyRevoked, KeyStore
from jobplane.topology import Topology
from tests.support.servers import Servers, refused_within
from tests.support.statements import counting

# How soon a revocation must reach every server.
REVOCATION_BOUND = 1.0


@pytest.fixture
async def servers(
    engine: AsyncEngine, database_url: str, topology: Topology
) -> AsyncIterator[Servers]:
    running = Servers(engine, database_url, topology)
    yield running
    await running.close()


async def jobplane(database_url: str, *args: str) -> tuple[int, str, str]:
    """Run the `jobplane` command against ``database_url``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env={**os.environ, "JOBPLANE_DATABASE_URL": database_url},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_a_revocation_reaches_another_server_within_a_second(servers: Servers) -> None:
    first = await servers.start()
    second = await servers.start()
    created = await first.keys.create("acme")
    other_key, _tenant = await first.keys.create_key("acme")
    on_second = servers.client(second, created.key)
    await on_second.list()
    assert second.keys.cached == 1  # the key is in the second server's cache

    await first.keys.revoke(created.key_id)

    assert await refused_within(on_second, REVOCATION_BOUND)
    assert await refused_within(servers.client(first, created.key), REVOCATION_BOUND)
    # Only that key: the tenant's other key still works everywhere.
    await servers.client(second, other_key).list()


async def test_a_listener_reconnect_drops_the_key_cache(servers: Servers) -> None:
    server = await servers.start(key_cache_seconds=300)
    created = await server.keys.create("acme")
    client = servers.client(server, created.key)
    await client.list()
    # Revoked without a notification (as if it were lost): the cache still
    # trusts the key.
    async with servers.engine.begin() as conn:
        await conn.execute(
            text("UPDATE api_keys SET revoke_time = now() WHERE key_id = :k"),
            {"k": created.key_id},
        )
    await client.list()
    # The listener's connection dies; when it is back the cache is dropped.
    async with servers.engine.begin() as conn:
        killed = (
            await conn.execute(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                    "AND (query LIKE 'LISTEN %' OR query = 'SELECT 1')"
                )
            )
        ).scalar_one()
    assert killed >= 1
    assert await refused_within(client, 10.0)


async def test_rotation_with_a_grace_period(servers: Servers) -> None:
    server = await servers.start()
    old = await server.keys.create("acme")
    new, ended = await server.keys.rotate(old.key_id, grace=300)
    assert new.tenant_id == old.tenant_id and new.key_id != old.key_id
    assert ended.active and ended.revoke_time is not None
    # Both keys work for the same tenant during the grace period.
    job = await servers.client(server, old.key).submit("demo.echo", {})
    assert (await servers.client(server, new.key).get(job.name)).name == job.name
    # Revoking now ends the grace period at once.
    await server.keys.revoke(old.key_id)
    assert await refused_within(servers.client(server, old.key), REVOCATION_BOUND)
    with pytest.raises(KeyRevoked):
        await server.keys.rotate(old.key_id)
    with pytest.raises(KeyNotFound):
        await server.keys.revoke("key_doesnotexist")


@pytest.mark.parametrize("ending", ["rotate", "revoke"])
async def test_a_key_ending_later_is_refused_within_a_second_of_its_end(
    servers: Servers, ending: str
) -> None:
    # However long the server caches keys, it keeps one no longer than its end.
    server = await servers.start(key_cache_seconds=60)
    admin = await servers.start()
    old = await admin.keys.create("acme")
    client = servers.client(server, old.key)
    await client.list()
    assert server.keys.cached == 1
    if ending == "rotate":
        _new, ended = await admin.keys.rotate(old.key_id, grace=4)
    else:
        ended = await admin.keys.revoke(old.key_id, after=4)
    assert ended.active and ended.revoke_time is not None
    # The server heard of it and dropped the key; the next call caches it again.
    await _valid_until_its_end(client, await _end(servers.engine, old.key_id))
    assert await refused_within(client, REVOCATION_BOUND)
    # Its tenant's new key, or another, works on.
    await servers.client(server, (await admin.keys.create("acme")).key).list()


async def _end(engine: AsyncEngine, key_id: str) -> tuple[float, float]:
    """The key's end on this process's monotonic clock, as the earliest and the
    latest it can be: the database's clock is read at some moment of the query,
    which may take long on a loaded machine."""
    before = time.monotonic()
    async with engine.connect() as conn:
        left = await conn.execute(
            text("SELECT extract(epoch FROM revoke_time - now()) FROM api_keys WHERE key_id = :k"),
            {"k": key_id},
        )
        remaining = float(left.scalar_one())
    return before + remaining, time.monotonic() + remaining


async def _valid_until_its_end(client: AsyncClient, end: tuple[float, float]) -> None:
    """Calls of ``client`` succeed until a second before the key's earliest end
    (a call slower than that might reach the server after it); then wait out
    its latest end."""
    earliest, latest = end
    calls = 0
    while time.monotonic() < earliest - 1.0:
        await client.list()  # still valid until its end
        calls += 1
        await asyncio.sleep(0.1)
    assert calls > 0, "the key ended before it was used"
    await asyncio.sleep(max(0.0, latest - time.monotonic()))


async def test_keys_commands(servers: Servers) -> None:
    server = await servers.start()
    url = servers.database_url

    code, out, err = await jobplane(url, "keys", "create", "--tenant", "initech")
    assert code == 0, err
    first = out.strip()
    assert out == first + "\n"
    first_id = reported_key_id(err)
    await servers.client(server, first).list()

    code, out, _err = await jobplane(url, "keys", "list", "--json")
    assert code == 0
    assert first not in out  # never the secret
    listed = [json.loads(line) for line in out.splitlines()]
    assert [(k["key_id"], k["tenant"], k["active"]) for k in listed] == [
        (first_id, "initech", True)
    ]
    assert listed[0]["prefix"] == first[:8]
    assert listed[0]["last_used_time"] is not None

    # Rotate: a new key, and the old one is refused on a running server.
    code, out, err = await jobplane(url, "keys", "rotate", first_id)
    assert code == 0, err
    second = out.strip()
    assert second.startswith("jp_") and second != first
    assert await refused_within(servers.client(server, first), REVOCATION_BOUND)
    await servers.client(server, second).list()

    second_id = next(k.key_id for k in await server.keys.list_keys("initech") if k.active)
    code, _out, err = await jobplane(url, "keys", "revoke", second_id)
    assert code == 0, err
    assert await refused_within(servers.client(server, second), REVOCATION_BOUND)

    assert [k.active for k in await server.keys.list_keys("initech")] == [False, False]

    code, out, err = await jobplane(url, "keys", "revoke", "key_nosuchkey")
    assert code == 1
    assert err.strip().count("\n") == 0 and "key_nosuchkey" in err


async def test_keys_revoke_after(servers: Servers) -> None:
    # `keys revoke --after 6`: the key works on a running server until its end,
    # and is refused within a second of it.
    server = await servers.start()
    created = await server.keys.create("acme")
    client = servers.client(server, created.key)
    await client.list()

    # Long enough for the command to start and end on a loaded machine with
    # seconds of the key's life left to use it.
    code, _out, err = await jobplane(
        servers.database_url, "keys", "revoke", created.key_id, "--after", "6"
    )
    assert code == 0, err
    assert created.key_id in err and "ends at" in err
    end = await _end(servers.engine, created.key_id)
    assert end[0] - time.monotonic() <= 6
    assert (await server.keys.get_key(created.key_id)).active
    await _valid_until_its_end(client, end)
    assert await refused_within(client, REVOCATION_BOUND)
    assert not (await server.keys.get_key(created.key_id)).active


@pytest.mark.parametrize(
    "argv",
    [
        ["revoke", "--after", "-1"],
        ["revoke", "--after", "soon"],
        ["revoke", "--after", "nan"],
        ["revoke", "--after", "1e300"],
        ["rotate", "--grace", "-5"],
        ["rotate", "--grace", "inf"],
    ],
)
async def test_keys_bad_seconds_change_nothing(servers: Servers, argv: list[str]) -> None:
    server = await servers.start()
    created = await server.keys.create("acme")
    command, flag, value = argv

    code, out, err = await jobplane(
        servers.database_url, "keys", command, created.key_id, flag, value
    )
    assert (code, out) == (2, ""), err
    assert err.strip().count("\n") == 0 and flag in err and repr(value) in err, err
    # Still the tenant's only key, valid with no end.
    [info] = await server.keys.list_keys("acme")
    assert (info.key_id, info.active, info.revoke_time) == (created.key_id, True, None)
    await servers.client(server, created.key).list()


def reported_key_id(stderr: str) -> str:
    """The key id `keys create` reports on stderr."""
    words = [w for w in stderr.split() if w.startswith("key_")]
    assert words, stderr
    return words[0]


async def test_every_key_has_an_id_and_is_stored_as_a_hash(engine: AsyncEngine) -> None:
    keys = KeyStore(engine)
    a = await keys.create("acme")
    b = await keys.create("acme")
    assert a.key_id != b.key_id and a.key_id.startswith("key_")
    assert a.key_id not in a.key and a.key[3:] not in a.key_id
    async with engine.connect() as conn:
        stored = (
            await conn.execute(
                text(
                    "SELECT bool_and(position(convert_to(:k, 'UTF8') in key_hash) = 0) "
                    "AND bool_and(key_id <> :k) FROM api_keys"
                ),
                {"k": a.key},
            )
        ).scalar_one()
    assert stored is True
    assert [k.key_id for k in await keys.list_keys("acme")] == [a.key_id, b.key_id]


# -- resolving under a flood of made-up keys ------------------------------------

# In the resolve statement, and in nothing else the store sends.
RESOLVE = "SET last_used_time = now()"


def made_up_key() -> str:
    """A key shaped like a real one that no tenant has."""
    return "jp_" + secrets.token_urlsafe(32)


async def test_keys_of_any_other_shape_cost_no_statement(engine: AsyncEngine) -> None:
    keys = KeyStore(engine)
    created = await keys.create("acme")
    malformed = [
        "jp_not-a-key",
        created.key[:-1],
        created.key + "A",
        "xx_" + created.key[3:],
        created.key[:-1] + "B",
        created.key + "\n",
        "jp_" + "A" * 500,
    ]
    with counting(engine, RESOLVE) as statements:
        assert [await keys.resolve(key) for key in malformed] == [None] * len(malformed)
    assert statements.sent == 0
    with counting(engine, RESOLVE) as statements:
        assert await keys.resolve(created.key) is not None
    assert statements.sent == 1


async def test_a_flood_of_unknown_keys_costs_a_few_statements(engine: AsyncEngine) -> None:
    keys = KeyStore(engine)  # two lookups at most at once
    created = await keys.create("acme")
    flood = [made_up_key() for _ in range(3000)]
    # A real key that is not cached yet arrives in the middle of the flood.
    calls = [*flood[:1500], created.key, *flood[1500:]]
    with counting(engine, RESOLVE) as statements:
        answers = await asyncio.gather(*(keys.resolve(key) for key in calls))
    assert answers[1500] is not None and answers[1500].key_id == created.key_id
    assert answers[:1500] + answers[1501:] == [None] * len(flood)
    # Batches of 500, in at most two statements at a time.
    assert statements.sent <= len(calls) // 500 + 2
    assert statements.most_at_once <= 2

    # The same keys again, one at a time: remembered as unknown.
    with counting(engine, RESOLVE) as statements:
        for key in flood[:200]:
            assert await keys.resolve(key) is None
    assert statements.sent == 0


async def test_keys_looked_up_one_by_one_share_statements(engine: AsyncEngine) -> None:
    # Made-up keys arriving one after another, faster than a lookup slot
    # frees (each is held for lookup_interval): they wait and share one.
    keys = KeyStore(engine, max_lookups=1, lookup_interval=1.0)
    resolving = []
    with counting(engine, RESOLVE) as statements:
        for _ in range(30):
            resolving.append(asyncio.ensure_future(keys.resolve(made_up_key())))
            await asyncio.sleep(0.002)
        assert await asyncio.gather(*resolving) == [None] * 30
    # The first alone, the rest (however they spread over the second) in the
    # statement after it.
    assert statements.sent <= 2
    await keys.close()


async def test_unknown_keys_are_forgotten_after_a_while(engine: AsyncEngine) -> None:
    keys = KeyStore(engine, unknown_seconds=2.0)
    key = made_up_key()
    with counting(engine, RESOLVE) as statements:
        assert await keys.resolve(key) is None
        assert await keys.resolve(key) is None
        assert statements.sent == 1
        await asyncio.sleep(2.1)
        assert await keys.resolve(key) is None
        assert statements.sent == 2
    assert keys.remembered_unknown == 1
