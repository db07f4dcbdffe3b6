"""When a rotated or revoked API key ends, and what its rotation hands out:
the new key, its scope and tenant, and the old key's state (docs/security.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.keys import (
    KeyIdentity,
    KeyNotFound,
    KeyRevoked,
    KeyScope,
    KeyStore,
    WorkerIdentity,
)


async def test_a_rotation_hands_out_a_key_of_the_same_tenant_and_ends_the_old_after_its_grace(
    engine: AsyncEngine,
) -> None:
    keys = KeyStore(engine)
    try:
        old = await keys.create("acme")
        assert old.tenant_id is not None
        before = datetime.now(UTC)
        new, ended = await keys.rotate(old.key_id, grace=300)
        after = datetime.now(UTC)
        assert new.key_id.startswith("key_") and new.key_id != old.key_id
        assert (new.tenant, new.tenant_id, new.scope) == ("acme", old.tenant_id, KeyScope.TENANT)
        assert await keys.resolve(new.key) == KeyIdentity(old.tenant_id, new.key_id)
        assert (ended.key_id, ended.tenant, ended.tenant_id) == (old.key_id, "acme", old.tenant_id)
        assert ended.prefix == old.key[:8] and ended.active
        assert ended.revoke_time is not None
        assert (
            before + timedelta(seconds=299) <= ended.revoke_time <= after + timedelta(seconds=300)
        )
        # The old key still works in its grace; the new one never ends by itself.
        assert await keys.resolve(old.key) == KeyIdentity(old.tenant_id, old.key_id)
        assert (await keys.get_key(new.key_id)).revoke_time is None

        # Without a grace the old key ends at once.
        newest, gone = await keys.rotate(new.key_id)
        assert not gone.active and gone.revoke_time is not None
        assert gone.revoke_time <= datetime.now(UTC)
        assert await keys.resolve(new.key) is None
        assert newest.tenant == "acme"
    finally:
        await keys.close()


async def test_a_worker_keys_rotation_is_a_worker_key(engine: AsyncEngine) -> None:
    keys = KeyStore(engine)
    try:
        old = await keys.create_worker()
        new, ended = await keys.rotate(old.key_id, grace=60)
        assert (new.tenant, new.tenant_id, new.scope) == ("", None, KeyScope.WORKER)
        assert await keys.resolve(new.key) == WorkerIdentity(new.key_id)
        assert (ended.scope, ended.tenant, ended.tenant_id, ended.active) == (
            KeyScope.WORKER,
            "",
            None,
            True,
        )
    finally:
        await keys.close()


async def test_a_revocation_only_ever_moves_a_keys_end_earlier(engine: AsyncEngine) -> None:
    keys = KeyStore(engine)
    try:
        made = await keys.create("acme")
        before = datetime.now(UTC)
        first = await keys.revoke(made.key_id, after=300)
        assert first.active and first.revoke_time is not None
        assert before + timedelta(seconds=299) <= first.revoke_time
        assert first.revoke_time <= datetime.now(UTC) + timedelta(seconds=300)
        later = await keys.revoke(made.key_id, after=3600)
        assert later.revoke_time == first.revoke_time
        _new, rotated = await keys.rotate(made.key_id, grace=3600)
        assert rotated.revoke_time == first.revoke_time
        now = await keys.revoke(made.key_id)
        assert not now.active and now.revoke_time is not None
        assert now.revoke_time < first.revoke_time
    finally:
        await keys.close()


async def test_negative_times_and_unknown_keys_are_refused(engine: AsyncEngine) -> None:
    keys = KeyStore(engine)
    try:
        made = await keys.create("acme")
        with pytest.raises(ValueError, match=r"^grace must not be negative$"):
            await keys.rotate(made.key_id, grace=-1)
        with pytest.raises(ValueError, match=r"^after must not be negative$"):
            await keys.revoke(made.key_id, after=-1)
        assert (await keys.get_key(made.key_id)).revoke_time is None
        with pytest.raises(KeyNotFound, match=r"^no API key 'key_doesnotexist'$"):
            await keys.revoke("key_doesnotexist")
        with pytest.raises(KeyNotFound):
            await keys.rotate("key_doesnotexist")
        await keys.revoke(made.key_id)
        with pytest.raises(KeyRevoked, match=rf"^API key '{made.key_id}' is already revoked$"):
            await keys.rotate(made.key_id)
    finally:
        await keys.close()
