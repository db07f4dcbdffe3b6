"""Blob names and the object-storage settings."""

from __future__ import annotations

import pytest

from jobplane.blobs.names import blob_name, is_blob_name, parse_blob_name, referenced_digests
from jobplane.config import ConfigError, Settings

DIGEST = "ab" * 32


def test_parse_blob_name() -> None:
    assert parse_blob_name(f"blobs/{DIGEST}") == DIGEST
    assert blob_name(DIGEST) == f"blobs/{DIGEST}"
    for bad in [
        DIGEST,
        f"blobs/{DIGEST.upper()}",
        f"blobs/{DIGEST}\n",
        f"blobs/{DIGEST[:-1]}",
        f"blobs/{DIGEST}0",
        f"jobs/{DIGEST}",
        "",
        None,
    ]:
        with pytest.raises(ValueError, match="blob"):
            parse_blob_name(bad)  # type: ignore[arg-type]
        assert not is_blob_name(bad)


def test_referenced_digests() -> None:
    other = "cd" * 32
    payload = {
        "a": f"blobs/{DIGEST}",
        "b": [1, {"c": f"blobs/{other}"}, f"blobs/{DIGEST}"],
        f"blobs/{'ef' * 32}": "keys are not references",
        "d": f"see blobs/{DIGEST}",
    }
    assert referenced_digests(payload) == {DIGEST, other}


def test_s3_settings() -> None:
    settings = Settings.from_env({})
    assert not settings.blobs_enabled
    assert (settings.s3_bucket, settings.s3_region, settings.inline_bytes) == (
        "jobplane",
        "us-east-1",
        64 * 1024,
    )
    env = {
        "JOBPLANE_S3_URL": "http://minio:9000",
        "JOBPLANE_S3_BUCKET": "my-bucket",
        "JOBPLANE_S3_ACCESS_KEY_ID": "id",
        "JOBPLANE_S3_SECRET_ACCESS_KEY": "secret",
        "JOBPLANE_S3_PREFIX": "jp/",
        "JOBPLANE_MAX_BLOB_BYTES": str(10 * 1024**3),
        "JOBPLANE_INLINE_BYTES": "1000",
    }
    settings = Settings.from_env(env)
    assert settings.blobs_enabled and settings.s3_url == "http://minio:9000"
    assert (settings.s3_prefix, settings.max_blob_bytes, settings.inline_bytes) == (
        "jp/",
        10 * 1024**3,
        1000,
    )
    assert "secret" not in repr(settings)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("JOBPLANE_S3_URL", "minio:9000", "JOBPLANE_S3_URL"),
        ("JOBPLANE_S3_URL", "ftp://minio", "JOBPLANE_S3_URL"),
        ("JOBPLANE_S3_URL", "http://minio:99999", "port"),
        ("JOBPLANE_S3_BUCKET", "My_Bucket", "JOBPLANE_S3_BUCKET"),
        ("JOBPLANE_S3_BUCKET", "ab", "JOBPLANE_S3_BUCKET"),
        ("JOBPLANE_S3_ACCESS_KEY_ID", "only-one", "go together"),
        ("JOBPLANE_S3_PREFIX", "/abs", "JOBPLANE_S3_PREFIX"),
        ("JOBPLANE_MAX_BLOB_BYTES", "0", "JOBPLANE_MAX_BLOB_BYTES"),
        ("JOBPLANE_MAX_BLOB_BYTES", str(6 * 1024**4), "5 TiB"),
        ("JOBPLANE_INLINE_BYTES", "lots", "JOBPLANE_INLINE_BYTES"),
        ("JOBPLANE_INLINE_BYTES", str(1024 * 1024), "JOBPLANE_MAX_PAYLOAD_BYTES"),
    ],
)
def test_bad_s3_settings_are_refused(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_env({name: value})


def test_the_inline_limit_follows_a_smaller_payload_limit() -> None:
    assert Settings.from_env({"JOBPLANE_MAX_PAYLOAD_BYTES": "1024"}).inline_bytes == 1024
