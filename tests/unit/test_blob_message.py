"""The Blob message the BlobService answers with for a stored blob."""

from __future__ import annotations

from datetime import UTC, datetime

from jobplane.blobs.reader import BlobInfo
from jobplane.server.blob_servicer import blob_to_pb

DIGEST = "ab" * 32


def test_a_blob_message_carries_every_field_and_its_creation_time() -> None:
    created = datetime(2026, 3, 4, 5, 6, 7, 250_000, tzinfo=UTC)
    info = BlobInfo(f"blobs/{DIGEST}", DIGEST, 1234, "text/csv", created)
    message = blob_to_pb(info)
    assert (message.name, message.sha256, message.size, message.content_type) == (
        f"blobs/{DIGEST}",
        DIGEST,
        1234,
        "text/csv",
    )
    assert message.HasField("create_time")
    assert message.create_time.ToDatetime(tzinfo=UTC) == created


def test_a_blob_without_a_known_creation_time_has_none() -> None:
    message = blob_to_pb(BlobInfo(f"blobs/{DIGEST}", DIGEST, 0))
    assert not message.HasField("create_time")
    assert (message.size, message.content_type) == (0, "")
