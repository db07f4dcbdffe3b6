"""BlobService over gRPC: a thin adapter between protobuf and :class:`BlobStore`.

The tenant is the caller's key's (CallGate); the store scopes every read and
write by it, so another tenant's blob is not found, never forbidden.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from jobplane.blobs.names import parse_digest
from jobplane.convert import timestamp
from jobplane.errors import BlobsDisabled, InvalidArgument, TenantLimitExceeded
from jobplane.server.auth import current_identity
from jobplane.server.status import error_for, to_grpc_status
from jobplane.v1 import blobs_pb2, blobs_pb2_grpc

if TYPE_CHECKING:
    from jobplane.blobs.reader import BlobInfo
    from jobplane.blobs.store import BlobStore

Context = grpc.aio.ServicerContext[Any, Any]
Req = TypeVar("Req")
Resp = TypeVar("Resp")

#: The most bytes of one UploadBlob or DownloadBlob message.
MAX_CHUNK_BYTES = 1024 * 1024
#: Uploads and downloads one tenant may have open at once on one server: each
#: holds one of the process's S3 connections (and an upload a part in memory),
#: so one tenant's slow readers cannot take them all from the others.
MAX_TRANSFERS_PER_TENANT = 8
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
MAX_CONTENT_TYPE = 255
_TOKEN_PREFIX = "b1:"


def blob_to_pb(info: BlobInfo) -> blobs_pb2.Blob:
    """The Blob message of a stored blob."""
    message = blobs_pb2.Blob(
        name=info.name, sha256=info.digest, size=info.size, content_type=info.content_type
    )
    created = timestamp(info.created_at)
    if created is not None:
        message.create_time.CopyFrom(created)
    return message


def _page_token(digest: str) -> str:
    return base64.urlsafe_b64encode(f"{_TOKEN_PREFIX}{digest}".encode()).decode()


def _after(token: str) -> str:
    if not token:
        return ""
    digest = ""
    try:
        raw = base64.urlsafe_b64decode(token.encode("ascii")).decode()
        if raw.startswith(_TOKEN_PREFIX):
            digest = parse_digest(raw[len(_TOKEN_PREFIX) :])
    except (ValueError, binascii.Error, UnicodeError):
        digest = ""
    if not digest:
        raise InvalidArgument("page_token is not one this server issued", field="page_token")
    return digest


def _content_type(value: str) -> str:
    if len(value) > MAX_CONTENT_TYPE or any(c < " " or c == "\x7f" for c in value):
        raise InvalidArgument(
            f"content_type must be at most {MAX_CONTENT_TYPE} printable characters",
            field="content_type",
        )
    return value


def _call(
    method: Callable[[Any, BlobStore, uuid.UUID, Req], Awaitable[Resp]],
) -> Callable[[Any, Req, Context], Awaitable[Resp]]:
    """Run with the store, for the caller's tenant; any failure becomes its rich status."""

    @functools.wraps(method)
    async def wrapper(self: BlobServiceServicer, request: Req, context: Context) -> Resp:
        try:
            return await method(self, self.require(), current_identity().tenant_id, request)
        except Exception as exc:
            await context.abort_with_status(to_grpc_status(error_for(exc, method.__name__)))
        raise AssertionError("unreachable: abort raises")

    return wrapper


class BlobServiceServicer(blobs_pb2_grpc.BlobServiceServicer):
    """The BlobService RPCs; ``store`` None: blobs are disabled (FAILED_PRECONDITION)."""

    def __init__(
        self, store: BlobStore | None, *, max_transfers: int = MAX_TRANSFERS_PER_TENANT
    ) -> None:
        self._store = store
        self._max_transfers = max_transfers
        self._transfers: dict[uuid.UUID, int] = {}

    @contextlib.contextmanager
    def _transfer(self, tenant: uuid.UUID) -> Iterator[None]:
        """One of the tenant's transfer slots for the block; TenantLimitExceeded when none."""
        held = self._transfers.get(tenant, 0)
        if held >= self._max_transfers:
            raise TenantLimitExceeded(
                f"this tenant already has {held} uploads and downloads open on this server; "
                "finish some first",
                metadata={"limit": "blob_transfers", "max": str(self._max_transfers)},
                retry_delay=1.0,
            )
        self._transfers[tenant] = held + 1
        try:
            yield
        finally:
            left = self._transfers[tenant] - 1
            if left:
                self._transfers[tenant] = left
            else:
                del self._transfers[tenant]

    def require(self) -> BlobStore:
        """The store; :class:`BlobsDisabled` when there is none."""
        if self._store is None:
            raise BlobsDisabled()
        return self._store

    @_call
    async def UploadBlob(
        self,
        store: BlobStore,
        tenant: uuid.UUID,
        request_iterator: AsyncIterable[blobs_pb2.UploadBlobRequest],
    ) -> blobs_pb2.Blob:
        messages = aiter(request_iterator)
        header = _header(await anext(messages, None))
        size = header.size if header.HasField("size") else None
        with self._transfer(tenant):
            info = await store.put_stream(
                tenant,
                _chunks(messages),
                digest=_declared_digest(header.sha256),
                content_type=_content_type(header.content_type),
                size=_size(size),
            )
        return blob_to_pb(info)

    @_call
    async def GetBlob(
        self, store: BlobStore, tenant: uuid.UUID, request: blobs_pb2.GetBlobRequest
    ) -> blobs_pb2.Blob:
        return blob_to_pb(await store.stat(tenant, request.name))

    async def DownloadBlob(
        self, request: blobs_pb2.DownloadBlobRequest, context: Context
    ) -> AsyncIterator[blobs_pb2.DownloadBlobResponse]:
        try:
            store = self.require()
            tenant = current_identity().tenant_id
            with self._transfer(tenant):
                async with store.open(tenant, request.name) as reader:
                    yield blobs_pb2.DownloadBlobResponse(blob=blob_to_pb(reader.info))
                    async for chunk in reader.iter_chunks(MAX_CHUNK_BYTES):
                        yield blobs_pb2.DownloadBlobResponse(chunk=chunk)
        except Exception as exc:
            await context.abort_with_status(to_grpc_status(error_for(exc, "DownloadBlob")))

    @_call
    async def ListBlobs(
        self, store: BlobStore, tenant: uuid.UUID, request: blobs_pb2.ListBlobsRequest
    ) -> blobs_pb2.ListBlobsResponse:
        infos, last = await store.list_blobs(
            tenant, page_size=_page_size(request.page_size), after=_after(request.page_token)
        )
        return blobs_pb2.ListBlobsResponse(
            blobs=[blob_to_pb(i) for i in infos],
            next_page_token=_page_token(last) if last else "",
        )

    @_call
    async def DeleteBlob(
        self, store: BlobStore, tenant: uuid.UUID, request: blobs_pb2.DeleteBlobRequest
    ) -> blobs_pb2.DeleteBlobResponse:
        await store.delete(tenant, request.name)
        return blobs_pb2.DeleteBlobResponse()


def _header(first: blobs_pb2.UploadBlobRequest | None) -> blobs_pb2.UploadBlobHeader:
    if first is None or first.WhichOneof("part") != "header":
        raise InvalidArgument("the first message of UploadBlob must be its header", field="header")
    return first.header


def _declared_digest(value: str) -> str | None:
    if not value:
        return None
    try:
        return parse_digest(value)
    except ValueError as exc:
        raise InvalidArgument(str(exc), field="sha256") from None


def _size(size: int | None) -> int | None:
    if size is not None and size < 0:
        raise InvalidArgument("size must not be negative", field="size")
    return size


def _page_size(value: int) -> int:
    if value < 0:
        raise InvalidArgument("page_size must not be negative", field="page_size")
    return min(value or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


async def _chunks(messages: AsyncIterator[blobs_pb2.UploadBlobRequest]) -> AsyncIterator[bytes]:
    """The bytes of the messages after the header, each checked."""
    async for message in messages:
        if message.WhichOneof("part") != "chunk":
            raise InvalidArgument(
                "only the first message of UploadBlob is a header; the rest are chunks",
                field="header",
            )
        if len(message.chunk) > MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"a chunk may have at most {MAX_CHUNK_BYTES} bytes (1 MiB), "
                f"not {len(message.chunk)}",
                field="chunk",
            )
        yield message.chunk
