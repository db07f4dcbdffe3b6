"""The SDK's blob calls without a server."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator

import pytest

from jobplane.client import AsyncClient, Unavailable, _blob_calls, _blobs
from jobplane.client._blobs import Source
from jobplane.v1 import blobs_pb2


async def test_an_upload_of_bytes_is_repeated_until_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Nothing listens on port 1: the upload is sent again, after pauses of
    # 0.05, 0.1 and 0.2 s (each within 20 %), until the next pause would pass
    # its 0.6 s deadline. Each attempt reads the bytes anew: count those.
    attempts = 0
    real = _blobs.upload_requests

    def counted(
        source: Source, content_type: str | None
    ) -> AsyncIterator[blobs_pb2.UploadBlobRequest]:
        nonlocal attempts
        attempts += 1
        return real(source, content_type)

    monkeypatch.setattr(_blob_calls, "upload_requests", counted)
    async with AsyncClient("127.0.0.1:1", "key", timeout=0.6) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await client.upload(b"bytes")
        elapsed = time.monotonic() - started
    assert attempts >= 3
    assert elapsed < 5.0


async def test_an_upload_of_a_stream_is_not_repeated() -> None:
    async with AsyncClient("127.0.0.1:1", "key", timeout=5.0) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await client.upload(io.BytesIO(b"read once"))
        assert time.monotonic() - started < 2.0
