"""The embed stage of ``ingest.file`` fans out: its batches embed on two workers at once.

Real Postgres, RabbitMQ, the moto S3 server and local-mode Qdrant. One
document of several batches is ingested first with one worker, then (into
another collection) with a second worker that takes only the embed queue:
both runs must leave the same points, and in the second the two workers
must have embedded batches at the same time. A job of the pipeline's
previous version (``ingest-1``, no fan-out: its stages frozen at submit)
still runs on the same handlers.
"""

from __future__ import annotations

import threading
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobStore
from jobplane.config import Settings
from jobplane.contrib.ingest import HashingEmbedder, Ingest, point_id
from jobplane.topology import Topology
from jobplane.topology.parse import parse_topology
from jobplane.types import JobState
from tests.support.documents import generated_text
from tests.support.ingest import Ingestion, drop_topology, ingest_topology
from tests.support.stack import start_stack

SHIPPED = resources.files("jobplane").joinpath("topologies/ingest.toml")

BATCH = 4
OPTIONS: dict[str, Any] = {"chunk_size": 200, "chunk_overlap": 20}


@dataclass
class TimedEmbedder:
    """The hashing embedder, taking ``seconds`` a call (a remote API's latency), and
    recording when each call ran."""

    seconds: float
    calls: list[tuple[float, float]] = field(default_factory=list)
    inner: HashingEmbedder = field(default_factory=HashingEmbedder)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def dim(self) -> int:
        return self.inner.dim

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        start = time.monotonic()
        time.sleep(self.seconds)
        rows = self.inner.embed(texts)
        with self.lock:
            self.calls.append((start, time.monotonic()))
        return rows


@pytest.fixture
async def topology(amqp_url: str) -> AsyncIterator[Topology]:
    names = ingest_topology()
    yield names
    await drop_topology(amqp_url, names)


async def test_two_workers_embed_the_batches_in_parallel_and_index_the_same_points(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    blobs: BlobStore,
    tmp_path: Path,
) -> None:
    settings = Settings(qdrant_path=tmp_path / "qdrant", ingest_batch=BATCH)
    first, second = TimedEmbedder(0.3), TimedEmbedder(0.3)
    ingest = Ingest(settings, embedder=first)
    helper = Ingest(settings, embedder=second)  # never opens Qdrant: embed queue only
    stack = await start_stack(engine, database_url, amqp_url, topology, worker=False, blobs=blobs)
    try:
        await stack.start_worker(ingest.registry, concurrency=1)
        ingestion = Ingestion(stack, ingest, blobs)
        data = generated_text(7, 700).encode()
        serial = await ingestion.run("doc.txt", data, collection="serial", **OPTIONS)
        assert serial.state is JobState.SUCCEEDED, serial.error
        assert serial.result is not None
        chunks, batches = serial.result["chunks"], serial.result["batches"]
        assert batches == -(-chunks // BATCH) >= 4, serial.result
        assert not second.calls

        embed_queue = [q.name for q in topology.queues if q.takes("ingest.embed")]
        await stack.start_worker(helper.registry, concurrency=1, queues=embed_queue)
        first.calls.clear()
        parallel = await ingestion.run("doc.txt", data, collection="parallel", **OPTIONS)
        assert parallel.state is JobState.SUCCEEDED, parallel.error
        assert parallel.result is not None
        assert parallel.result["version"] == serial.result["version"]
        assert (parallel.result["chunks"], parallel.result["batches"]) == (chunks, batches)

        # Each child embedded its batch once, on one worker or the other, both busy.
        assert len(first.calls) + len(second.calls) == batches
        assert first.calls and second.calls
        assert any(
            a_start < b_end and b_start < a_end
            for a_start, a_end in first.calls
            for b_start, b_end in second.calls
        ), (first.calls, second.calls)
        children = (await stack.client().list(parent=parallel.name, page_size=100)).jobs
        assert len(children) == batches
        assert all(c.state is JobState.SUCCEEDED and c.type == "ingest.embed" for c in children)

        # The same points either way: ids, payloads, vectors.
        tenant = str(stack.tenant_id)
        index = await ingestion.index()
        one = await index.points(tenant, "doc.txt", collection="serial")
        two = await index.points(tenant, "doc.txt", collection="parallel")
        assert (
            [h.id for h in one]
            == [h.id for h in two]
            == sorted(str(point_id(tenant, "doc.txt", i, "ingest-2")) for i in range(chunks))
        )
        assert [h.payload for h in one] == [h.payload for h in two]
        assert await _vectors(index, "serial") == await _vectors(index, "parallel")
        by_chunk = sorted(two, key=lambda h: h.payload["chunk_index"])
        text = data.decode()
        assert all(
            text[h.payload["start"] : h.payload["end"]] == h.payload["text"] for h in by_chunk
        )
    finally:
        await stack.close()
        await ingest.close()
        await helper.close()


async def _vectors(index: Any, collection: str) -> dict[str, list[float]]:
    records, _ = await index._client.call(
        "scroll", collection_name=collection, limit=1000, with_vectors=True
    )
    return {str(r.id): [round(x, 6) for x in r.vector] for r in records}


@pytest.fixture
async def ingest_1(amqp_url: str) -> AsyncIterator[Topology]:
    """The shipped ingest topology as it was at ``ingest-1``: no fan-out."""
    text = SHIPPED.read_text()
    assert 'version = "ingest-2"' in text and "fan_out = true" in text
    lines = [line for line in text.splitlines() if not line.startswith(("fan_out", "fail_fast"))]
    old = "\n".join(lines).replace('version = "ingest-2"', 'version = "ingest-1"')
    names = parse_topology(tomllib.loads(old)).prefixed(f"i{uuid.uuid4().hex[:8]}.")
    yield names
    await drop_topology(amqp_url, names)


async def test_a_job_of_ingest_1_still_runs_its_embed_stage_whole(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    ingest_1: Topology,
    blobs: BlobStore,
    tmp_path: Path,
) -> None:
    ingest = Ingest(Settings(qdrant_path=tmp_path / "qdrant", ingest_batch=BATCH))
    stack = await start_stack(
        engine, database_url, amqp_url, ingest_1, registry=ingest.registry, blobs=blobs
    )
    try:
        ingestion = Ingestion(stack, ingest, blobs)
        done = await ingestion.run("old.txt", generated_text(8, 300).encode(), **OPTIONS)
        assert done.state is JobState.SUCCEEDED, done.error
        assert done.pipeline_version == "ingest-1" and done.result is not None
        chunks = done.result["chunks"]
        assert chunks > BATCH and done.result["batches"] == 1
        chunk, embed = done.stages[1].result, done.stages[2].result
        assert chunk is not None and str(chunk["spans"]).startswith("blobs/")
        assert embed is not None and embed["vectors"] == chunks
        assert (await stack.client().list(parent=done.name)).jobs == []
        tenant = str(stack.tenant_id)
        points = await ingestion.points(file="old.txt")
        assert [h.id for h in points] == sorted(
            str(point_id(tenant, "old.txt", i, "ingest-1")) for i in range(chunks)
        )
    finally:
        await stack.close()
        await ingest.close()
