"""Tenants and API keys. Keys are stored only as SHA-256 hashes.

A key is 256 random bits, so a fast hash is enough: there is nothing to
brute-force that a slow hash would protect.
"""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.engine import autocommit

KEY_PREFIX = "jp_"

_UPSERT_TENANT = text(
    """
    INSERT INTO tenants (name) VALUES (:name)
    ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
    RETURNING id
    """
)
_INSERT_KEY = text(
    "INSERT INTO api_keys (tenant_id, key_hash, prefix) VALUES (:tenant_id, :key_hash, :prefix)"
)
_RESOLVE = text("SELECT tenant_id FROM api_keys WHERE key_hash = :key_hash AND revoke_time IS NULL")


def hash_key(key: str) -> bytes:
    """The stored form of a key."""
    return hashlib.sha256(key.encode()).digest()


class KeyStore:
    """Creates keys and resolves them to tenants, with a short positive cache."""

    def __init__(self, engine: AsyncEngine, *, cache_seconds: float = 30.0) -> None:
        self._engine = engine
        self._auto = autocommit(engine)
        self._cache_seconds = cache_seconds
        self._cache: dict[bytes, tuple[uuid.UUID, float]] = {}

    async def create_key(self, tenant: str) -> tuple[str, uuid.UUID]:
        """A new key for ``tenant`` (created if needed); the key is shown once."""
        if not tenant or len(tenant) > 200:
            raise ValueError("tenant name must be 1..200 characters")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        async with self._engine.begin() as conn:
            tenant_id = (await conn.execute(_UPSERT_TENANT, {"name": tenant})).scalar_one()
            await conn.execute(
                _INSERT_KEY,
                {"tenant_id": tenant_id, "key_hash": hash_key(key), "prefix": key[:8]},
            )
        return key, uuid.UUID(str(tenant_id))

    async def resolve(self, key: str) -> uuid.UUID | None:
        """The tenant of ``key``, or None when the key is unknown or revoked."""
        if not key.startswith(KEY_PREFIX) or len(key) > 200:
            return None
        digest = hash_key(key)
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        async with self._auto.connect() as conn:
            tenant_id = (await conn.execute(_RESOLVE, {"key_hash": digest})).scalar_one_or_none()
        if tenant_id is None:
            self._cache.pop(digest, None)
            return None
        resolved = uuid.UUID(str(tenant_id))
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[digest] = (resolved, now + self._cache_seconds)
        return resolved
