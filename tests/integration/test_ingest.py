"""Ingestion end to end: real Postgres, RabbitMQ, the moto S3 server and local-mode Qdrant.

A file is put as a blob, `ingest.file` runs its four stages on the stack's
worker, and the points are read back from Qdrant through the worker's own
client (local mode: one client per process and path).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobStore
from jobplane.config import Settings
from jobplane.contrib.ingest import HashingEmbedder, Ingest, point_id
from jobplane.contrib.ingest.cli import file_name
from jobplane.contrib.ingest.index import Index, _Client
from jobplane.errors import JobplaneError
from jobplane.topology import Topology
from jobplane.types import EventType, JobState
from tests.faults.cluster import ROOT
from tests.support.documents import generated_text, minimal_pdf
from tests.support.ingest import CORPUS, Ingestion, drop_topology, ingest_topology
from tests.support.stack import eventually, start_stack


@pytest.fixture
async def ingest_topology_names(amqp_url: str) -> AsyncIterator[Topology]:
    names = ingest_topology()
    yield names
    await drop_topology(amqp_url, names)


@pytest.fixture
async def ingestion(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    ingest_topology_names: Topology,
    blobs: BlobStore,
    tmp_path: Path,
) -> AsyncIterator[Ingestion]:
    ingest = Ingest(Settings(qdrant_path=tmp_path / "qdrant"))
    stack = await start_stack(
        engine,
        database_url,
        amqp_url,
        ingest_topology_names,
        registry=ingest.registry,
        blobs=blobs,
        worker_options={"concurrency": 4},
    )
    yield Ingestion(stack, ingest, blobs)
    await stack.close()
    await ingest.close()


@pytest.mark.parametrize(
    ("name", "pages", "chunks"),
    [("notes.txt", 1, 3), ("pipelines.md", 1, 4), ("qdrant.html", 1, 2), ("guide.pdf", 2, 2)],
)
async def test_each_format_end_to_end(
    ingestion: Ingestion, name: str, pages: int, chunks: int
) -> None:
    client = ingestion.stack.client()
    data = (CORPUS / name).read_bytes()
    blob = await client.upload(CORPUS / name)  # through BlobService, as a client does
    job = await client.submit(
        "ingest.file", {"blob": blob.name, "file": name, "chunk_size": 300, "chunk_overlap": 60}
    )
    events = [e async for e in client.watch(job.name)]
    done = await client.get(job.name)
    assert done.state is JobState.SUCCEEDED, done.error
    assert [s.name for s in done.stages] == ["parse", "chunk", "embed", "index"]
    result = done.result
    assert result is not None
    assert (result["pages"], result["chunks"], result["vectors"]) == (pages, chunks, chunks)
    assert result["points"] == result["file_points"] == chunks
    assert result["collection"] == "jobplane_ingest"
    assert result["digest"] == hashlib.sha256(data).hexdigest()
    # Progress per stage carries its counts.
    counts = {
        (e.stage, k): v for e in events if e.type is EventType.PROGRESS for k, v in e.data.items()
    }
    assert counts[("parse", "pages")] == pages
    assert counts[("chunk", "chunks")] == chunks
    # The embed stage fans out: one child per batch of 64 chunks, each end an event.
    assert counts[("embed", "children")] == counts[("embed", "ended")] == result["batches"] == 1
    assert counts[("index", "points")] == chunks
    # The points, as stored.
    points = await ingestion.points(file=name)
    tenant = str(ingestion.stack.tenant_id)
    assert sorted(h.id for h in points) == sorted(
        str(point_id(tenant, name, i, "ingest-2")) for i in range(chunks)
    )
    by_index = sorted(points, key=lambda h: h.payload["chunk_index"])
    text = "".join(h.payload["text"] for h in by_index[:1])
    assert text and by_index[0].payload["start"] == 0
    for hit in by_index:
        payload = hit.payload
        assert payload["tenant_id"] == tenant and payload["file"] == name
        assert payload["digest"] == result["digest"] and payload["version"] == result["version"]
        assert payload["pipeline"] == "ingest.file" and payload["pipeline_version"] == "ingest-2"
        assert payload["embedder"] == "hash:v1:384"
        assert payload["end"] - payload["start"] == len(payload["text"])
    # Big outputs went to blobs; the stage results only name them.
    parse = done.stages[0].result
    assert parse is not None and str(parse["text"]).startswith("blobs/")


async def test_ingesting_the_same_file_again_changes_nothing(ingestion: Ingestion) -> None:
    data = (CORPUS / "pipelines.md").read_bytes()
    first = await ingestion.run("docs/pipelines.md", data, chunk_size=200, chunk_overlap=20)
    assert first.state is JobState.SUCCEEDED, first.error
    before = await ingestion.points(file="docs/pipelines.md")
    index = await ingestion.index()
    vectors_before = await _vectors(ingestion)
    second = await ingestion.run("docs/pipelines.md", data, chunk_size=200, chunk_overlap=20)
    assert second.state is JobState.SUCCEEDED, second.error
    assert second.result is not None and first.result is not None
    assert second.result["version"] == first.result["version"]
    assert await ingestion.points(file="docs/pipelines.md") == before
    # Equal to float32 rounding (local Qdrant normalises cosine vectors as it stores them).
    vectors_after = await _vectors(ingestion)
    assert vectors_after.keys() == vectors_before.keys()
    for key, vector in vectors_after.items():
        assert vector == pytest.approx(vectors_before[key], abs=1e-6)
    assert await index.count(str(ingestion.stack.tenant_id)) == len(before) > 3


async def test_a_changed_file_replaces_its_points_with_no_orphans(ingestion: Ingestion) -> None:
    tenant = str(ingestion.stack.tenant_id)
    long = generated_text(1, 1200).encode()
    short = generated_text(2, 200).encode()
    old = await ingestion.run("report.txt", long, chunk_size=400, chunk_overlap=40)
    assert old.state is JobState.SUCCEEDED, old.error
    assert old.result is not None and old.result["chunks"] > 10
    other = await ingestion.run("other.txt", short, chunk_size=400, chunk_overlap=40)
    assert other.state is JobState.SUCCEEDED
    new = await ingestion.run("report.txt", short, chunk_size=400, chunk_overlap=40)
    assert new.state is JobState.SUCCEEDED, new.error
    assert new.result is not None
    n = new.result["chunks"]
    assert 0 < n < old.result["chunks"]
    points = await ingestion.points(file="report.txt")
    assert sorted(h.id for h in points) == sorted(
        str(point_id(tenant, "report.txt", i, "ingest-2")) for i in range(n)
    )
    assert {h.payload["digest"] for h in points} == {hashlib.sha256(short).hexdigest()}
    assert {h.payload["version"] for h in points} == {new.result["version"]}
    # The other file, with the same content as the new version, is untouched.
    assert len(await ingestion.points(file="other.txt")) == n
    # Chunking differently is a new version too: the points follow it.
    again = await ingestion.run("report.txt", short, chunk_size=100, chunk_overlap=0)
    assert again.result is not None and again.result["chunks"] > n
    assert len(await ingestion.points(file="report.txt")) == again.result["chunks"]


async def test_an_empty_new_version_leaves_the_file_no_points(ingestion: Ingestion) -> None:
    first = await ingestion.run("gone.txt", generated_text(3, 400).encode(), chunk_size=200)
    assert first.state is JobState.SUCCEEDED and len(await ingestion.points(file="gone.txt")) > 1
    empty = await ingestion.run("gone.txt", b"   \n\n  ")
    assert empty.state is JobState.SUCCEEDED, empty.error
    assert empty.result is not None and empty.result["chunks"] == empty.result["points"] == 0
    assert await ingestion.points(file="gone.txt") == []


async def test_search_is_tenant_filtered(ingestion: Ingestion) -> None:
    stack = ingestion.stack
    other_key = await stack.new_key("umbrella")
    other = stack.client(other_key)
    other_tenant = uuid.UUID(
        str(await stack.scalar("SELECT id FROM tenants WHERE name = 'umbrella'"))
    )
    text = (CORPUS / "qdrant.html").read_bytes()
    mine = await ingestion.run("qdrant.html", text)
    theirs = await ingestion.run("qdrant.html", text, client=other, tenant=other_tenant)
    assert mine.state is theirs.state is JobState.SUCCEEDED
    index = await ingestion.index()
    query = HashingEmbedder().embed_one("tenant id filters every query")
    for tenant in (stack.tenant_id, other_tenant):
        hits = await index.search(str(tenant), query, limit=50)
        assert hits and {h.payload["tenant_id"] for h in hits} == {str(tenant)}
    # Same file name, two tenants: two point sets, different ids.
    assert {h.id for h in await ingestion.points()}.isdisjoint(
        {h.id for h in await ingestion.points(other_tenant)}
    )


async def test_another_tenants_blob_is_refused_at_submit(ingestion: Ingestion) -> None:
    stack = ingestion.stack
    await stack.new_key("umbrella")
    other = uuid.UUID(str(await stack.scalar("SELECT id FROM tenants WHERE name = 'umbrella'")))
    theirs = await ingestion.put(b"their words", tenant=other)
    with pytest.raises(JobplaneError) as refused:  # INVALID_ARGUMENT, reason BLOB_NOT_FOUND
        await stack.client().submit("ingest.file", {"blob": theirs, "file": "x.txt"})
    assert refused.value.reason == "BLOB_NOT_FOUND"
    assert await stack.scalar("SELECT count(*) FROM jobs") == 0


@pytest.mark.parametrize(
    ("file", "data", "content_type"),
    [
        ("broken.pdf", minimal_pdf(["x"])[:150], None),
        ("junk.bin", bytes(range(256)) * 64, None),
        ("image.png", b"\x89PNG\r\n\x1a\n", "image/png"),
    ],
)
async def test_an_unparsable_file_fails_at_once(
    ingestion: Ingestion, file: str, data: bytes, content_type: str | None
) -> None:
    extra: dict[str, Any] = {"content_type": content_type} if content_type else {}
    done = await ingestion.run(file, data, **extra)
    assert done.state is JobState.FAILED
    assert done.error is not None and done.error.code == "UNSUPPORTED_FORMAT"
    # What is refused is its type (a name or content type ingestion does not
    # read), or bytes that are not the type they claim: never a text decoding.
    assert "decode" not in done.error.message and "UTF-8" not in done.error.message
    assert "not one ingestion reads" in done.error.message or file == "broken.pdf"
    assert done.stages[0].name == "parse" and done.stages[0].attempts == 1
    assert [s.state.name for s in done.stages[1:]] == ["PENDING"] * 3
    assert await ingestion.points(file=file) == []


async def test_a_bad_payload_fails_at_once(ingestion: Ingestion) -> None:
    blob = await ingestion.put(b"text")
    client = ingestion.stack.client()
    job = await client.submit("ingest.file", {"blob": blob, "file": "a.txt", "chunk_size": 10})
    done = await client.wait(job.name, timeout=20)
    assert done.error is not None and done.error.code == "BAD_PAYLOAD"
    assert "chunk_size" in done.error.message


async def test_a_qdrant_outage_is_retried_and_resumes_at_the_index_stage(
    ingestion: Ingestion, tmp_path: Path
) -> None:
    # Another process holds the local Qdrant's lock (as a second index
    # worker would): the index stage cannot open it, and retries.
    holder = _Client("holder", Settings(qdrant_path=tmp_path / "qdrant"))
    await holder.call("get_collections")
    client = ingestion.stack.client()
    blob = await ingestion.put((CORPUS / "notes.txt").read_bytes())
    job = await client.submit("ingest.file", {"blob": blob, "file": "notes.txt"})

    async def index_failed_once() -> bool:
        got = await client.get(job.name)
        return any(s.name == "index" and s.attempts >= 1 and s.error for s in got.stages)

    await eventually(index_failed_once, timeout=20)
    await holder.close()  # the outage ends
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    index_stage = done.stages[3]
    assert index_stage.attempts >= 2
    # Resumed, not restarted: parse and chunk ran once, and so did the one embed child
    # (the fan-out stage itself never runs: its children do).
    assert [s.attempts for s in done.stages[:3]] == [1, 1, 0]
    children = (await client.list(parent=job.name, page_size=10)).jobs
    assert [c.attempt for c in children] == [1]
    assert done.result is not None and done.result["points"] == 1  # 631 chars, one chunk
    assert len(await ingestion.points(file="notes.txt")) == 1


async def _vectors(ingestion: Ingestion) -> dict[str, list[float]]:
    index = await ingestion.index()
    records, _ = await index._client.call(
        "scroll", collection_name="jobplane_ingest", limit=1000, with_vectors=True
    )
    return {str(r.id): list(r.vector) for r in records}


async def test_the_cli_uploads_ingests_and_prints_the_counts(ingestion: Ingestion) -> None:
    stack = ingestion.stack
    files = [str(CORPUS / "notes.txt"), str(CORPUS / "guide.pdf")]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        "ingest",
        "--address",
        stack.server.address,
        "--api-key",
        stack.key,
        "--chunk-size",
        "300",
        "--chunk-overlap",
        "60",
        *files,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    text = out.decode()
    assert process.returncode == 0, (text, err.decode())
    notes, guide = (file_name(f) for f in files)
    assert f"{notes}: 1 page(s), 3 chunks, 3 vectors, 3 points in jobplane_ingest" in text
    assert f"{guide}: 2 page(s), 2 chunks, 2 vectors, 2 points in jobplane_ingest" in text
    # Each stage's events were shown, with the file they belong to.
    for stage in ("parse", "chunk", "embed", "index"):
        assert f"[{stage}]" in text
    assert len(await ingestion.points(file=notes)) == 3


async def test_the_cli_refuses_a_missing_file(ingestion: Ingestion, tmp_path: Path) -> None:
    stack = ingestion.stack
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        "ingest",
        "--address",
        stack.server.address,
        "--api-key",
        stack.key,
        str(tmp_path / "nope.txt"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    _out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 2
    assert "nope.txt: no such file" in err.decode()


async def test_an_index_stage_whose_points_change_under_it_writes_them_again(
    ingestion: Ingestion, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another index process deleting some of this file's points (its own version's
    delete) between this stage's upsert and its count: the stage retries, so the file
    ends with all the points of one version, not a few missing."""
    real = Index.delete_file_points
    raced: list[str] = []

    async def and_another_process_deletes_one(self: Index, *args: Any, **kwargs: Any) -> None:
        await real(self, *args, **kwargs)
        if not raced:
            [first, *_] = await self.points(str(ingestion.stack.tenant_id), "race.txt")
            raced.append(first.id)
            await self._client.call(
                "delete", collection_name="jobplane_ingest", points_selector=[first.id], wait=True
            )

    monkeypatch.setattr(Index, "delete_file_points", and_another_process_deletes_one)
    done = await ingestion.run("race.txt", generated_text(4, 600).encode(), chunk_size=300)
    assert done.state is JobState.SUCCEEDED, done.error
    assert raced, "the race was not staged"
    assert done.stages[3].attempts == 2
    assert done.result is not None
    assert len(await ingestion.points(file="race.txt")) == done.result["chunks"] > 1
