"""Object storage by reference: blobs named ``blobs/{sha256}``, per tenant (ADR-0020)."""

from __future__ import annotations

from jobplane.blobs.names import BLOB_NAME_PATTERN, blob_name, is_blob_name, parse_blob_name
from jobplane.blobs.store import PART_BYTES, BlobInfo, BlobReader, BlobStore
from jobplane.errors import (
    BlobInUse,
    BlobNotFound,
    BlobsDisabled,
    BlobSizeMismatch,
    BlobStoreUnavailable,
    BlobTooLarge,
    DigestMismatch,
)

__all__ = [
    "BLOB_NAME_PATTERN",
    "PART_BYTES",
    "BlobInUse",
    "BlobInfo",
    "BlobNotFound",
    "BlobReader",
    "BlobSizeMismatch",
    "BlobStore",
    "BlobStoreUnavailable",
    "BlobTooLarge",
    "BlobsDisabled",
    "DigestMismatch",
    "blob_name",
    "is_blob_name",
    "parse_blob_name",
]
