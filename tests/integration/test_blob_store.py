"""The blob store on a real S3 server (moto) and Postgres: rows and objects together."""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import (
    BlobInUse,
    BlobNotFound,
    BlobSizeMismatch,
    BlobStore,
    BlobTooLarge,
    DigestMismatch,
    parse_blob_name,
)
from jobplane.faults import FaultPoints, InjectedFault
from tests.support.s3 import MotoServer, blob_store

MiB = 1024 * 1024


async def _tenant(engine: AsyncEngine, name: str) -> uuid.UUID:
    async with engine.begin() as conn:
        return uuid.UUID(
            str(
                (
                    await conn.execute(
                        text(
                            "INSERT INTO tenants (id, name) VALUES (gen_random_uuid(), :n) "
                            "RETURNING id"
                        ),
                        {"n": name},
                    )
                ).scalar()
            )
        )


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def _rows(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM blobs"))).scalar() or 0)


async def _uploads(store: BlobStore) -> int:
    s3 = await store._s3()
    listed = await s3.list_multipart_uploads(Bucket=store.bucket)
    return len(listed.get("Uploads", []))


@pytest.mark.parametrize("size", [0, 1, 5 * MiB + 3])
async def test_round_trip(engine: AsyncEngine, blobs: BlobStore, size: int) -> None:
    tenant = await _tenant(engine, "acme")
    data = os.urandom(size)
    info = await blobs.put_stream(tenant, _chunks(data, 64 * 1024), content_type="x/y")
    assert info.name == f"blobs/{hashlib.sha256(data).hexdigest()}"
    assert (info.size, info.content_type) == (size, "x/y")
    assert await blobs.read_bytes(tenant, info.name) == data
    async with blobs.open(tenant, info.name) as reader:
        assert reader.info == info
        got = b"".join([c async for c in reader.iter_chunks(1000)])
    assert got == data
    # A staged upload (no declared digest) leaves no staging object behind.
    s3 = await blobs._s3()
    keys = [o["Key"] for o in (await s3.list_objects_v2(Bucket=blobs.bucket)).get("Contents", [])]
    assert keys == [blobs.key(tenant, info.digest)]


async def test_multipart_with_declared_digest(engine: AsyncEngine, moto: MotoServer) -> None:
    tenant = await _tenant(engine, "acme")
    data = os.urandom(11 * MiB)
    digest = hashlib.sha256(data).hexdigest()
    async with blob_store(engine, moto.url, part_bytes=5 * MiB) as store:
        info = await store.put_stream(tenant, _chunks(data, MiB), digest=digest, size=len(data))
        assert (info.digest, info.size) == (digest, len(data))
        assert await store.read_bytes(tenant, info.name) == data
        assert await _uploads(store) == 0


async def test_same_bytes_are_stored_once(engine: AsyncEngine, blobs: BlobStore) -> None:
    tenant = await _tenant(engine, "acme")
    first = await blobs.put_bytes(tenant, b"hello")
    again = await blobs.put_stream(tenant, _chunks(b"hello", 2))
    assert first.name == again.name
    assert await _rows(engine) == 1
    assert await blobs.list_digests(tenant) == [first.digest]


async def test_a_wrong_digest_or_size_stores_nothing(engine: AsyncEngine, moto: MotoServer) -> None:
    tenant = await _tenant(engine, "acme")
    data = os.urandom(6 * MiB)
    async with blob_store(engine, moto.url, part_bytes=5 * MiB) as store:
        with pytest.raises(DigestMismatch) as caught:
            await store.put_stream(tenant, _chunks(data, MiB), digest="0" * 64)
        assert caught.value.field == "sha256"
        with pytest.raises(BlobSizeMismatch):
            await store.put_stream(tenant, _chunks(data, MiB), size=len(data) - 1)
        with pytest.raises(BlobSizeMismatch):
            await store.put_stream(tenant, _chunks(data, MiB), size=len(data) + 1)
        assert await _rows(engine) == 0
        assert await store.list_digests(tenant) == []
        assert await _uploads(store) == 0


async def test_too_large(engine: AsyncEngine, moto: MotoServer) -> None:
    tenant = await _tenant(engine, "acme")
    async with blob_store(engine, moto.url, max_blob_bytes=10) as store:
        with pytest.raises(BlobTooLarge):
            await store.put_bytes(tenant, b"x" * 11)
        assert (await store.put_bytes(tenant, b"x" * 10)).size == 10
        assert await _rows(engine) == 1


async def test_another_tenant_sees_nothing(engine: AsyncEngine, blobs: BlobStore) -> None:
    acme, other = await _tenant(engine, "acme"), await _tenant(engine, "other")
    info = await blobs.put_bytes(acme, b"secret")
    with pytest.raises(BlobNotFound):
        await blobs.stat(other, info.name)
    with pytest.raises(BlobNotFound):
        await blobs.read_bytes(other, info.name)
    with pytest.raises(BlobNotFound):
        await blobs.delete(other, info.name)
    assert await blobs.list_blobs(other) == ([], "")
    assert await blobs.stat(acme, info.name) == info
    with pytest.raises(BlobNotFound):
        await blobs.stat(acme, "blobs/nothex")


async def test_lifecycle(engine: AsyncEngine, blobs: BlobStore) -> None:
    tenant = await _tenant(engine, "acme")
    kept = await blobs.put_bytes(tenant, b"kept")
    old = await blobs.put_bytes(tenant, b"old")
    async with engine.begin() as conn:
        job = uuid.uuid4()
        await conn.execute(
            text(
                "INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts, "
                "request_id, request_hash) VALUES (:id, :t, 'x', 'q', 'succeeded', "
                "CAST(:p AS jsonb), 1, 'r', '\\x00')"
            ),
            {"id": job, "t": tenant, "p": f'{{"in": ["{kept.name}"]}}'},
        )
    # The trigger recorded the payload's reference.
    with pytest.raises(BlobInUse):
        await blobs.delete(tenant, kept.name)
    future = datetime.now(UTC) + timedelta(minutes=1)
    assert await blobs.delete_unreferenced(tenant, datetime.now(UTC) - timedelta(hours=1)) == 0
    assert await blobs.delete_unreferenced(tenant, future) == 1
    assert await blobs.list_digests(tenant) == [kept.digest]
    with pytest.raises(BlobNotFound):
        await blobs.stat(tenant, old.name)
    # Deleting the job frees its blobs.
    async with engine.begin() as conn:
        await conn.execute(text("DELETE FROM jobs WHERE id = :id"), {"id": job})
    await blobs.delete(tenant, kept.name)
    assert await _rows(engine) == 0 and await blobs.list_digests(tenant) == []
    await blobs.put_bytes(tenant, b"a")
    await blobs.put_bytes(tenant, b"b")
    assert await blobs.delete_tenant(tenant) == 2
    assert await blobs.list_digests(tenant) == []
    assert parse_blob_name(kept.name) == kept.digest


async def test_concurrent_uploads_of_the_same_bytes(engine: AsyncEngine, moto: MotoServer) -> None:
    tenant = await _tenant(engine, "acme")
    data = os.urandom(6 * MiB)
    async with blob_store(engine, moto.url, part_bytes=5 * MiB) as store:
        infos = await asyncio.gather(
            store.put_stream(tenant, _chunks(data, MiB)),
            store.put_stream(tenant, _chunks(data, MiB), digest=hashlib.sha256(data).hexdigest()),
            store.put_bytes(tenant, data),
        )
        assert len({i.name for i in infos}) == 1
        assert await _rows(engine) == 1
        assert await store.list_digests(tenant) == [infos[0].digest]
        assert await _uploads(store) == 0
        assert await store.read_bytes(tenant, infos[0].name) == data


async def test_a_crash_between_the_object_and_its_row_heals(
    engine: AsyncEngine, moto: MotoServer, blobs: BlobStore
) -> None:
    tenant = await _tenant(engine, "acme")
    broken = blob_store(
        engine, moto.url, bucket=blobs.bucket, faults=FaultPoints(["blobs.after_object"])
    )
    async with broken:
        with pytest.raises(InjectedFault):
            await broken.put_bytes(tenant, b"half written")
    # The object is there, its row is not: nobody can read it.
    digest = hashlib.sha256(b"half written").hexdigest()
    assert await blobs.list_digests(tenant) == [digest]
    with pytest.raises(BlobNotFound):
        await blobs.stat(tenant, f"blobs/{digest}")
    # The retry writes the same object again and its row.
    info = await blobs.put_bytes(tenant, b"half written")
    assert await blobs.read_bytes(tenant, info.name) == b"half written"
    assert await _rows(engine) == 1


async def test_collection_against_a_concurrent_reference(
    engine: AsyncEngine, blobs: BlobStore
) -> None:
    tenant = await _tenant(engine, "acme")
    info = await blobs.put_bytes(tenant, b"wanted")
    future = datetime.now(UTC) + timedelta(minutes=1)
    job = uuid.uuid4()
    # A job referencing the blob, its transaction still open while collection runs.
    async with engine.connect() as conn:
        await conn.execute(
            text(
                "INSERT INTO jobs (id, tenant_id, type, queue, state, payload, max_attempts, "
                "request_id, request_hash) VALUES (:id, :t, 'x', 'q', 'queued', "
                "CAST(:p AS jsonb), 1, 'r', '\\x00')"
            ),
            {"id": job, "t": tenant, "p": f'{{"in": "{info.name}"}}'},
        )
        collecting = asyncio.create_task(blobs.delete_unreferenced(tenant, future))
        await asyncio.sleep(0.3)
        assert not collecting.done()  # waits for the referencing transaction
        await conn.commit()
    assert await collecting == 0
    assert await blobs.read_bytes(tenant, info.name) == b"wanted"


async def test_a_bucket_the_store_makes_expires_abandoned_uploads(
    engine: AsyncEngine, moto: MotoServer
) -> None:
    """A server killed mid-upload cannot abort it: the bucket's lifecycle rule does."""
    store = blob_store(engine, moto.url, prefix="jp/")
    try:
        tenant = await _tenant(engine, "acme")
        await store.put_bytes(tenant, b"first use makes the bucket")
        s3 = await store._s3()
        rules = (await s3.get_bucket_lifecycle_configuration(Bucket=store.bucket))["Rules"]
        assert [(r["Status"], r["Filter"], r["AbortIncompleteMultipartUpload"]) for r in rules] == [
            ("Enabled", {"Prefix": "jp/"}, {"DaysAfterInitiation": 1})
        ]
    finally:
        await store.close()


async def test_read_bytes_refuses_a_blob_over_its_limit(
    engine: AsyncEngine, blobs: BlobStore
) -> None:
    tenant = await _tenant(engine, "acme")
    info = await blobs.put_bytes(tenant, b"x" * 100)
    assert await blobs.read_bytes(tenant, info.name, limit=100) == b"x" * 100
    with pytest.raises(BlobTooLarge, match="100 bytes, more than 99"):
        await blobs.read_bytes(tenant, info.name, limit=99)
