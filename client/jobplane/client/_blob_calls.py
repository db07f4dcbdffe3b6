"""The blob calls of :class:`~jobplane.client.AsyncClient`: upload, download, list, delete.

The chunking and digest checks of a transfer are in ``_blobs``; this part
makes the calls, and repeats an upload that can be sent again.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator
from typing import IO

import grpc

from jobplane.client._blobs import Download, Source, blob_from_pb, upload_requests
from jobplane.client._channel import UNARY_RETRY, UNBOUNDED_CALL_BUDGET, ChannelBase
from jobplane.client._errors import error_from_rpc, is_retryable
from jobplane.client._retry import Backoff
from jobplane.errors import Unavailable
from jobplane.types import Blob, BlobPage
from jobplane.v1 import blobs_pb2


class BlobCalls(ChannelBase):
    """The BlobService calls; the job calls use them for payloads that go by reference."""

    async def upload(self, source: Source, *, content_type: str | None = None) -> Blob:
        """Store a file (a path), a readable binary stream or bytes as a blob; its name.

        Streams in chunks of 1 MiB. The same bytes give the same blob, stored
        once. A path's sha256 is computed first and checked by the server.
        A path or bytes are sent again while the server cannot be reached (for
        the client's ``timeout`` at most); a stream, read once, is not.
        """
        again = not hasattr(source, "read")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self._timeout or UNBOUNDED_CALL_BUDGET)
        backoff = Backoff(UNARY_RETRY)
        while True:
            try:
                reply = await self._get_blob_stub().UploadBlob(
                    upload_requests(source, content_type), metadata=self._metadata
                )
                return blob_from_pb(reply)
            except grpc.aio.AioRpcError as exc:
                delay = backoff.failure()
                if not (again and is_retryable(exc)) or self._closed:
                    raise error_from_rpc(exc) from exc
                if delay is None or loop.time() + delay >= deadline:
                    raise error_from_rpc(exc) from exc
            await asyncio.sleep(delay)

    async def get_blob(self, name: str) -> Blob:
        """One blob's metadata."""
        request = blobs_pb2.GetBlobRequest(name=name)
        reply = await self._call(self._get_blob_stub().GetBlob, request, repeatable=True)
        return blob_from_pb(reply)

    async def download(self, name: str, dest: str | os.PathLike[str] | IO[bytes]) -> Blob:
        """Write the blob's bytes to ``dest``: a path (written whole or not at all) or a
        writable binary stream. The bytes are checked against the name's sha256."""
        blob, _ = await self._download(name, Download(name, dest))
        return blob

    async def read_blob(self, name: str) -> bytes:
        """The blob's bytes, in memory."""
        _, data = await self._download(name, Download(name, None))
        return data

    async def _download(self, name: str, sink: Download) -> tuple[Blob, bytes]:
        blob: Blob | None = None
        try:
            await sink.open()
            call = self._get_blob_stub().DownloadBlob(
                blobs_pb2.DownloadBlobRequest(name=name), metadata=self._metadata
            )
            async for message in call:
                if message.HasField("blob"):
                    blob = blob_from_pb(message.blob)
                if message.chunk:
                    await sink.write(message.chunk)
            data = await sink.finish()
        except grpc.aio.AioRpcError as exc:
            sink.discard()
            raise error_from_rpc(exc) from exc
        except BaseException:
            sink.discard()
            raise
        if blob is None:
            raise Unavailable("the download ended before the blob's metadata")
        return blob, data

    async def list_blobs(self, *, page_size: int = 0, page_token: str = "") -> BlobPage:
        """One page of the caller's blobs by name; ``page_size`` 0 means 100."""
        request = blobs_pb2.ListBlobsRequest(page_size=page_size, page_token=page_token)
        reply = await self._call(self._get_blob_stub().ListBlobs, request, repeatable=True)
        return BlobPage([blob_from_pb(b) for b in reply.blobs], reply.next_page_token)

    async def iter_blobs(self, *, page_size: int = 0) -> AsyncGenerator[Blob, None]:
        """Every blob of the caller, page by page."""
        token = ""
        while True:
            page = await self.list_blobs(page_size=page_size, page_token=token)
            for blob in page.blobs:
                yield blob
            if not page.next_page_token:
                return
            token = page.next_page_token

    async def delete_blob(self, name: str) -> None:
        """Delete a blob; :class:`~jobplane.errors.BlobInUse` while a job references it."""
        request = blobs_pb2.DeleteBlobRequest(name=name)
        await self._call(self._get_blob_stub().DeleteBlob, request, repeatable=True)
