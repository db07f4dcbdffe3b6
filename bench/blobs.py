"""Blob figures: upload and download MiB/s through jobplane, beside the S3
server's own (aioboto3 straight to it, the same file and part size)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
import uuid
from pathlib import Path
from typing import Any

import aioboto3
from botocore.config import Config
from botocore.exceptions import ClientError

from jobplane.blobs.store import PART_BYTES
from jobplane.client import AsyncClient

MiB = 1024 * 1024


def s3_env(url: str, bucket: str) -> dict[str, str]:
    """What the jobplane processes need to store blobs at ``url``."""
    return {
        "JOBPLANE_S3_URL": url,
        "JOBPLANE_S3_BUCKET": bucket,
        "JOBPLANE_S3_ACCESS_KEY_ID": os.environ.get("JOBPLANE_S3_ACCESS_KEY_ID", "bench"),
        "JOBPLANE_S3_SECRET_ACCESS_KEY": os.environ.get("JOBPLANE_S3_SECRET_ACCESS_KEY", "bench"),
    }


def write_file(path: Path, size: int) -> None:
    """``size`` random bytes (random: nothing on the way may compress them)."""
    with path.open("wb") as f:
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))


async def through_jobplane(address: str, key: str, path: Path) -> tuple[float, float]:
    """Seconds to upload ``path`` with the SDK, and to download it back to a file."""
    async with AsyncClient(address, key, timeout=600) as client:
        started = time.perf_counter()
        blob = await client.upload(path)
        uploaded = time.perf_counter() - started
        started = time.perf_counter()
        await client.download(blob.name, path.with_suffix(".out"))
        downloaded = time.perf_counter() - started
        await client.delete_blob(blob.name)
    return uploaded, downloaded


async def straight_to_s3(env: dict[str, str], path: Path) -> tuple[float, float]:
    """The same through aioboto3 alone: a multipart upload of the same parts, one
    after another as jobplane sends them, then a streamed GET into a file."""
    session = aioboto3.Session()
    key = f"bench/raw/{uuid.uuid4()}"
    client: Any = session.client(
        "s3",
        endpoint_url=env["JOBPLANE_S3_URL"],
        region_name="us-east-1",
        aws_access_key_id=env["JOBPLANE_S3_ACCESS_KEY_ID"],
        aws_secret_access_key=env["JOBPLANE_S3_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}),
    )
    bucket = env["JOBPLANE_S3_BUCKET"]
    async with client as s3:
        with contextlib.suppress(ClientError):  # it exists (jobplane made it, or someone)
            await s3.create_bucket(Bucket=bucket)
        started = time.perf_counter()
        hasher = hashlib.sha256()  # jobplane hashes every byte too
        created = await s3.create_multipart_upload(Bucket=bucket, Key=key)
        parts = []
        with path.open("rb") as f:
            number = 1
            while part := f.read(PART_BYTES):
                hasher.update(part)
                sent = await s3.upload_part(
                    Bucket=bucket,
                    Key=key,
                    UploadId=created["UploadId"],
                    PartNumber=number,
                    Body=part,
                )
                parts.append({"PartNumber": number, "ETag": sent["ETag"]})
                number += 1
        await s3.complete_multipart_upload(
            Bucket=bucket,
            Key=key,
            UploadId=created["UploadId"],
            MultipartUpload={"Parts": parts},
        )
        uploaded = time.perf_counter() - started
        started = time.perf_counter()
        got = await s3.get_object(Bucket=bucket, Key=key)
        with path.with_suffix(".raw").open("wb") as out:
            async for chunk in got["Body"].iter_chunks(MiB):
                out.write(chunk)
        downloaded = time.perf_counter() - started
        await s3.delete_object(Bucket=bucket, Key=key)
    return uploaded, downloaded
