"""BlobService end to end: SDK and raw calls against a server with a real S3 (moto)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobStore
from jobplane.client import (
    BlobInUse,
    BlobNotFound,
    BlobsDisabled,
    Client,
    FailedPrecondition,
    InvalidArgument,
)
from jobplane.client._errors import error_from_rpc
from jobplane.topology import Topology
from jobplane.v1 import blobs_pb2, blobs_pb2_grpc, jobs_pb2
from tests.integration.test_cli_and_sync import jobplane
from tests.support.parts import Started
from tests.support.s3 import MotoServer, blob_store
from tests.support.stack import Stack, start_stack

MiB = 1024 * 1024


@pytest.fixture
async def blob_stack(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, blobs: BlobStore
) -> AsyncIterator[Stack]:
    running = await start_stack(
        engine, database_url, amqp_url, topology, relay=False, worker=False, blobs=blobs
    )
    yield running
    await running.close()


async def _count(stack: Stack, table: str) -> int:
    return int(await stack.scalar(f"SELECT count(*) FROM {table}"))


async def _objects(store: BlobStore) -> list[str]:
    s3 = await store._s3()
    listed = await s3.list_objects_v2(Bucket=store.bucket)
    return [o["Key"] for o in listed.get("Contents", [])]


async def _upload_raw(
    stack: Stack, key: str, header: blobs_pb2.UploadBlobHeader, chunks: list[bytes]
) -> blobs_pb2.Blob:
    """One UploadBlob call as a foreign client makes it."""

    async def requests() -> AsyncIterator[blobs_pb2.UploadBlobRequest]:
        yield blobs_pb2.UploadBlobRequest(header=header)
        for chunk in chunks:
            yield blobs_pb2.UploadBlobRequest(chunk=chunk)

    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        stub = blobs_pb2_grpc.BlobServiceStub(channel)
        reply: blobs_pb2.Blob = await stub.UploadBlob(
            requests(), metadata=(("authorization", f"Bearer {key}"),)
        )
        return reply


def _reason(exc: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """The code, and the field and SDK error class the rich status maps to."""
    error = error_from_rpc(exc)
    return exc.code(), f"{error.field}:{type(error).__name__}"


async def test_tiny_round_trips(blob_stack: Stack, tmp_path: Path) -> None:
    client = blob_stack.client()
    for size in (0, 1):
        data = os.urandom(size)
        blob = await client.upload(data, content_type="text/plain")
        assert blob.name == f"blobs/{hashlib.sha256(data).hexdigest()}"
        assert (blob.size, blob.content_type) == (size, "text/plain")
        out = io.BytesIO()
        assert (await client.download(blob.name, out)).sha256 == blob.sha256
        assert out.getvalue() == data
        target = tmp_path / f"out{size}.bin"
        await client.download(blob.name, target)
        assert target.read_bytes() == data
        assert (await client.get_blob(blob.name)).size == size
    assert len((await client.list_blobs()).blobs) == 2


async def test_identical_uploads_are_one_blob(blob_stack: Stack, tmp_path: Path) -> None:
    client = blob_stack.client()
    data = os.urandom(6 * MiB + 5)  # more than a part: multipart, then staged
    path = tmp_path / "in.bin"
    path.write_bytes(data)
    first = await client.upload(path)
    second = await client.upload(io.BytesIO(data))
    third = await client.upload(data)
    assert first.name == second.name == third.name
    assert await _count(blob_stack, "blobs") == 1
    assert blob_stack.blobs is not None
    assert await _objects(blob_stack.blobs) == [
        blob_stack.blobs.key(blob_stack.tenant_id, first.sha256)
    ]
    assert await client.read_blob(first.name) == data


async def test_a_wrong_digest_stores_nothing(blob_stack: Stack) -> None:
    data = os.urandom(6 * MiB)
    header = blobs_pb2.UploadBlobHeader(sha256="ab" * 32)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _upload_raw(blob_stack, blob_stack.key, header, [data[:MiB], data[MiB : 2 * MiB]] * 3)
    assert _reason(caught.value) == (grpc.StatusCode.INVALID_ARGUMENT, "sha256:DigestMismatch")
    assert await _count(blob_stack, "blobs") == 0
    assert blob_stack.blobs is not None
    assert await _objects(blob_stack.blobs) == []
    s3 = await blob_stack.blobs._s3()
    uploads = await s3.list_multipart_uploads(Bucket=blob_stack.blobs.bucket)
    assert uploads.get("Uploads", []) == []


BAD_UPLOADS = [
    (blobs_pb2.UploadBlobHeader(), [b"x" * (MiB + 1)], "chunk:InvalidArgument"),
    (blobs_pb2.UploadBlobHeader(size=3), [b"abcd"], "size:BlobSizeMismatch"),
    (blobs_pb2.UploadBlobHeader(size=5), [b"abcd"], "size:BlobSizeMismatch"),
    (blobs_pb2.UploadBlobHeader(sha256="xyz"), [b"a"], "sha256:InvalidArgument"),
    (blobs_pb2.UploadBlobHeader(content_type="a\nb"), [b"a"], "content_type:InvalidArgument"),
]


async def test_bad_uploads_are_refused(blob_stack: Stack) -> None:
    for header, chunks, expected in BAD_UPLOADS:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _upload_raw(blob_stack, blob_stack.key, header, chunks)
        assert _reason(caught.value) == (grpc.StatusCode.INVALID_ARGUMENT, expected)
    assert await _count(blob_stack, "blobs") == 0


async def test_an_upload_that_does_not_start_with_its_header_is_refused(
    blob_stack: Stack,
) -> None:
    """No message at all, or a chunk first: the header is missing, said of the field."""
    for messages in ([], [blobs_pb2.UploadBlobRequest(chunk=b"abc")]):

        async def requests(
            given: list[blobs_pb2.UploadBlobRequest] = messages,
        ) -> AsyncIterator[blobs_pb2.UploadBlobRequest]:
            for message in given:
                yield message

        async with grpc.aio.insecure_channel(blob_stack.server.address) as channel:
            stub = blobs_pb2_grpc.BlobServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.UploadBlob(
                    requests(), metadata=(("authorization", f"Bearer {blob_stack.key}"),)
                )
        assert _reason(caught.value) == (grpc.StatusCode.INVALID_ARGUMENT, "header:InvalidArgument")
        assert "header" in (caught.value.details() or "")
    assert await _count(blob_stack, "blobs") == 0


async def test_a_second_header_is_refused_with_the_reason(blob_stack: Stack) -> None:
    """A header after the first message, before or after chunks, is refused, and
    the caller is told the rule it broke."""
    header = blobs_pb2.UploadBlobRequest(header=blobs_pb2.UploadBlobHeader())
    chunk = blobs_pb2.UploadBlobRequest(chunk=b"abc")
    for messages in ([header, header], [header, chunk, header, chunk]):

        async def requests(
            given: list[blobs_pb2.UploadBlobRequest] = messages,
        ) -> AsyncIterator[blobs_pb2.UploadBlobRequest]:
            for message in given:
                yield message

        async with grpc.aio.insecure_channel(blob_stack.server.address) as channel:
            stub = blobs_pb2_grpc.BlobServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.UploadBlob(
                    requests(), metadata=(("authorization", f"Bearer {blob_stack.key}"),)
                )
        assert _reason(caught.value) == (grpc.StatusCode.INVALID_ARGUMENT, "header:InvalidArgument")
        assert caught.value.details() == (
            "only the first message of UploadBlob is a header; the rest are chunks"
        )
    assert await _count(blob_stack, "blobs") == 0


async def test_a_bad_content_type_is_explained(blob_stack: Stack) -> None:
    header = blobs_pb2.UploadBlobHeader(content_type="x" * 1000)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _upload_raw(blob_stack, blob_stack.key, header, [b"a"])
    assert _reason(caught.value)[1] == "content_type:InvalidArgument"
    assert "content_type must be at most" in (caught.value.details() or "")


async def test_the_total_limit(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    moto: MotoServer,
    started: Started,
) -> None:
    store = await started(blob_store(engine, moto.url, max_blob_bytes=2 * MiB))
    stack = await started(
        start_stack(
            engine, database_url, amqp_url, topology, relay=False, worker=False, blobs=store
        )
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _upload_raw(stack, stack.key, blobs_pb2.UploadBlobHeader(), [b"x" * MiB] * 3)
    # Named like the declared size's refusal: here the bytes are at fault.
    assert _reason(caught.value) == (grpc.StatusCode.INVALID_ARGUMENT, "chunk:BlobTooLarge")
    with pytest.raises(grpc.aio.AioRpcError) as declared:
        await _upload_raw(stack, stack.key, blobs_pb2.UploadBlobHeader(size=3 * MiB), [])
    assert _reason(declared.value)[1] == "size:BlobTooLarge"
    assert await _count(stack, "blobs") == 0


async def test_tenant_walls(blob_stack: Stack) -> None:
    client = blob_stack.client()
    blob = await client.upload(b"acme's")
    other = blob_stack.client(await blob_stack.new_key("other"))
    with pytest.raises(BlobNotFound):
        await other.get_blob(blob.name)
    with pytest.raises(BlobNotFound):
        await other.download(blob.name, io.BytesIO())
    with pytest.raises(BlobNotFound):
        await other.delete_blob(blob.name)
    assert (await other.list_blobs()).blobs == []
    with pytest.raises(BlobNotFound) as referenced:
        await other.submit("demo.echo", {"input": blob.name})
    assert referenced.value.field == "payload"
    with pytest.raises(BlobNotFound) as by_reference:
        await other._call(
            other._get_stub().SubmitJob,
            jobs_pb2.SubmitJobRequest(type="demo.echo", request_id="r1", payload_blob=blob.name),
        )
    assert by_reference.value.field == "payload_blob"
    with pytest.raises(BlobNotFound) as inside:  # named inside a payload that goes by reference
        await other.submit("demo.echo", {"text": "t" * 70_000, "input": blob.name})
    assert inside.value.field == "blob_references"
    # The same bytes uploaded by the other tenant are a blob of its own.
    theirs = await other.upload(b"acme's")
    assert theirs.name == blob.name
    await other.delete_blob(theirs.name)
    assert (await client.get_blob(blob.name)).size == len(b"acme's")
    assert await _count(blob_stack, "jobs") == 0


async def test_delete_while_referenced(blob_stack: Stack) -> None:
    client = blob_stack.client()
    blob = await client.upload(b"input")
    job = await client.submit("demo.echo", {"files": [{"blob": blob.name}]})
    roles = await blob_stack.scalar(
        "SELECT string_agg(role, ',') FROM job_blobs WHERE job_id = :id", id=job.id
    )
    assert roles == "input"
    with pytest.raises(BlobInUse) as caught:
        await client.delete_blob(blob.name)
    assert caught.value.code is grpc.StatusCode.FAILED_PRECONDITION
    async with blob_stack.engine.begin() as conn:
        await conn.execute(text("DELETE FROM jobs WHERE id = :id"), {"id": job.id})
    await client.delete_blob(blob.name)
    with pytest.raises(BlobNotFound):
        await client.get_blob(blob.name)
    with pytest.raises(BlobNotFound):
        await client.delete_blob(blob.name)
    with pytest.raises(BlobNotFound):
        await client.get_blob("blobs/not-a-digest")


async def test_list_pages(blob_stack: Stack) -> None:
    client = blob_stack.client()
    names = sorted([(await client.upload(bytes([i]))).name for i in range(5)])
    page = await client.list_blobs(page_size=2)
    assert [b.name for b in page.blobs] == names[:2] and page.next_page_token
    assert [b.name async for b in client.iter_blobs(page_size=2)] == names
    with pytest.raises(InvalidArgument) as caught:
        await client.list_blobs(page_token="bogus")
    assert caught.value.field == "page_token"


async def test_blobs_disabled(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(BlobsDisabled):
        await client.get_blob("blobs/" + "0" * 64)
    with pytest.raises(BlobsDisabled):
        await client.upload(b"x")
    with pytest.raises(FailedPrecondition):
        await client.submit("demo.echo", {"input": "blobs/" + "0" * 64})
    # A large payload goes inline when the server has no object store.
    big = {"text": "x" * 100_000}
    job = await client.submit("demo.echo", big)
    assert job.payload == big and job.payload_blob is None


async def test_the_blocking_client(blob_stack: Stack, tmp_path: Path) -> None:
    def use() -> None:
        with Client(blob_stack.server.address, blob_stack.key) as client:
            blob = client.upload(b"sync")
            assert client.get_blob(blob.name).size == 4
            target = tmp_path / "x"
            client.download(blob.name, target)
            assert target.read_bytes() == b"sync"
            assert [b.name for b in client.iter_blobs()] == [blob.name]
            client.delete_blob(blob.name)
            assert client.list_blobs().blobs == []

    await asyncio.to_thread(use)


async def test_the_cli(blob_stack: Stack, tmp_path: Path) -> None:
    source = tmp_path / "report.pdf"
    source.write_bytes(b"%PDF-1.7 not really")
    code, out, err = await jobplane(blob_stack, "blobs", "put", str(source))
    assert code == 0, err
    name = out.strip()
    assert name == "blobs/" + hashlib.sha256(source.read_bytes()).hexdigest()
    target = tmp_path / "copy.pdf"
    code, _, err = await jobplane(blob_stack, "blobs", "get", name, "-o", str(target))
    assert code == 0, err
    assert target.read_bytes() == source.read_bytes()
    code, out, _ = await jobplane(blob_stack, "blobs", "list", "--json")
    assert [json.loads(line)["name"] for line in out.splitlines()] == [name]
    code, _, err = await jobplane(blob_stack, "blobs", "get", "blobs/" + "0" * 64)
    assert code == 1 and "BLOB_NOT_FOUND" in err
    code, _, err = await jobplane(blob_stack, "blobs", "delete", name.removeprefix("blobs/"))
    assert code == 0, err
    assert (await blob_stack.client().list_blobs()).blobs == []


async def test_a_tenant_holds_a_bounded_number_of_transfers(blob_stack: Stack) -> None:
    """Open downloads each hold an S3 connection: one tenant's are capped, others go on."""
    from jobplane.server.blob_servicer import MAX_TRANSFERS_PER_TENANT

    # Large enough that a download stays open while its reader waits (flow control).
    blob = await blob_stack.client().upload(io.BytesIO(os.urandom(24 * MiB)))
    other = await blob_stack.new_key("globex")
    other_blob = await blob_stack.client(other).upload(io.BytesIO(b"globex"))
    auth = (("authorization", f"Bearer {blob_stack.key}"),)
    # No BDP probing: the channel's flow-control window stays small, so an
    # unread download cannot finish (and free its slot) however loaded the machine.
    async with grpc.aio.insecure_channel(
        blob_stack.server.address, options=[("grpc.http2.bdp_probe", 0)]
    ) as channel:
        stub = blobs_pb2_grpc.BlobServiceStub(channel)
        held = []
        for _ in range(MAX_TRANSFERS_PER_TENANT):
            call = stub.DownloadBlob(blobs_pb2.DownloadBlobRequest(name=blob.name), metadata=auth)
            first = await call.read()  # the header: the transfer is open and stays so
            assert isinstance(first, blobs_pb2.DownloadBlobResponse)
            assert first.blob.name == blob.name
            held.append(call)
        refused = stub.DownloadBlob(blobs_pb2.DownloadBlobRequest(name=blob.name), metadata=auth)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await refused.read()
        assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "uploads and downloads open" in (caught.value.details() or "")
        # Another tenant is not held up by the first one's transfers.
        assert await blob_stack.client(other).read_blob(other_blob.name) == b"globex"
        held.pop().cancel()
        await asyncio.sleep(0.2)
        again = stub.DownloadBlob(blobs_pb2.DownloadBlobRequest(name=blob.name), metadata=auth)
        reply = await again.read()
        assert isinstance(reply, blobs_pb2.DownloadBlobResponse)
        assert reply.blob.name == blob.name
        for call in (*held, again):
            call.cancel()
