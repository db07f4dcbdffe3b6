"""The SDK's blob calls without a server."""

from __future__ import annotations

import io
import time

import pytest

from jobplane.client import AsyncClient, Unavailable


async def test_an_upload_of_bytes_is_repeated_until_the_deadline() -> None:
    # Nothing listens on port 1: the upload is sent again until its deadline.
    async with AsyncClient("127.0.0.1:1", "key", timeout=0.6) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await client.upload(b"bytes")
        assert time.monotonic() - started >= 0.3


async def test_an_upload_of_a_stream_is_not_repeated() -> None:
    async with AsyncClient("127.0.0.1:1", "key", timeout=5.0) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable):
            await client.upload(io.BytesIO(b"read once"))
        assert time.monotonic() - started < 2.0
