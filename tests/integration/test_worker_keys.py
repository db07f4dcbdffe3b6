"""Worker keys: made, listed and rotated by the CLI; keys from before 0012 stay tenant keys."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from jobplane.store.engine import create_engine, migrate
from jobplane.store.keys import KeyIdentity, KeyStore, WorkerIdentity, _new_key, hash_key
from tests.integration.test_cli_and_sync import jobplane
from tests.integration.test_keys import reported_key_id
from tests.support import services
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False, relay=False)


async def test_worker_keys_by_the_cli(stack: Stack) -> None:
    code, out, err = await jobplane(stack, "keys", "create", "--worker")
    assert code == 0, err
    key = out.strip()
    assert out == key + "\n" and "worker key" in err
    key_id = reported_key_id(err)
    assert await stack.server.keys.resolve(key) == WorkerIdentity(key_id)

    code, out, _err = await jobplane(stack, "keys", "list", "--json")
    listed = {k["key_id"]: k for k in map(json.loads, out.splitlines())}
    assert (listed[key_id]["scope"], listed[key_id]["tenant"], listed[key_id]["tenant_id"]) == (
        "worker",
        "",
        None,
    )
    tenant_keys = [k for k in listed.values() if k["key_id"] != key_id]
    assert [k["scope"] for k in tenant_keys] == ["tenant"]
    code, out, _err = await jobplane(stack, "keys", "list")
    assert code == 0 and "(worker)" in out

    # A rotated worker key is a worker key.
    code, out, err = await jobplane(stack, "keys", "rotate", key_id)
    assert code == 0, err
    assert isinstance(await stack.server.keys.resolve(out.strip()), WorkerIdentity)

    for args in (("keys", "create"), ("keys", "create", "--worker", "--tenant", "acme")):
        code, _out, err = await jobplane(stack, *args)
        assert code == 2, err


async def test_a_worker_key_has_no_tenant_and_a_tenant_key_has_one(stack: Stack) -> None:
    statement = text(
        "INSERT INTO api_keys (tenant_id, key_hash, prefix, scope) VALUES (:t, :h, 'jp_x', :s)"
    )
    for tenant, scope in ((stack.tenant_id, "worker"), (None, "tenant"), (None, "admin")):
        with pytest.raises(IntegrityError):
            async with stack.engine.begin() as conn:
                await conn.execute(statement, {"t": tenant, "h": hash_key(_new_key()), "s": scope})


@pytest.fixture
async def database_at_0010(run_id: str) -> AsyncIterator[str]:
    async with services.database_at(run_id, "0010") as url:
        yield url


async def test_keys_from_before_0012_stay_tenant_keys(database_at_0010: str) -> None:
    key = _new_key()
    engine = create_engine(database_at_0010, pool_size=2)
    try:
        async with engine.begin() as conn:
            tenant = (
                await conn.execute(text("INSERT INTO tenants (name) VALUES ('old') RETURNING id"))
            ).scalar_one()
            await conn.execute(
                text("INSERT INTO api_keys (tenant_id, key_hash, prefix) VALUES (:t, :h, :p)"),
                {"t": tenant, "h": hash_key(key), "p": key[:8]},
            )
        await migrate(database_at_0010, create=False)
        keys = KeyStore(engine)
        identity = await keys.resolve(key)
        assert isinstance(identity, KeyIdentity) and str(identity.tenant_id) == str(tenant)
        (listed,) = await keys.list_keys()
        assert (listed.scope.value, listed.tenant) == ("tenant", "old")
        await keys.close()
    finally:
        await engine.dispose()
