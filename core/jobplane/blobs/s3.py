"""The blob store's S3 side: the client's set-up, the bucket made on first use,
and S3's failures as :class:`~jobplane.errors.BlobStoreUnavailable`.

S3 (or an S3-compatible server: MinIO) is reached through aioboto3, imported
only by the store (see :mod:`jobplane.blobs`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import structlog
from aiohttp import ClientError as HTTPClientError
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from jobplane.blobs.reader import BlobReader
from jobplane.errors import BlobStoreUnavailable
from jobplane.logs import describe_error

if TYPE_CHECKING:
    from types_aiobotocore_s3 import S3Client

log = structlog.get_logger("jobplane.blobs")

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


def unavailable(exc: BaseException) -> BlobStoreUnavailable:
    """The error to raise for an S3 failure."""
    return BlobStoreUnavailable(f"the object store is unavailable: {describe_error(exc)}")


#: What a call to S3 raises when S3 is down, slow or refuses: all retryable.
S3_DOWN: tuple[type[BaseException], ...] = (
    BotoCoreError,
    HTTPClientError,
    OSError,
    asyncio.TimeoutError,
)


def not_found(exc: ClientError) -> bool:
    """Whether S3 answered that the key (or bucket) does not exist."""
    return str(exc.response.get("Error", {}).get("Code", "")) in _NOT_FOUND_CODES


@contextlib.asynccontextmanager
async def s3_errors() -> AsyncIterator[None]:
    """S3's failures as :class:`BlobStoreUnavailable` (a missing key is the caller's to map)."""
    try:
        yield
    except ClientError as exc:
        if not_found(exc):
            raise
        raise unavailable(exc) from exc
    except S3_DOWN as exc:
        raise unavailable(exc) from exc


class S3Reader(BlobReader):
    """A :class:`BlobReader` of an S3 body: S3's failures as :class:`BlobStoreUnavailable`."""

    async def read(self, n: int = -1) -> bytes:
        async with s3_errors():
            return await super().read(n)


def client_config() -> Config:
    """The S3 client's pool, timeouts, retries and checksums."""
    return Config(
        # Each open download and upload holds one (the server caps
        # them per tenant); botocore's default of 10 is too few.
        max_pool_connections=64,
        connect_timeout=5,
        read_timeout=60,
        retries={"max_attempts": 3, "mode": "standard"},
        s3={"addressing_style": "path"},
        # Checksums only where S3 requires them: MinIO and other
        # S3-compatible servers do not all accept the newer ones.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


async def ensure_bucket(s3: S3Client, bucket: str, region: str, prefix: str) -> None:
    """Make ``bucket`` when missing, with the rule that expires abandoned uploads."""
    async with s3_errors():
        try:
            await s3.head_bucket(Bucket=bucket)
        except ClientError as exc:
            if not not_found(exc):
                raise
        else:
            return
        try:
            if region == "us-east-1":
                await s3.create_bucket(Bucket=bucket)
            else:
                await s3.create_bucket(
                    Bucket=bucket,
                    CreateBucketConfiguration={"LocationConstraint": region},  # type: ignore[typeddict-item]
                )
            log.info("blobs.bucket.created", bucket=bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise
            return
        await _expire_abandoned_uploads(s3, bucket, prefix)


async def _expire_abandoned_uploads(s3: S3Client, bucket: str, prefix: str) -> None:
    """On a bucket this store made: abort multipart uploads left unfinished for a day.

    A server that dies mid-upload cannot abort its upload; the object store
    would keep its parts (and bill them) for ever. A bucket made elsewhere
    keeps the lifecycle rules its owner gave it (docs: ADR-0020).
    """
    try:
        await s3.put_bucket_lifecycle_configuration(
            Bucket=bucket,
            LifecycleConfiguration={
                "Rules": [
                    {
                        "ID": "jobplane-abort-abandoned-uploads",
                        "Status": "Enabled",
                        "Filter": {"Prefix": prefix},
                        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
                    }
                ]
            },
        )
    except ClientError as exc:  # a server without lifecycle rules: uploads still work
        log.warning("blobs.bucket.lifecycle_refused", bucket=bucket, error=str(exc))
