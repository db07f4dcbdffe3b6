"""Large payloads and results go by reference, end to end through a real worker;
an object store outage while a handler reads is retried, and the job completes."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobInUse, BlobStore
from jobplane.client import BlobNotFound
from jobplane.convert import struct_from_dict
from jobplane.store.engine import create_engine
from jobplane.topology import Topology
from jobplane.types import JobState
from jobplane.v1 import workers_pb2, workers_pb2_grpc
from jobplane.workers.handlers import JobContext, Registry
from tests.integration import test_database_role
from tests.integration.test_worker_service_pipelines import _next_message
from tests.support.parts import Started
from tests.support.s3 import MotoServer, blob_store
from tests.support.stack import Stack, eventually, start_stack

registry = Registry()
# The test database as a role with DML rights only (docs/security.md).
dml_url = test_database_role.dml_url


@registry.handler("offload.echo")
async def echo(ctx: JobContext) -> dict[str, Any]:
    text = ctx.payload["text"]
    return {"length": len(text), "echo": text * 2}


# The first attempt of offload.read stops after its first chunk until the
# test has stopped S3.
first_chunk_read = asyncio.Event()
s3_stopped = asyncio.Event()


@registry.handler("offload.read")
async def read(ctx: JobContext) -> dict[str, Any]:
    hasher = hashlib.sha256()
    async with ctx.open_blob(ctx.payload["blob"]) as reader:
        hasher.update(await reader.read(64 * 1024))
        if ctx.attempt == 1:
            first_chunk_read.set()
            await s3_stopped.wait()
        async for chunk in reader.iter_chunks(64 * 1024):
            hasher.update(chunk)
    return {"sha256": hasher.hexdigest()}


@pytest.fixture
async def offload_stack(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, blobs: BlobStore
) -> AsyncIterator[Stack]:
    running = await start_stack(
        engine, database_url, amqp_url, topology, registry=registry, blobs=blobs
    )
    yield running
    await running.close()


async def test_a_large_payload_and_result_go_by_reference(offload_stack: Stack) -> None:
    client = offload_stack.client()
    text = "jobplane " * 20_000  # 180 KB: over the 64 KiB inline limit
    submitted = await client.submit("offload.echo", {"text": text})
    assert submitted.payload_blob is not None
    done = await client.wait(submitted.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    # The SDK reads both back whole.
    assert done.payload == {"text": text}
    assert done.result == {"length": len(text), "echo": text * 2}
    assert done.result_blob is not None and done.result_blob.size > 2 * len(text)
    # Only the references are in the row and its messages.
    bare = await client.get(done.name, resolve_blobs=False)
    assert (bare.payload, bare.result) == ({}, {})
    assert bare.payload_blob == done.payload_blob and bare.result_blob == done.result_blob
    sizes = await offload_stack.scalar(
        "SELECT octet_length(payload::text) + octet_length(result::text) FROM jobs WHERE id = :id",
        id=done.id,
    )
    assert sizes <= 4
    largest = await offload_stack.scalar(
        "SELECT max(octet_length(CAST(o AS text))) FROM outbox o WHERE o.job_id = :id", id=done.id
    )
    assert largest < 4096
    roles = await offload_stack.scalar(
        "SELECT string_agg(role, ',' ORDER BY role) FROM job_blobs WHERE job_id = :id", id=done.id
    )
    assert roles == "payload,result"
    # The same payload again is the same blob: stored once.
    again = await client.submit("offload.echo", {"text": text})
    assert again.payload_blob == submitted.payload_blob
    # A small payload stays inline.
    small = await client.submit("offload.echo", {"text": "x"})
    assert small.payload_blob is None and small.payload == {"text": "x"}
    await client.wait(again.name, timeout=30)


async def test_submit_many_offloads_and_records_each_jobs_references(
    offload_stack: Stack,
) -> None:
    client = offload_stack.client()
    named = await client.upload(b"input bytes")
    large = "jobplane " * 20_000
    # One inline payload naming a blob, one offloaded payload naming it
    # (its name travels as a blob_reference), one plain.
    jobs = await client.submit_many(
        [
            {"type": "offload.echo", "payload": {"text": "x", "blob": named.name}},
            {"type": "offload.echo", "payload": {"text": large, "blob": named.name}},
            {"type": "offload.echo", "payload": {"text": "y"}},
        ]
    )
    assert [j.payload_blob is not None for j in jobs] == [False, True, False]
    roles = [
        await offload_stack.scalar(
            "SELECT string_agg(role, ',' ORDER BY role) FROM job_blobs "
            "WHERE job_id = :id AND digest = :d",
            id=job.id,
            d=named.sha256,
        )
        for job in jobs
    ]
    # The named blob is an input of both (the trigger's, and the hook's from
    # blob_references), and the offloaded payload the second's payload.
    assert roles == ["input", "input", None]
    offloaded = jobs[1].payload_blob
    assert offloaded is not None
    payload_role = await offload_stack.scalar(
        "SELECT role FROM job_blobs WHERE job_id = :id AND digest = :d",
        id=jobs[1].id,
        d=offloaded.sha256,
    )
    assert payload_role == "payload"
    done = [await client.wait(job.name, timeout=30) for job in jobs]
    assert [j.state for j in done] == [JobState.SUCCEEDED] * 3
    # A blob the tenant does not have refuses the whole batch at its index
    # (counted once the jobs above wrote all they will).
    missing = "blobs/" + "0" * 64
    before = await offload_stack.counts()
    with pytest.raises(BlobNotFound) as info:
        await client.submit_many(
            [{"type": "offload.echo", "payload": {"text": "z"}}] * 2
            + [{"type": "offload.echo", "payload": {"blob": missing}}]
        )
    assert info.value.field == "requests[2].payload"
    assert await offload_stack.counts() == before


async def test_a_job_referencing_blobs_on_a_worker_without_them_fails_clearly(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    blobs: BlobStore,
    started: Started,
) -> None:
    stack = await started(
        start_stack(
            engine, database_url, amqp_url, topology, registry=registry, worker=False, blobs=blobs
        )
    )
    await stack.start_worker(registry, blobs=None)
    client = stack.client()
    submitted = await client.submit("offload.echo", {"text": "y" * 100_000})
    done = await client.wait(submitted.name, timeout=30)
    assert done.state is JobState.FAILED
    assert done.error is not None and done.error.code == "BLOBS_DISABLED"


async def test_an_outage_while_a_handler_reads_is_retried(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    s3 = MotoServer()
    s3.start()
    store = blob_store(engine, s3.url)
    stack = await start_stack(
        engine, database_url, amqp_url, topology, registry=registry, blobs=store
    )
    try:
        # Larger than what the sockets between moto and the worker buffer.
        data = os.urandom(16 * 1024 * 1024)
        info = await store.put_bytes(stack.tenant_id, data)
        client = stack.client()
        job = await client.submit("offload.read", {"blob": info.name}, max_attempts=50)
        await asyncio.wait_for(first_chunk_read.wait(), timeout=30)
        s3.stop()
        s3_stopped.set()

        async def retried() -> bool:
            code = await stack.scalar("SELECT error_code FROM jobs WHERE id = :id", id=job.id)
            return bool(code == "BLOB_STORE_UNAVAILABLE")

        await eventually(retried, timeout=30)
        # Back on the same port; moto keeps nothing across a restart, so the
        # bytes are uploaded again (the same name: content addressed).
        s3.start()
        async with blob_store(engine, s3.url, bucket=store.bucket) as again:
            assert (await again.put_bytes(stack.tenant_id, data)).name == info.name
        done = await client.wait(job.name, timeout=60)
        assert done.state is JobState.SUCCEEDED, done.error
        assert done.result == {"sha256": info.digest}
        assert done.attempt >= 2
    finally:
        await stack.close()
        await store.close()
        s3.stop()


async def test_worker_service_hands_out_offloaded_payloads_and_offloads_results(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    blobs: BlobStore,
    started: Started,
) -> None:
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, worker=False, blobs=blobs)
    )
    key = (await stack.server.keys.create_worker()).key
    metadata = (("authorization", f"Bearer {key}"),)
    client = stack.client()
    text = "w" * 100_000
    job = await client.submit("offload.echo", {"text": text})
    assert job.payload_blob is not None
    body = await _next_message(stack.amqp_url, stack.topology.queues[0].name)
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        stub: workers_pb2_grpc.WorkerServiceAsyncStub = workers_pb2_grpc.WorkerServiceStub(channel)
        claim = await stub.ClaimJob(
            workers_pb2.ClaimJobRequest(message_body=body), metadata=metadata
        )
        assert claim.status == workers_pb2.ClaimJobResponse.STATUS_CLAIMED
        assert json_format.MessageToDict(claim.payload) == {"text": text}
        await stub.CompleteJob(
            workers_pb2.CompleteJobRequest(
                attempt=claim.attempt, result=struct_from_dict({"echo": text})
            ),
            metadata=metadata,
        )
    done = await client.get(job.name)
    assert done.state is JobState.SUCCEEDED and done.result == {"echo": text}
    assert done.result_blob is not None
    assert (await client.get(job.name, resolve_blobs=False)).result == {}


async def test_blobs_with_a_dml_only_role(
    dml_url: str, amqp_url: str, topology: Topology, moto: MotoServer, started: Started
) -> None:
    engine = create_engine(dml_url, pool_size=4)
    started.callback(engine.dispose)
    store = await started(blob_store(engine, moto.url))
    stack = await started(
        start_stack(engine, dml_url, amqp_url, topology, registry=registry, blobs=store)
    )
    client = stack.client()
    blob = await client.upload(b"x" * 1000)
    # A reference (the trigger's insert), an offloaded payload and result.
    job = await client.submit("offload.echo", {"text": "z" * 70_000, "in": blob.name})
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result_blob is not None
    with pytest.raises(BlobInUse):
        await client.delete_blob(blob.name)
