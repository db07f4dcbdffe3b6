"""Moving blob bytes for the SDK: chunked uploads from files, streams and bytes;
downloads into files or streams, checked against the blob's name."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

from jobplane.convert import from_timestamp
from jobplane.errors import DigestMismatch
from jobplane.types import Blob
from jobplane.v1 import blobs_pb2

#: Bytes per UploadBlob message (the server takes at most 1 MiB).
CHUNK_BYTES = 1024 * 1024

#: What ``upload`` takes: a path, a readable binary stream, or the bytes.
Source = str | os.PathLike[str] | IO[bytes] | bytes | bytearray | memoryview


def blob_from_pb(message: blobs_pb2.Blob) -> Blob:
    """The public Blob of a Blob message."""
    return Blob(
        name=message.name,
        sha256=message.sha256,
        size=message.size,
        content_type=message.content_type,
        create_time=from_timestamp(message.create_time)
        if message.HasField("create_time")
        else None,
    )


def _file_digest(path: Path) -> tuple[str, int]:
    hasher = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            hasher.update(chunk)
            size += len(chunk)
    return hasher.hexdigest(), size


async def upload_requests(
    source: Source, content_type: str | None
) -> AsyncIterator[blobs_pb2.UploadBlobRequest]:
    """The messages of one UploadBlob: the header, then chunks of at most 1 MiB.

    A path or bytes are read twice (the digest first, declared in the
    header, so the server stores straight under the blob's name); a stream
    once, its digest left to the server.
    """
    header = blobs_pb2.UploadBlobHeader(content_type=content_type or "")
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        header.sha256 = hashlib.sha256(data).hexdigest()
        header.size = len(data)
        yield blobs_pb2.UploadBlobRequest(header=header)
        for start in range(0, len(data), CHUNK_BYTES):
            yield blobs_pb2.UploadBlobRequest(chunk=data[start : start + CHUNK_BYTES])
        return
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        digest, size = await asyncio.to_thread(_file_digest, path)
        header.sha256, header.size = digest, size
        yield blobs_pb2.UploadBlobRequest(header=header)
        f = await asyncio.to_thread(path.open, "rb")
        try:
            while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
                yield blobs_pb2.UploadBlobRequest(chunk=chunk)
        finally:
            f.close()
        return
    yield blobs_pb2.UploadBlobRequest(header=header)
    while chunk := await asyncio.to_thread(source.read, CHUNK_BYTES):
        yield blobs_pb2.UploadBlobRequest(chunk=bytes(chunk))


class Download:
    """Where a download's chunks go, checked against the sha256 its name promises."""

    def __init__(self, name: str, dest: str | os.PathLike[str] | IO[bytes] | None) -> None:
        self._name = name
        self._expected = name.removeprefix("blobs/")
        self._hasher = hashlib.sha256()
        self._parts: list[bytes] | None = None
        self._stream: IO[bytes] | Any = None
        self._path: Path | None = None
        self._temp: Path | None = None
        if dest is None:
            self._parts = []
        elif isinstance(dest, str | os.PathLike):
            self._path = Path(dest)
        else:
            self._stream = dest

    async def open(self) -> None:
        """Open the temporary file beside a destination path."""
        if self._path is not None:
            fd, temp = await asyncio.to_thread(
                tempfile.mkstemp, prefix=f".{self._path.name}.", dir=self._path.parent or "."
            )
            self._temp = Path(temp)
            self._stream = os.fdopen(fd, "wb")

    async def write(self, chunk: bytes) -> None:
        """One chunk, in order."""
        self._hasher.update(chunk)
        if self._parts is not None:
            self._parts.append(chunk)
        else:
            await asyncio.to_thread(self._stream.write, chunk)

    async def finish(self) -> bytes:
        """Check the digest; move a file into place. The bytes when kept in memory."""
        actual = self._hasher.hexdigest()
        if actual != self._expected:
            raise DigestMismatch(f"{self._name} arrived with sha256 {actual}", field="name")
        if self._temp is not None and self._path is not None:
            self._stream.close()
            await asyncio.to_thread(os.replace, self._temp, self._path)
            self._temp = None
        return b"".join(self._parts) if self._parts is not None else b""

    def discard(self) -> None:
        """After a failure: remove the temporary file."""
        if self._temp is not None:
            with contextlib.suppress(OSError):
                self._stream.close()
                self._temp.unlink()
            self._temp = None
