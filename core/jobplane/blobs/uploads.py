"""A blob's upload, streamed: its bytes checked against the limits and hashed
as they come, gathered into parts of at least a part's size (S3 wants 5 MiB,
except the last), each sent as one part of a multipart upload; and the copy
of a completed upload to the name its bytes turned out to have.

About one part is held at a time, whatever the blob's size.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import TYPE_CHECKING, Any

import structlog

from jobplane.blobs.s3 import s3_errors
from jobplane.errors import BlobSizeMismatch, BlobTooLarge, DigestMismatch
from jobplane.logs import describe_error

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client

log = structlog.get_logger("jobplane.blobs")

#: S3's largest single CopyObject; larger objects are copied in parts.
MAX_COPY_BYTES = 5 * 1024**3
_COPY_PART_BYTES = 1024**3


class Parts:
    """The bytes of one upload as they stream in: checked against the largest
    blob and the declared size, hashed, and gathered into parts of at least
    ``part_bytes`` (the chunks of the part being gathered are joined once, when
    a part is full)."""

    def __init__(self, *, max_bytes: int, size: int | None, part_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._size = size
        self._part_bytes = part_bytes
        self._hasher = hashlib.sha256()
        self._held: list[bytes] = []
        self._held_bytes = 0
        #: The bytes taken so far.
        self.total = 0

    def add(self, chunk: bytes) -> bytes | None:
        """Take ``chunk``; the part it fills, when it fills one."""
        self.total += len(chunk)
        if self.total > self._max_bytes:
            # The bytes are at fault (UploadBlob's chunks), as the
            # declared size is when it says too much.
            raise BlobTooLarge(f"the blob is larger than {self._max_bytes} bytes", field="chunk")
        if self._size is not None and self.total > self._size:
            raise BlobSizeMismatch(
                f"the blob has more than the declared {self._size} bytes", field="size"
            )
        self._hasher.update(chunk)
        self._held.append(chunk)
        self._held_bytes += len(chunk)
        return self.rest() if self._held_bytes >= self._part_bytes else None

    @property
    def holding(self) -> bool:
        """Whether bytes are held that no part took yet."""
        return bool(self._held)

    def rest(self) -> bytes:
        """What is held, joined (a full part, or the last); nothing is held after."""
        part = b"".join(self._held)
        self._held.clear()
        self._held_bytes = 0
        return part

    def digest(self, declared: str | None) -> str:
        """The sha256 of all the bytes, once every chunk came: checked against the
        declared size and the ``declared`` digest."""
        if self._size is not None and self.total != self._size:
            raise BlobSizeMismatch(
                f"the blob has {self.total} bytes, not the declared {self._size}", field="size"
            )
        actual = self._hasher.hexdigest()
        if declared is not None and actual != declared:
            raise DigestMismatch(
                f"the bytes have sha256 {actual}, not the declared {declared}", field="sha256"
            )
        return actual


async def copy_object(
    s3: S3Client, bucket: str, source: str, key: str, size: int, content_type: str
) -> None:
    """Copy ``source`` to ``key`` in ``bucket``: in one call, or in parts when larger
    than S3 copies at once."""
    src = {"Bucket": bucket, "Key": source}
    async with s3_errors():
        if size <= MAX_COPY_BYTES:
            await s3.copy_object(Bucket=bucket, Key=key, CopySource=src)  # type: ignore[arg-type]
            return
        created = await s3.create_multipart_upload(Bucket=bucket, Key=key, ContentType=content_type)
        upload_id = created["UploadId"]
        try:
            parts = []
            for number, start in enumerate(range(0, size, _COPY_PART_BYTES), start=1):
                end = min(start + _COPY_PART_BYTES, size) - 1
                copied = await s3.upload_part_copy(
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=src,  # type: ignore[arg-type]
                    CopySourceRange=f"bytes={start}-{end}",
                )
                parts.append({"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]})
            await s3.complete_multipart_upload(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},  # type: ignore[typeddict-item]
            )
        except BaseException:
            with contextlib.suppress(Exception):
                await s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            raise


class Multipart:
    """One multipart upload, started at its first part; aborted unless completed."""

    def __init__(self, s3: S3Client, bucket: str, key: str | None) -> None:
        self._s3 = s3
        self._bucket = bucket
        self.key = key
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []
        self._completed = False

    @property
    def started(self) -> bool:
        return self._upload_id is not None

    async def part(self, data: bytes, content_type: str) -> None:
        assert self.key is not None
        async with s3_errors():
            if self._upload_id is None:
                created = await self._s3.create_multipart_upload(
                    Bucket=self._bucket, Key=self.key, ContentType=content_type
                )
                self._upload_id = created["UploadId"]
            number = len(self._parts) + 1
            sent = await self._s3.upload_part(
                Bucket=self._bucket,
                Key=self.key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=data,
            )
        self._parts.append({"PartNumber": number, "ETag": sent["ETag"]})

    async def complete(self) -> None:
        assert self.key is not None and self._upload_id is not None
        async with s3_errors():
            await self._s3.complete_multipart_upload(
                Bucket=self._bucket,
                Key=self.key,
                UploadId=self._upload_id,
                MultipartUpload={"Parts": self._parts},  # type: ignore[typeddict-item]
            )
        self._completed = True

    async def discard(self) -> None:
        """Abort the upload when it was not completed; delete a completed staging object."""
        if self._upload_id is None or self.key is None:
            return
        try:
            if not self._completed:
                await asyncio.shield(
                    self._s3.abort_multipart_upload(
                        Bucket=self._bucket, Key=self.key, UploadId=self._upload_id
                    )
                )
            elif "/staging/" in self.key:
                await asyncio.shield(self._s3.delete_object(Bucket=self._bucket, Key=self.key))
        except Exception as exc:  # a leftover part or staging object, not an error to raise
            log.warning("blobs.upload.leftover", key=self.key, error=describe_error(exc))
