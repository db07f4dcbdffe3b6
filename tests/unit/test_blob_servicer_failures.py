"""BlobService over the servicer, without a server: a failure of the blob store
that no rule expects reaches the caller as INTERNAL, and is logged once as
``rpc.failed`` naming the RPC it broke, for each of the service's RPCs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, MutableMapping
from typing import Any, cast

import grpc
import pytest

from jobplane.blobs.store import BlobStore
from jobplane.server import status as status_module
from jobplane.server.auth import CallGate
from jobplane.server.blob_servicer import BlobServiceServicer
from jobplane.server.limits import TenantLimiter, TenantLimits
from jobplane.store.keys import KeyIdentity, KeyStore
from jobplane.v1 import blobs_pb2
from tests.support.logs import module_lines
from tests.support.servicer_context import Aborted, ServicerContext

Lines = list[MutableMapping[str, Any]]

_KEY = "the-key"
_SERVICE = "jobplane.v1.BlobService"
_TENANT = uuid.UUID(int=3)
_DIGEST = "sha256:" + "ab" * 32


class _Keys:
    async def resolve(self, key: str) -> KeyIdentity | None:
        return KeyIdentity(_TENANT, "key_0123456789abcdef") if key == _KEY else None


class _Details(grpc.HandlerCallDetails):
    def __init__(self, rpc: str) -> None:
        self.method = f"/{_SERVICE}/{rpc}"
        self.invocation_metadata = (("authorization", f"Bearer {_KEY}"),)


class _Broken:
    """A blob store whose every call fails as a bug would; the tenants it was asked for."""

    def __init__(self) -> None:
        self.tenants: list[uuid.UUID] = []

    def _fail(self, tenant: uuid.UUID) -> KeyError:
        self.tenants.append(tenant)
        return KeyError("a bug in the store")

    async def put_stream(self, tenant: uuid.UUID, *args: Any, **kwargs: Any) -> Any:
        raise self._fail(tenant)

    async def stat(self, tenant: uuid.UUID, name: str) -> Any:
        raise self._fail(tenant)

    def open(self, tenant: uuid.UUID, name: str) -> Any:
        raise self._fail(tenant)

    async def list_blobs(self, tenant: uuid.UUID, **kwargs: Any) -> Any:
        raise self._fail(tenant)

    async def delete(self, tenant: uuid.UUID, name: str) -> None:
        raise self._fail(tenant)


async def _upload(servicer: BlobServiceServicer, context: Any) -> Any:
    async def messages() -> AsyncIterator[blobs_pb2.UploadBlobRequest]:
        yield blobs_pb2.UploadBlobRequest(header=blobs_pb2.UploadBlobHeader(content_type="a/b"))

    return await servicer.UploadBlob(messages(), context)


async def _download(servicer: BlobServiceServicer, context: Any) -> Any:
    request = blobs_pb2.DownloadBlobRequest(name=_DIGEST)
    return [m async for m in servicer.DownloadBlob(request, context)]


_RPCS: dict[str, Callable[[BlobServiceServicer, Any], Awaitable[Any]]] = {
    "UploadBlob": _upload,
    "GetBlob": lambda s, c: s.GetBlob(blobs_pb2.GetBlobRequest(name=_DIGEST), c),
    "DownloadBlob": _download,
    "ListBlobs": lambda s, c: s.ListBlobs(blobs_pb2.ListBlobsRequest(), c),
    "DeleteBlob": lambda s, c: s.DeleteBlob(blobs_pb2.DeleteBlobRequest(name=_DIGEST), c),
}


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Lines]:
    with module_lines(monkeypatch, status_module, "jobplane.server") as captured:
        yield captured


@pytest.mark.parametrize("rpc", list(_RPCS))
async def test_a_store_failure_is_internal_and_logged_naming_the_rpc(
    rpc: str, lines: Lines
) -> None:
    store = _Broken()
    servicer = BlobServiceServicer(cast(BlobStore, store))
    gate = CallGate(_SERVICE, cast(KeyStore, _Keys()), TenantLimiter(TenantLimits()))

    async def call() -> None:
        async def continuation(_details: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(lambda request, context: None)

        # The gate sets the caller's identity for the task that serves the call.
        await gate.intercept_service(continuation, _Details(rpc))
        await _RPCS[rpc](servicer, ServicerContext())

    with pytest.raises(Aborted) as aborted:
        await asyncio.create_task(call())
    assert aborted.value.status.code is grpc.StatusCode.INTERNAL
    assert "a bug" not in aborted.value.status.details  # nothing of the failure is told
    assert store.tenants == [_TENANT]
    (line,) = (line for line in lines if line["event"] == "rpc.failed")
    assert (line["log_level"], line["rpc"]) == ("error", rpc)
    assert isinstance(line["exc_info"], KeyError)
