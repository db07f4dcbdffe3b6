"""Object storage by reference: blobs named ``blobs/{sha256}``, per tenant (ADR-0020).

The store (and aioboto3) is imported on first use of one of its names, so
that :mod:`jobplane.blobs.names` and :mod:`jobplane.blobs.reader` cost the SDK
and the worker install nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobplane.blobs.names import BLOB_NAME_PATTERN, blob_name, is_blob_name, parse_blob_name
from jobplane.blobs.reader import BlobInfo, BlobReader
from jobplane.errors import (
    BlobInUse,
    BlobNotFound,
    BlobsDisabled,
    BlobSizeMismatch,
    BlobStoreUnavailable,
    BlobTooLarge,
    DigestMismatch,
)

if TYPE_CHECKING:
    from jobplane.blobs.store import PART_BYTES, BlobStore

_FROM_STORE = frozenset({"PART_BYTES", "BlobStore"})


def __getattr__(name: str) -> Any:
    if name in _FROM_STORE:
        from jobplane.blobs import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
