"""The blob store: objects in S3 (aioboto3), their rows in Postgres.

A blob is named by its bytes: ``blobs/{sha256}``, per tenant, stored at
``{prefix}tenants/{tenant}/blobs/{sha256}``. Uploads stream: about one part
(8 MiB) is held at a time, whatever the blob's size; parts are at least a
part's size (S3 wants 5 MiB) except the last, so one part of chunks
gathered, joined, then sent.

Invariants (docs/adr/0020-blobs.md):

- A row exists only for a complete object: the object is completed first, the
  row inserted after, both under the blob's advisory lock. A crash between
  the two leaves an object without a row, which the next upload of the same
  bytes overwrites with the same bytes and gives its row (the retry heals).
- Deleting takes the same lock, deletes the row (only while no job references
  it, under the row's lock so a concurrent reference either waits or fails),
  then the object, then releases the lock: an upload of the same bytes
  meanwhile waits, and completes its object after the delete.
- The tenant is always the caller's (the authenticated key, or the job row):
  a name only ever reaches that tenant's own key.

The parts: :mod:`jobplane.blobs.s3` (the client's set-up, S3's failures),
:mod:`jobplane.blobs.uploads` (the streamed upload and its limits) and
:mod:`jobplane.blobs.names` (a blob's name); this module holds the rows and
what joins them to the objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import aioboto3
import structlog
from botocore.exceptions import ClientError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.blobs.names import blob_name, parse_blob_name, parse_digest
from jobplane.blobs.reader import BlobInfo, BlobReader
from jobplane.blobs.s3 import (
    S3_DOWN,
    S3Reader,
    client_config,
    ensure_bucket,
    s3_errors,
    unavailable,
)
from jobplane.blobs.uploads import Multipart, Parts, copy_object
from jobplane.errors import (
    BlobInUse,
    BlobNotFound,
    BlobsDisabled,
    BlobStoreUnavailable,
    BlobTooLarge,
    DigestMismatch,
)
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.logs import describe_error

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client

    from jobplane.config import Settings

__all__ = ["PART_BYTES", "S3_DOWN", "BlobStore", "unavailable"]

log = structlog.get_logger("jobplane.blobs")

#: Bytes of one multipart part (S3's least is 5 MiB, except the last).
PART_BYTES = 8 * 1024 * 1024


def _tenant(tenant_id: uuid.UUID | str) -> uuid.UUID:
    return tenant_id if isinstance(tenant_id, uuid.UUID) else uuid.UUID(str(tenant_id))


def _digest_of(name: str) -> str:
    try:
        return parse_blob_name(name)
    except ValueError as exc:
        raise BlobNotFound(str(exc), field="name") from None


_LOCK = text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))")
_SESSION_LOCK = text("SELECT pg_advisory_lock(hashtextextended(:key, 0))")
_SESSION_UNLOCK = text("SELECT pg_advisory_unlock(hashtextextended(:key, 0))")
_INSERT = text(
    """
    INSERT INTO blobs (tenant_id, digest, size, content_type)
    VALUES (:tenant_id, :digest, :size, :content_type)
    ON CONFLICT (tenant_id, digest) DO UPDATE SET touched_at = now()
    RETURNING digest, size, content_type, created_at
    """
)
_STAT = text(
    "SELECT digest, size, content_type, created_at FROM blobs "
    "WHERE tenant_id = :tenant_id AND digest = :digest"
)
_LOCK_ROW = text(
    "SELECT digest FROM blobs WHERE tenant_id = :tenant_id AND digest = :digest FOR UPDATE"
)
_REFERENCED = text(
    "SELECT EXISTS (SELECT 1 FROM job_blobs WHERE tenant_id = :tenant_id AND digest = :digest)"
)
_DELETE_ROW = text("DELETE FROM blobs WHERE tenant_id = :tenant_id AND digest = :digest")
_UNREFERENCED = text(
    """
    SELECT b.digest FROM blobs b
    WHERE b.tenant_id = :tenant_id AND b.touched_at < :cutoff
      AND NOT EXISTS (SELECT 1 FROM job_blobs r
                      WHERE r.tenant_id = b.tenant_id AND r.digest = b.digest)
    ORDER BY b.touched_at
    LIMIT :limit
    """
)
_LIST = text(
    """
    SELECT digest, size, content_type, created_at FROM blobs
    WHERE tenant_id = :tenant_id AND digest > :after
    ORDER BY digest
    LIMIT :limit
    """
)
_OWNED = text(
    "SELECT digest FROM blobs "
    "WHERE tenant_id = :tenant_id AND digest = ANY(CAST(:digests AS text[]))"
)
_REFERENCE = text(
    """
    INSERT INTO job_blobs (tenant_id, job_id, digest, role)
    SELECT :tenant_id, :job_id, :digest, :role
    WHERE EXISTS (SELECT 1 FROM jobs WHERE id = :job_id AND tenant_id = :tenant_id)
    ON CONFLICT DO NOTHING
    """
)


def _info(row: Any) -> BlobInfo:
    return BlobInfo(
        name=blob_name(row.digest),
        digest=row.digest,
        size=int(row.size),
        content_type=row.content_type,
        created_at=row.created_at,
    )


class BlobStore:
    """Blobs of every tenant: S3 objects and their rows (see the module docstring).

    One S3 client per store (one store per process), opened at first use and
    closed by :meth:`close`; the bucket is created when missing. ``engine``
    is the process's; a store made by :meth:`from_settings` without one owns
    the engine it makes.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        url: str,
        bucket: str = "jobplane",
        region: str = "us-east-1",
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        prefix: str = "",
        max_blob_bytes: int = 5 * 1024**3,
        part_bytes: int = PART_BYTES,
        owns_engine: bool = False,
        faults: FaultPoints = NO_FAULTS,
        lock_engine: AsyncEngine | None = None,
    ) -> None:
        if part_bytes < 5 * 1024 * 1024:
            raise ValueError("part_bytes must be at least 5 MiB (S3's least part)")
        self._engine = engine
        # A delete holds a session advisory lock across the S3 call: behind a
        # pooler in transaction mode that needs a connection of its own
        # (JOBPLANE_DATABASE_DIRECT_URL); everything else goes by ``engine``.
        self._lock_engine = lock_engine if lock_engine is not None else engine
        self._owns_engine = owns_engine
        self._faults = faults
        self.url = url
        self.bucket = bucket
        self._region = region
        self._access_key_id = access_key_id
        self._secret_access_key = secret_access_key
        self.prefix = prefix
        self.max_blob_bytes = max_blob_bytes
        self.part_bytes = part_bytes
        self._session = aioboto3.Session()
        self._stack = contextlib.AsyncExitStack()
        self._client: S3Client | None = None
        self._bucket_ready = False
        self._opening = asyncio.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, engine: AsyncEngine | None = None) -> BlobStore:
        """The store ``settings`` describe; :class:`BlobsDisabled` when JOBPLANE_S3_URL is unset."""
        if settings.s3_url is None:
            raise BlobsDisabled()
        owns = engine is None
        lock_engine: AsyncEngine | None = None
        if engine is None:
            from jobplane.store.engine import create_engine

            engine = create_engine(settings.database_url, pool_size=8)
            if settings.direct_url != settings.database_url:
                lock_engine = create_engine(settings.direct_url, pool_size=1)
        return cls(
            engine,
            url=settings.s3_url,
            bucket=settings.s3_bucket,
            region=settings.s3_region,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=settings.s3_secret_access_key,
            prefix=settings.s3_prefix,
            max_blob_bytes=settings.max_blob_bytes,
            owns_engine=owns,
            faults=FaultPoints(settings.faults),
            lock_engine=lock_engine,
        )

    async def __aenter__(self) -> BlobStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the S3 client (and the engine, when the store made it)."""
        self._client = None
        self._bucket_ready = False
        await self._stack.aclose()
        if self._owns_engine:
            await self._engine.dispose()
            if self._lock_engine is not self._engine:
                await self._lock_engine.dispose()

    # -- keys and the client ------------------------------------------------

    def key(self, tenant_id: uuid.UUID | str, digest: str) -> str:
        """The object key of a tenant's blob."""
        return f"{self.prefix}tenants/{_tenant(tenant_id)}/blobs/{digest}"

    def _staging_key(self, tenant_id: uuid.UUID) -> str:
        return f"{self.prefix}tenants/{tenant_id}/staging/{uuid.uuid4()}"

    async def _s3(self) -> S3Client:
        if self._client is not None and self._bucket_ready:
            return self._client
        async with self._opening:
            ready = self._client
            if ready is None:
                client = self._session.client(
                    "s3",
                    endpoint_url=self.url,
                    region_name=self._region,
                    aws_access_key_id=self._access_key_id,
                    aws_secret_access_key=self._secret_access_key,
                    config=client_config(),
                )
                opened: S3Client = await self._stack.enter_async_context(client)
                self._client = ready = opened
            if not self._bucket_ready:
                await ensure_bucket(ready, self.bucket, self._region, self.prefix)
                self._bucket_ready = True
            return ready

    @contextlib.asynccontextmanager
    async def _locked(self, tenant_id: uuid.UUID, digest: str) -> AsyncIterator[AsyncConnection]:
        """A transaction holding the blob's advisory lock."""
        async with self._engine.begin() as conn:
            await conn.execute(_LOCK, {"key": _lock_key(tenant_id, digest)})
            yield conn

    async def _insert(
        self, conn: AsyncConnection, tenant_id: uuid.UUID, digest: str, size: int, ctype: str
    ) -> BlobInfo:
        # The object is complete, its row not yet written: a crash here must heal.
        self._faults.hit("blobs.after_object")
        row = (
            await conn.execute(
                _INSERT,
                {"tenant_id": tenant_id, "digest": digest, "size": size, "content_type": ctype},
            )
        ).one()
        return _info(row)

    async def stat(self, tenant_id: uuid.UUID | str, name: str) -> BlobInfo:
        """The tenant's blob ``name``; :class:`BlobNotFound` when it has none (or another has)."""
        digest = _digest_of(name)
        async with self._engine.connect() as conn:
            row = (
                await conn.execute(_STAT, {"tenant_id": _tenant(tenant_id), "digest": digest})
            ).one_or_none()
        if row is None:
            raise BlobNotFound(f"no blob named {name}", field="name")
        return _info(row)

    async def owned(self, tenant_id: uuid.UUID | str, digests: Iterable[str]) -> set[str]:
        """Which of ``digests`` the tenant has blobs of."""
        wanted = sorted(set(digests))
        if not wanted:
            return set()
        async with self._engine.connect() as conn:
            rows = await conn.execute(_OWNED, {"tenant_id": _tenant(tenant_id), "digests": wanted})
            return {r.digest for r in rows}

    async def list_blobs(
        self, tenant_id: uuid.UUID | str, *, page_size: int = 100, after: str = ""
    ) -> tuple[list[BlobInfo], str]:
        """The tenant's blobs by digest after ``after``; the last digest when more may follow."""
        async with self._engine.connect() as conn:
            rows = (
                await conn.execute(
                    _LIST,
                    {"tenant_id": _tenant(tenant_id), "after": after, "limit": page_size + 1},
                )
            ).all()
        infos = [_info(r) for r in rows[:page_size]]
        more = len(rows) > page_size
        return infos, (infos[-1].digest if more and infos else "")

    async def reference(
        self, tenant_id: uuid.UUID | str, job_id: uuid.UUID, digest: str, role: str
    ) -> None:
        """Record that the job references the blob (``role``: payload, input, result, output)."""
        async with self._engine.begin() as conn:
            await conn.execute(
                _REFERENCE,
                {"tenant_id": _tenant(tenant_id), "job_id": job_id, "digest": digest, "role": role},
            )

    # -- writes -------------------------------------------------------------

    async def put_bytes(
        self, tenant_id: uuid.UUID | str, data: bytes, *, content_type: str | None = None
    ) -> BlobInfo:
        """Store ``data`` as the tenant's blob (the same bytes: the same blob)."""

        async def one() -> AsyncIterator[bytes]:
            yield data

        return await self.put_stream(
            tenant_id, one(), digest=hashlib.sha256(data).hexdigest(), content_type=content_type
        )

    async def put_stream(
        self,
        tenant_id: uuid.UUID | str,
        chunks: AsyncIterable[bytes],
        *,
        digest: str | None = None,
        content_type: str | None = None,
        size: int | None = None,
    ) -> BlobInfo:
        """Store the bytes of ``chunks`` as the tenant's blob, streaming.

        ``digest`` (the declared sha256) and ``size``, when given, are checked:
        a mismatch raises :class:`DigestMismatch` / :class:`BlobSizeMismatch`
        and stores nothing. More than ``max_blob_bytes`` raises
        :class:`BlobTooLarge`. Idempotent: the same bytes give the same blob,
        stored once.
        """
        tenant = _tenant(tenant_id)
        ctype = content_type or ""
        if digest is not None:
            try:
                digest = parse_digest(digest)
            except ValueError as exc:
                raise DigestMismatch(str(exc), field="sha256") from None
        if size is not None and size > self.max_blob_bytes:
            raise BlobTooLarge(f"the blob is larger than {self.max_blob_bytes} bytes", field="size")
        # S3 takes at most 10,000 parts: a larger blob needs larger parts.
        part_bytes = max(self.part_bytes, -(-(size or self.max_blob_bytes) // 10_000))
        s3 = await self._s3()
        upload = Multipart(s3, self.bucket, self.key(tenant, digest) if digest else None)
        parts = Parts(max_bytes=self.max_blob_bytes, size=size, part_bytes=part_bytes)
        try:
            async for chunk in chunks:
                part = parts.add(chunk)
                if part is not None:
                    if upload.key is None:
                        upload.key = self._staging_key(tenant)
                    await upload.part(part, ctype)
                    del part  # not held while the next chunk comes
            return await self._complete(s3, upload, parts, tenant, parts.digest(digest), ctype)
        finally:
            await upload.discard()

    async def _complete(
        self,
        s3: S3Client,
        upload: Multipart,
        parts: Parts,
        tenant: uuid.UUID,
        digest: str,
        ctype: str,
    ) -> BlobInfo:
        """Every chunk came: the object under the blob's name, then its row."""
        final = self.key(tenant, digest)
        if not upload.started:
            # Small: one PUT of what is held (less than a part).
            async with self._locked(tenant, digest) as conn:
                async with s3_errors():
                    await s3.put_object(
                        Bucket=self.bucket, Key=final, Body=parts.rest(), ContentType=ctype
                    )
                return await self._insert(conn, tenant, digest, parts.total, ctype)
        if parts.holding:
            await upload.part(parts.rest(), ctype)
        if upload.key == final:
            async with self._locked(tenant, digest) as conn:
                await upload.complete()
                return await self._insert(conn, tenant, digest, parts.total, ctype)
        # Streamed without a declared digest: complete under a staging
        # key, then copy to the name the bytes turned out to have.
        await upload.complete()
        async with self._locked(tenant, digest) as conn:
            await copy_object(s3, self.bucket, upload.key or "", final, parts.total, ctype)
            return await self._insert(conn, tenant, digest, parts.total, ctype)

    @contextlib.asynccontextmanager
    async def open(self, tenant_id: uuid.UUID | str, name: str) -> AsyncIterator[BlobReader]:
        """``async with store.open(tenant, name) as reader``: the blob's bytes, streamed.

        :class:`BlobNotFound` when the tenant has no such blob;
        :class:`BlobStoreUnavailable` when S3 cannot be reached.
        """
        info = await self.stat(tenant_id, name)
        s3 = await self._s3()
        try:
            async with s3_errors():
                got = await s3.get_object(Bucket=self.bucket, Key=self.key(tenant_id, info.digest))
        except ClientError as exc:
            # Deleted since the row was read (the row goes first): not found.
            # A row still there means the store lost an object it had: an
            # outage of the store (e.g. a server restored or not yet caught
            # up), retried, not an unknown name.
            await self.stat(tenant_id, name)
            log.warning("blobs.object.missing", blob=name, error=describe_error(exc))
            raise BlobStoreUnavailable(
                f"the object store has no object for {name}, which exists"
            ) from None
        body = got["Body"]
        try:
            yield S3Reader(info, body)
        finally:
            body.close()

    async def read_bytes(
        self, tenant_id: uuid.UUID | str, name: str, *, limit: int | None = None
    ) -> bytes:
        """The whole blob; :class:`BlobTooLarge` when it is larger than ``limit`` bytes."""
        async with self.open(tenant_id, name) as reader:
            size = reader.info.size
            if limit is not None and size > limit:  # known before a byte is read
                raise BlobTooLarge(f"{name} has {size} bytes, more than {limit}")
            return await reader.read()

    # -- deletes ------------------------------------------------------------

    async def delete(self, tenant_id: uuid.UUID | str, name: str) -> None:
        """Delete the tenant's blob: :class:`BlobInUse` while a job references it."""
        digest = _digest_of(name)
        outcome = await self._delete_one(_tenant(tenant_id), digest)
        if outcome == "missing":
            raise BlobNotFound(f"no blob named {name}", field="name")
        if outcome == "referenced":
            raise BlobInUse(f"a job references {name}", field="name")

    async def delete_unreferenced(
        self, tenant_id: uuid.UUID | str, older_than: datetime, *, batch: int = 500
    ) -> int:
        """Delete the tenant's blobs no job references, last uploaded before ``older_than``.

        Rows and objects; safe against a concurrent upload or reference of the
        same bytes (the blob's lock, then its row's). Returns how many went.
        """
        tenant = _tenant(tenant_id)
        deleted = 0
        while True:
            async with self._engine.connect() as conn:
                digests = [
                    r.digest
                    for r in await conn.execute(
                        _UNREFERENCED, {"tenant_id": tenant, "cutoff": older_than, "limit": batch}
                    )
                ]
            gone = 0
            for digest in digests:
                if await self._delete_one(tenant, digest, older_than=older_than) == "deleted":
                    gone += 1
            deleted += gone
            if len(digests) < batch or gone == 0:
                return deleted

    async def delete_tenant(self, tenant_id: uuid.UUID | str) -> int:
        """Delete every blob of the tenant, referenced or not (rows, then objects).

        For erasure: the tenant's jobs are going too. Returns the rows deleted;
        objects under the tenant's prefix without a row (staging leftovers)
        go as well.
        """
        tenant = _tenant(tenant_id)
        async with self._engine.begin() as conn:
            await conn.execute(text("DELETE FROM job_blobs WHERE tenant_id = :t"), {"t": tenant})
            rows = await conn.execute(
                text("DELETE FROM blobs WHERE tenant_id = :t RETURNING digest"), {"t": tenant}
            )
            count = len(rows.all())
        s3 = await self._s3()
        keys = [k async for k in self._list_keys(s3, f"{self.prefix}tenants/{tenant}/")]
        await self._delete_keys(s3, keys)
        return count

    async def _delete_one(
        self, tenant: uuid.UUID, digest: str, *, older_than: datetime | None = None
    ) -> str:
        """``deleted``, ``missing`` or ``referenced`` (or, with ``older_than``, ``touched``)."""
        key = _lock_key(tenant, digest)
        params = {"tenant_id": tenant, "digest": digest}
        async with self._lock_engine.connect() as conn:
            # A session lock: held past the row's commit, until the object is gone.
            await conn.execute(_SESSION_LOCK, {"key": key})
            await conn.commit()
            try:
                async with conn.begin():
                    locked = (await conn.execute(_LOCK_ROW, params)).one_or_none()
                    if locked is None:
                        return "missing"
                    # After the row lock: a reference committed meanwhile is seen.
                    if (await conn.execute(_REFERENCED, params)).scalar():
                        return "referenced"
                    if older_than is not None:
                        touched = (
                            await conn.execute(
                                text(
                                    "SELECT touched_at < :cutoff FROM blobs "
                                    "WHERE tenant_id = :tenant_id AND digest = :digest"
                                ),
                                {**params, "cutoff": older_than},
                            )
                        ).scalar()
                        if not touched:
                            return "touched"
                    await conn.execute(_DELETE_ROW, params)
                s3 = await self._s3()
                try:
                    async with s3_errors():
                        await s3.delete_object(Bucket=self.bucket, Key=self.key(tenant, digest))
                except Exception as exc:
                    # The row is gone: the object is an orphan, never served
                    # (reads go by row), overwritten by a new upload.
                    log.warning("blobs.object.orphaned", digest=digest, error=describe_error(exc))
                return "deleted"
            finally:
                with contextlib.suppress(Exception):
                    await conn.execute(_SESSION_UNLOCK, {"key": key})
                    await conn.commit()

    # -- S3 side only -------------------------------------------------------

    async def list_digests(self, tenant_id: uuid.UUID | str) -> list[str]:
        """The digests of the tenant's objects in S3 (rows or not)."""
        s3 = await self._s3()
        prefix = f"{self.prefix}tenants/{_tenant(tenant_id)}/blobs/"
        return [key[len(prefix) :] async for key in self._list_keys(s3, prefix)]

    async def delete_objects(self, tenant_id: uuid.UUID | str, digests: Sequence[str]) -> None:
        """Delete the tenant's objects of ``digests`` (S3 only; their rows are the caller's)."""
        s3 = await self._s3()
        await self._delete_keys(s3, [self.key(tenant_id, d) for d in digests])

    async def _list_keys(self, s3: S3Client, prefix: str) -> AsyncIterator[str]:
        async with s3_errors():
            paginator = s3.get_paginator("list_objects_v2")
            async for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    yield item["Key"]

    async def _delete_keys(self, s3: S3Client, keys: Sequence[str]) -> None:
        async with s3_errors():
            for start in range(0, len(keys), 1000):
                batch = [{"Key": k} for k in keys[start : start + 1000]]
                await s3.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": batch, "Quiet": True},  # type: ignore[typeddict-item]
                )


def _lock_key(tenant_id: uuid.UUID, digest: str) -> str:
    return f"blob:{tenant_id}:{digest}"
