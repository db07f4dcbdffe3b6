"""Ingestion under worker kills: a worker dies at a named point of each stage in turn.

One upload of a file that replaces an earlier, longer version of it goes
through five worker processes, each killed (``os._exit``, as SIGKILL) at
the next crash point: after the parse stage stored its text, after the
chunk stage stored its batches, after an embed child's first vectors, after the
new points were upserted (the old version's extra chunks still there), and
after the old points were deleted (the stage's result not yet committed).
A sixth worker finishes it. The file's final point set must be the one an
uninterrupted run of the same bytes leaves: the same chunks, texts, spans,
versions and vectors, ids uuid5(tenant, file, chunk, pipeline version), and
not one point of the old version left.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobStore
from jobplane.config import Settings
from jobplane.contrib.ingest import Hit, open_index, point_id
from jobplane.types import JobState
from tests.faults.cluster import Cluster, Proc
from tests.support import services
from tests.support.documents import generated_text
from tests.support.ingest import ingest_topology
from tests.support.s3 import MotoServer, blob_store

CRASH_POINTS = (
    "ingest.parse.stored",
    "ingest.chunk.stored",
    "ingest.embed.batch",
    "ingest.index.upserted",
    "ingest.index.deleted",
)
OPTIONS = {"chunk_size": 300, "chunk_overlap": 50}


@pytest.fixture
async def ingest_cluster(
    database_url: str,
    amqp_url: str,
    engine: AsyncEngine,
    moto: MotoServer,
    tmp_path: Path,
) -> AsyncIterator[tuple[Cluster, BlobStore]]:
    topology = ingest_topology()
    store = blob_store(engine, moto.url)
    cluster = Cluster(database_url, amqp_url, topology, tmp_path)
    cluster.env.update(
        {
            "JOBPLANE_S3_URL": moto.url,
            "JOBPLANE_S3_BUCKET": store.bucket,
            "JOBPLANE_S3_ACCESS_KEY_ID": "testing",
            "JOBPLANE_S3_SECRET_ACCESS_KEY": "testing",
            "JOBPLANE_QDRANT_PATH": str(tmp_path / "qdrant"),
        }
    )
    await cluster.prepare()
    yield cluster, store
    await cluster.close()
    await store.close()
    await services.delete_topology(amqp_url, topology)


async def _worker(cluster: Cluster, faults: str = "") -> Proc:
    args = ["worker", "--handlers", "jobplane.contrib.ingest:registry"]
    args += ["--lease-seconds", "1", "--grace", "1", "--concurrency", "2"]
    proc = Proc(cluster, args, faults)
    cluster.procs.append(proc)
    return await proc.start(ready="worker.started")


async def test_a_worker_killed_at_each_stage_leaves_the_points_of_an_uninterrupted_run(
    ingest_cluster: tuple[Cluster, BlobStore], tmp_path: Path
) -> None:
    cluster, store = ingest_cluster
    rows = await cluster.query("SELECT id FROM tenants WHERE name = 'faults'")
    tenant = uuid.UUID(str(rows[0]["id"]))
    old, new = generated_text(1, 900).encode(), generated_text(2, 250).encode()
    await cluster.server()
    await cluster.relay()

    async with cluster.client() as client:

        async def ingest(file: str, data: bytes) -> str:
            info = await store.put_bytes(tenant, data, content_type="text/plain")
            job = await client.submit("ingest.file", {"blob": info.name, "file": file, **OPTIONS})
            return job.name

        async def finished(name: str) -> Any:
            try:
                done = await client.wait(name, timeout=60)
            except TimeoutError:
                job = await client.get(name)
                stages = [(s.name, s.state.name, s.attempts, s.error) for s in job.stages]
                job_id = uuid.UUID(job.name.partition("/")[2])
                rows = await cluster.query(
                    "SELECT j.state, j.attempt, j.dispatch_id, j.lease_expires_at, now() AS now, "
                    "(SELECT json_agg(json_build_object('id', o.id, 'due', o.available_at, "
                    "'published', o.published_at, 'error', o.last_error)) FROM outbox o "
                    "WHERE o.job_id = j.id) AS outbox FROM jobs j WHERE j.id = $1",
                    job_id,
                )
                raise AssertionError(
                    f"{name} did not end: {job.state.name} {stages} {[dict(r) for r in rows]}"
                ) from None
            assert done.state is JobState.SUCCEEDED, done.error
            return done

        clean = await _worker(cluster)
        for file in ("ref.txt", "doc.txt"):
            await finished(await ingest(file, old))
        reference = await finished(await ingest("ref.txt", new))
        clean.kill()
        await clean.wait()

        name = await ingest("doc.txt", new)
        for point in CRASH_POINTS:
            crashing = await _worker(cluster, faults=f"crash:{point}")
            try:
                code = await crashing.wait(timeout=30)
            except TimeoutError:
                job = await client.get(name)
                stages = [(s.name, s.state.name, s.attempts) for s in job.stages]
                raise AssertionError(f"no crash at {point}: {job.state.name} {stages}") from None
            assert code == 137, f"{point}: exit {code}"
        last = await _worker(cluster)
        done = await finished(name)
        page = await client.list(parent=name, page_size=100)
        children = [c.attempt for c in page.jobs]
        last.kill()
        await last.wait()

    # Every stage was killed at least once and run again (the embed stage in
    # one of its children: the fan-out stage itself never runs).
    attempts = {s.name: s.attempts for s in done.stages}
    assert attempts["parse"] >= 2 and attempts["chunk"] >= 2 and attempts["index"] >= 3
    assert max(children) >= 2, children
    assert done.result["version"] == reference.result["version"]

    async with open_index(Settings(qdrant_path=tmp_path / "qdrant")) as index:
        doc = await index.points(str(tenant), "doc.txt")
        ref = await index.points(str(tenant), "ref.txt")
        vectors = await _vectors(index, [h.id for h in doc + ref])
    n = reference.result["chunks"]
    assert len(ref) == n and len(doc) == n, (len(ref), len(doc), n)  # no orphan, no duplicate
    assert sorted(h.id for h in doc) == sorted(
        str(point_id(str(tenant), "doc.txt", i, "ingest-2")) for i in range(n)
    )
    by_chunk = {h.payload["chunk_index"]: h for h in ref}
    for hit in doc:
        twin = by_chunk[hit.payload["chunk_index"]]
        assert _content(hit) == _content(twin)
        assert vectors[hit.id] == pytest.approx(vectors[twin.id], abs=1e-6)


def _content(hit: Hit) -> dict[str, Any]:
    return {k: v for k, v in hit.payload.items() if k != "file"}


async def _vectors(index: Any, ids: list[str]) -> dict[str, list[float]]:
    records = await index._client.call(
        "retrieve", collection_name=index.collection, ids=ids, with_vectors=True
    )
    return {str(r.id): list(r.vector) for r in records}
