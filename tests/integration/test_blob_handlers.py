"""Handlers and blobs through a real worker: ctx.open_blob, read_blob, put_blob, tenant walls."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobStore
from jobplane.topology import Topology
from jobplane.types import JobState
from jobplane.workers.handlers import JobContext, Registry
from tests.support.stack import Stack, start_stack

registry = Registry()


@registry.handler("blobs.digest")
async def digest(ctx: JobContext) -> dict[str, Any]:
    hasher = hashlib.sha256()
    name = f"blobs/{ctx.payload['digest']}"
    async with ctx.open_blob(name) as reader:
        async for chunk in reader.iter_chunks(4096):
            hasher.update(chunk)
        size = reader.info.size
    whole = await ctx.read_blob(name)
    out = await ctx.put_blob(whole[::-1], content_type="application/octet-stream")
    return {"sha256": hasher.hexdigest(), "size": size, "reversed": out, "tenant": ctx.tenant_id}


@pytest.fixture
async def blob_stack(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    blobs: BlobStore,
) -> Any:
    running = await start_stack(
        engine, database_url, amqp_url, topology, registry=registry, blobs=blobs
    )
    yield running
    await running.close()


async def test_a_handler_reads_and_writes_its_tenants_blobs(blob_stack: Stack) -> None:
    store = blob_stack.blobs
    assert store is not None
    data = b"0123456789" * 1000
    info = await store.put_bytes(blob_stack.tenant_id, data)
    client = blob_stack.client()
    job = await client.submit("blobs.digest", {"digest": info.digest})
    done = await client.wait(job.name, timeout=20)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result is not None
    assert done.result["sha256"] == info.digest and done.result["size"] == len(data)
    assert done.result["tenant"] == str(blob_stack.tenant_id)
    out = str(done.result["reversed"])
    assert await store.read_bytes(blob_stack.tenant_id, out) == data[::-1]
    roles = await blob_stack.scalar(
        "SELECT string_agg(role, ',' ORDER BY role) FROM job_blobs WHERE job_id = :id",
        id=done.id,
    )
    assert roles == "output"


async def test_a_foreign_blob_fails_the_job(blob_stack: Stack) -> None:
    store = blob_stack.blobs
    assert store is not None
    _key, other = await blob_stack.server.keys.create_key("other")
    theirs = await store.put_bytes(other, b"not yours")
    client = blob_stack.client()
    job = await client.submit("blobs.digest", {"digest": theirs.digest}, max_attempts=3)
    done = await client.wait(job.name, timeout=20)
    assert done.state is JobState.FAILED
    assert done.error is not None and done.error.code == "BLOB_NOT_FOUND"
    assert done.attempt == 1  # permanent: not retried
