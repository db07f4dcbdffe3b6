"""Tenants and API keys. Keys are stored only as SHA-256 hashes.

A key is 256 random bits, so a fast hash is enough: there is nothing to
brute-force that a slow hash would protect.

Each key also has a non-secret id (``key_…``) by which operators list, revoke
and rotate it and by which logs name the caller. A server caches resolved keys
for a short while; revoking or rotating a key sends a notification on
:data:`KEYS_CHANNEL` in the same transaction, and every server drops that key
from its cache when it hears it (:meth:`KeyStore.forget`), and its whole cache
when its LISTEN connection comes back (:meth:`KeyStore.clear_cache`), since
notifications sent meanwhile are lost.

A key has a scope (:class:`KeyScope`): a tenant key calls JobService and
EventService for its tenant; a worker key calls WorkerService only, for the
jobs of the whole deployment, and has no tenant (ADR-0018).

Resolving is built to survive a flood of made-up keys (see
:meth:`KeyStore.resolve`): anything not shaped exactly like a key this module
makes is refused without a database round trip, keys found unknown are
remembered for a short while, and the keys not cached are looked up in
batches by at most ``max_lookups`` statements at a time, each holding its
slot for at least ``lookup_interval`` seconds. However many keys arrive, key
lookups hold at most ``max_lookups`` pooled connections and run at most
``max_lookups / lookup_interval`` statements a second.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import itertools
import re
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.engine import RowMapping
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.store.engine import autocommit

KEY_PREFIX = "jp_"
# The secret part of a key: secrets.token_urlsafe(_KEY_BYTES).
_KEY_BYTES = 32
# Exactly what _new_key makes: the prefix, then 32 random bytes in unpadded
# base64url, which is 43 characters. The last one carries the final 4 bits
# and 2 zero bits, so it is one of the 16 characters whose index in the
# alphabet is a multiple of 4.
_KEY_SHAPE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]")
KEYS_CHANNEL = "jobplane_keys"
MAX_TENANT_NAME = 200
# Bounds the cache of one server process; past it the cache starts over.
_CACHE_ENTRIES = 10_000
# Bounds the memory of keys found unknown; past it the oldest are forgotten.
_UNKNOWN_ENTRIES = 10_000
# Keys one lookup statement asks about at most.
_LOOKUP_BATCH = 500

_UPSERT_TENANT = text(
    """
    INSERT INTO tenants (name) VALUES (:name)
    ON CONFLICT (name) DO UPDATE SET name = EXCLUDED.name
    RETURNING id
    """
)
# A tenant key names no scope (the column's default): creating one works on a
# database from before worker keys too, as tests of older revisions do.
_INSERT_KEY = text(
    """
    INSERT INTO api_keys (tenant_id, key_hash, prefix) VALUES (:tenant_id, :key_hash, :prefix)
    RETURNING key_id
    """
)
_INSERT_WORKER_KEY = text(
    """
    INSERT INTO api_keys (tenant_id, key_hash, prefix, scope)
    VALUES (NULL, :key_hash, :prefix, 'worker')
    RETURNING key_id
    """
)
# last_used_time is written at most once a minute per key, and only on a cache
# miss: a write per call would cost more than the call. Unknown keys match no
# row, so they write nothing.
_RESOLVE = text(
    """
    WITH k AS (
        SELECT id, key_hash, tenant_id, key_id, scope, revoke_time, last_used_time FROM api_keys
        WHERE key_hash = ANY(:key_hashes) AND (revoke_time IS NULL OR revoke_time > now())
    ), touched AS (
        UPDATE api_keys a SET last_used_time = now() FROM k
        WHERE a.id = k.id
          AND (k.last_used_time IS NULL OR k.last_used_time < now() - interval '60 seconds')
    )
    SELECT key_hash, tenant_id, key_id, scope,
           extract(epoch FROM revoke_time - now())::float8 AS remaining
    FROM k
    """
)
_SELECT_KEYS = """
    SELECT k.key_id, t.name AS tenant, k.tenant_id, k.scope, k.prefix, k.create_time,
           k.revoke_time, k.last_used_time,
           (k.revoke_time IS NULL OR k.revoke_time > now()) AS active
    FROM api_keys k LEFT JOIN tenants t ON t.id = k.tenant_id
"""
_LIST = text(_SELECT_KEYS + " ORDER BY t.name NULLS FIRST, k.create_time, k.key_id")
_LIST_TENANT = text(
    _SELECT_KEYS + " WHERE t.name = :tenant ORDER BY t.name, k.create_time, k.key_id"
)
_ONE = text(_SELECT_KEYS + " WHERE k.key_id = :key_id")
_LOCK_ACTIVE = text(
    """
    SELECT k.tenant_id, t.name, k.scope FROM api_keys k LEFT JOIN tenants t ON t.id = k.tenant_id
    WHERE k.key_id = :key_id AND (k.revoke_time IS NULL OR k.revoke_time > now())
    FOR UPDATE OF k
    """
)
# A revocation only ever moves revoke_time earlier.
_REVOKE = text(
    """
    UPDATE api_keys
    SET revoke_time =
        LEAST(COALESCE(revoke_time, 'infinity'), now() + make_interval(secs => :after))
    WHERE key_id = :key_id
    RETURNING key_id
    """
)
_NOTIFY = text(f"SELECT pg_notify('{KEYS_CHANNEL}', :key_id)")


class KeyScope(enum.StrEnum):
    """What a key may call."""

    TENANT = "tenant"  # JobService and EventService, for its tenant
    WORKER = "worker"  # WorkerService only, for every tenant's jobs


class KeyNotFound(LookupError):
    """No API key with this id."""


class KeyRevoked(ValueError):
    """The API key is already revoked."""


def hash_key(key: str) -> bytes:
    """The stored form of a key."""
    return hashlib.sha256(key.encode()).digest()


def _new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(_KEY_BYTES)


def key_shaped(key: str) -> bool:
    """True when ``key`` has exactly the shape of the keys :class:`KeyStore` makes."""
    return _KEY_SHAPE.fullmatch(key) is not None


@dataclass(frozen=True, slots=True)
class KeyIdentity:
    """Who a call's key stands for: its tenant and the key's non-secret id."""

    tenant_id: uuid.UUID
    key_id: str


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Who a worker key's call is: the key's non-secret id; no tenant (ADR-0018)."""

    key_id: str


#: What a key resolves to: a tenant's caller, or a worker.
Identity = KeyIdentity | WorkerIdentity


@dataclass(frozen=True, slots=True)
class NewKey:
    """A key just created. ``key`` is the secret: it is shown once, never stored.

    A worker key has no tenant: ``tenant`` is empty and ``tenant_id`` None.
    """

    key: str
    key_id: str
    tenant: str
    tenant_id: uuid.UUID | None
    scope: KeyScope = KeyScope.TENANT


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What is known about a key, without its secret."""

    key_id: str
    tenant: str  # empty for a worker key
    tenant_id: uuid.UUID | None  # None for a worker key
    prefix: str
    create_time: datetime
    revoke_time: datetime | None
    last_used_time: datetime | None
    active: bool
    scope: KeyScope = KeyScope.TENANT


@dataclass(slots=True)
class _Cached:
    identity: Identity
    expires: float


class KeyStore:
    """Creates, lists, revokes and rotates keys; resolves them to tenants, cached.

    ``cache_seconds`` bounds how long a resolved key is trusted without asking
    the database again when no notification says otherwise;
    ``unknown_seconds`` how long a key found unknown is refused without
    asking again. At most ``max_lookups`` lookup statements run at once, and
    each holds its slot for at least ``lookup_interval`` seconds.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        cache_seconds: float = 30.0,
        unknown_seconds: float = 10.0,
        max_lookups: int = 2,
        lookup_interval: float = 0.01,
    ) -> None:
        if max_lookups < 1:
            raise ValueError("max_lookups must be at least 1")
        self._engine = engine
        self._auto = autocommit(engine)
        self._cache_seconds = cache_seconds
        self._cache: dict[bytes, _Cached] = {}
        # Unknown keys, oldest first, with when each may be asked about again.
        # No key ever becomes valid after it was unknown (a new key is random,
        # and a revoked one stays revoked), so remembering one is always safe.
        self._unknown_seconds = unknown_seconds
        self._unknown: OrderedDict[bytes, float] = OrderedDict()
        # Every lookup not answered yet; _waiting holds those no statement
        # has taken up yet.
        self._inflight: dict[bytes, asyncio.Future[Identity | None]] = {}
        self._waiting: dict[bytes, asyncio.Future[Identity | None]] = {}
        self._max_lookups = max_lookups
        self._lookup_interval = lookup_interval
        self._lookups: set[asyncio.Task[None]] = set()
        # Bumped by every invalidation: a lookup that started before one may
        # have read a key that is revoked now, so its answer is not cached.
        self._generation = 0

    # -- administration ------------------------------------------------------

    async def create(self, tenant: str) -> NewKey:
        """A new key for ``tenant`` (created if needed); the secret is in the result only."""
        if not tenant or len(tenant) > MAX_TENANT_NAME:
            raise ValueError(f"tenant name must be 1..{MAX_TENANT_NAME} characters")
        async with self._engine.begin() as conn:
            tenant_id = (await conn.execute(_UPSERT_TENANT, {"name": tenant})).scalar_one()
            key, key_id = await self._insert_key(conn, tenant_id)
        return NewKey(key, key_id, tenant, uuid.UUID(str(tenant_id)))

    async def create_worker(self) -> NewKey:
        """A new worker key: WorkerService only, for the whole deployment."""
        async with self._engine.begin() as conn:
            key, key_id = await self._insert_key(conn, None, KeyScope.WORKER)
        return NewKey(key, key_id, "", None, KeyScope.WORKER)

    async def create_key(self, tenant: str) -> tuple[str, uuid.UUID]:
        """A new key for ``tenant`` (created if needed) and the tenant's id."""
        created = await self.create(tenant)
        assert created.tenant_id is not None
        return created.key, created.tenant_id

    async def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        """Every key (of ``tenant``, when given), revoked ones included."""
        async with self._auto.connect() as conn:
            if tenant is None:
                rows = (await conn.execute(_LIST)).mappings().all()
            else:
                rows = (await conn.execute(_LIST_TENANT, {"tenant": tenant})).mappings().all()
        return [_info(row) for row in rows]

    async def get_key(self, key_id: str) -> KeyInfo:
        """One key by id; :class:`KeyNotFound` when there is none."""
        async with self._auto.connect() as conn:
            row = (await conn.execute(_ONE, {"key_id": key_id})).mappings().one_or_none()
        if row is None:
            raise KeyNotFound(f"no API key {key_id!r}")
        return _info(row)

    async def revoke(self, key_id: str, *, after: float = 0.0) -> KeyInfo:
        """Revoke a key now (or ``after`` seconds from now); every server hears of it.

        Revoking an already revoked key changes nothing; a revocation only ever
        moves the key's end earlier.
        """
        if after < 0:
            raise ValueError("after must not be negative")
        async with self._engine.begin() as conn:
            found = (await conn.execute(_REVOKE, {"key_id": key_id, "after": after})).first()
            if found is None:
                raise KeyNotFound(f"no API key {key_id!r}")
            await conn.execute(_NOTIFY, {"key_id": key_id})
        self.forget(key_id)
        return await self.get_key(key_id)

    async def rotate(self, key_id: str, *, grace: float = 0.0) -> tuple[NewKey, KeyInfo]:
        """A new key for the tenant of ``key_id``, which ends after ``grace`` seconds.

        Both happen in one transaction. Returns the new key and the old one's
        state. A revoked key cannot be rotated (:class:`KeyRevoked`).
        """
        if grace < 0:
            raise ValueError("grace must not be negative")
        async with self._engine.begin() as conn:
            row = (await conn.execute(_LOCK_ACTIVE, {"key_id": key_id})).first()
            if row is None:
                # On this transaction's connection: the commands' pool has one.
                if (await conn.execute(_ONE, {"key_id": key_id})).first() is None:
                    raise KeyNotFound(f"no API key {key_id!r}")
                raise KeyRevoked(f"API key {key_id!r} is already revoked")
            tenant_id, tenant, scope = row
            key, new_id = await self._insert_key(conn, tenant_id, KeyScope(scope))
            await conn.execute(_REVOKE, {"key_id": key_id, "after": grace})
            await conn.execute(_NOTIFY, {"key_id": key_id})
            old = (await conn.execute(_ONE, {"key_id": key_id})).mappings().one()
        self.forget(key_id)
        created = NewKey(
            key,
            new_id,
            str(tenant or ""),
            None if tenant_id is None else uuid.UUID(str(tenant_id)),
            KeyScope(scope),
        )
        return created, _info(old)

    @staticmethod
    async def _insert_key(
        conn: AsyncConnection, tenant_id: object, scope: KeyScope = KeyScope.TENANT
    ) -> tuple[str, str]:
        key = _new_key()
        params: dict[str, object] = {"key_hash": hash_key(key), "prefix": key[:8]}
        if scope is KeyScope.WORKER:
            statement = _INSERT_WORKER_KEY
        else:
            statement, params["tenant_id"] = _INSERT_KEY, tenant_id
        key_id = (await conn.execute(statement, params)).scalar_one()
        return key, str(key_id)

    # -- resolution ----------------------------------------------------------

    async def resolve(self, key: str) -> Identity | None:
        """Who ``key`` stands for; None when it is unknown, revoked or malformed.

        A tenant key resolves to its :class:`KeyIdentity`, a worker key to
        its :class:`WorkerIdentity`.

        A key not shaped like the ones :meth:`create` makes is refused at
        once. A key cached as valid, or remembered as unknown, costs no round
        trip. The others wait for a lookup statement, which asks about every
        key waiting when it starts (up to 500): many calls with one key share
        its lookup, and many calls with different keys share statements.
        """
        if not key_shaped(key):
            return None
        return await self.resolve_hash(hash_key(key))

    async def resolve_hash(self, digest: bytes) -> Identity | None:
        """:meth:`resolve` by the key's stored form (:func:`hash_key`), cached alike.

        For a caller that holds the hash and not the key: the dashboard's
        session cookie carries the hash, so a stolen cookie is no API key.
        """
        if len(digest) != hashlib.sha256().digest_size:
            return None
        now = time.monotonic()
        cached = self._cache.get(digest)
        if cached is not None:
            if cached.expires > now:
                return cached.identity
            del self._cache[digest]
        unknown_until = self._unknown.get(digest)
        if unknown_until is not None:
            if unknown_until > now:
                return None
            del self._unknown[digest]
        lookup = self._inflight.get(digest)
        if lookup is None:
            lookup = asyncio.get_running_loop().create_future()
            self._inflight[digest] = lookup
            self._waiting[digest] = lookup
            if len(self._lookups) < self._max_lookups:
                self._start_lookups()
        # A cancelled caller does not cancel the lookup for the others.
        return await asyncio.shield(lookup)

    def _start_lookups(self) -> None:
        task = asyncio.get_running_loop().create_task(self._run_lookups())
        self._lookups.add(task)
        task.add_done_callback(self._lookups_ended)

    def _lookups_ended(self, task: asyncio.Task[None]) -> None:
        self._lookups.discard(task)
        # Keys that arrived while this one was ending found every slot taken;
        # a cancelled one was stopped by close(), which let them go.
        if self._waiting and not task.cancelled():
            self._start_lookups()

    async def _run_lookups(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            batch = dict(itertools.islice(self._waiting.items(), _LOOKUP_BATCH))
            for digest in batch:
                del self._waiting[digest]
            started = loop.time()
            try:
                await self._lookup(batch)
            except BaseException as exc:
                for digest, lookup in batch.items():
                    self._inflight.pop(digest, None)
                    if lookup.done():
                        continue
                    if isinstance(exc, Exception):
                        lookup.set_exception(exc)
                        # Its callers may all be gone; the failure was theirs
                        # to see, not the loop's.
                        lookup.exception()
                    else:
                        lookup.cancel()
                if not isinstance(exc, Exception):
                    raise
            # Holding the slot for the rest of the interval is what bounds the
            # statements a flood of keys can cause: keys that arrive meanwhile
            # wait and share the next one.
            rest = started + self._lookup_interval - loop.time()
            if rest > 0:
                await asyncio.sleep(rest)

    async def _lookup(self, batch: dict[bytes, asyncio.Future[Identity | None]]) -> None:
        generation = self._generation
        started = time.monotonic()
        async with self._auto.connect() as conn:
            rows = (await conn.execute(_RESOLVE, {"key_hashes": list(batch)})).all()
        found: dict[bytes, Identity] = {}
        for key_hash, tenant_id, key_id, scope, remaining in rows:
            digest = bytes(key_hash)
            identity: Identity = (
                WorkerIdentity(str(key_id))
                if scope == KeyScope.WORKER.value
                else KeyIdentity(uuid.UUID(str(tenant_id)), str(key_id))
            )
            found[digest] = identity
            if generation == self._generation:
                ttl = (
                    self._cache_seconds
                    if remaining is None
                    else min(self._cache_seconds, remaining)
                )
                if len(self._cache) >= _CACHE_ENTRIES:
                    self._cache.clear()
                self._cache[digest] = _Cached(identity, started + ttl)
        for digest, lookup in batch.items():
            self._inflight.pop(digest, None)
            identity_or_none = found.get(digest)
            if identity_or_none is None:
                self._remember_unknown(digest, started)
            if not lookup.done():
                lookup.set_result(identity_or_none)

    def _remember_unknown(self, digest: bytes, now: float) -> None:
        self._unknown[digest] = now + self._unknown_seconds
        self._unknown.move_to_end(digest)
        if len(self._unknown) > _UNKNOWN_ENTRIES:
            self._unknown.popitem(last=False)

    async def close(self) -> None:
        """Stop the lookups under way; the calls waiting for them are cancelled."""
        lookups = list(self._lookups)
        for task in lookups:
            task.cancel()
        await asyncio.gather(*lookups, return_exceptions=True)
        for lookup in self._inflight.values():
            lookup.cancel()
        self._inflight.clear()
        self._waiting.clear()

    def forget(self, key_id: str) -> None:
        """Drop ``key_id`` from the cache (it was revoked or rotated somewhere)."""
        self._generation += 1
        for digest in [d for d, c in self._cache.items() if c.identity.key_id == key_id]:
            del self._cache[digest]

    def clear_cache(self) -> None:
        """Drop every cached key (notifications may have been missed)."""
        self._generation += 1
        self._cache.clear()

    @property
    def cached(self) -> int:
        """Keys cached now."""
        return len(self._cache)

    @property
    def remembered_unknown(self) -> int:
        """Unknown keys remembered now."""
        return len(self._unknown)


def _info(row: RowMapping) -> KeyInfo:
    return KeyInfo(
        key_id=row["key_id"],
        tenant=row["tenant"] or "",
        tenant_id=None if row["tenant_id"] is None else uuid.UUID(str(row["tenant_id"])),
        prefix=row["prefix"],
        create_time=row["create_time"],
        revoke_time=row["revoke_time"],
        last_used_time=row["last_used_time"],
        active=bool(row["active"]),
        scope=KeyScope(row["scope"]),
    )
