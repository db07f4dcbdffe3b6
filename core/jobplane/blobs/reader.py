"""What a handler is given of a blob: :class:`BlobInfo` and :class:`BlobReader`.

Apart from :mod:`jobplane.blobs.store` so that the handler API and
:mod:`jobplane.testing` import no object store driver (aioboto3, botocore,
aiohttp): the worker install has none.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class BlobInfo:
    """A stored blob: its name, sha256, size in bytes and content type."""

    name: str
    digest: str
    size: int
    content_type: str = ""
    created_at: datetime | None = None


class BlobReader:
    """An open blob: ``info``, ``await read(n)``, ``async for chunk in iter_chunks(size)``."""

    def __init__(self, info: BlobInfo, body: Any) -> None:
        self.info = info
        self._body = body

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (all that are left when ``n`` < 0); ``b""`` at the end."""
        data: bytes = await self._body.read(None if n < 0 else n)
        return data

    async def iter_chunks(self, size: int = 1024 * 1024) -> AsyncIterator[bytes]:
        """The rest of the blob in chunks of at most ``size`` bytes."""
        if size <= 0:
            raise ValueError("chunk size must be positive")
        while True:
            chunk = await self.read(size)
            if not chunk:
                return
            yield chunk
