"""The fan-out figure (`--only ingest-fanout`): one long PDF, embedded by 1 and by 2 workers.

``ingest.file`` embeds a file's chunks in child jobs, one per batch of 64
(ADR-0047, docs/ingestion.md): workers that take ``ingest.embed`` embed the
batches of one file side by side. Every process restarts on the built-in
ingest topology with the bench's object store and local-mode Qdrant: one
worker for parse, chunk and index (one process per Qdrant path), and one,
then two, workers of ``--concurrency 1`` for the embed queue. The embedder
is the hashing one behind a remote API's latency (bench/ingest_handlers.py,
``--fanout-ms-per-chunk``): waiting, which parallel workers overlap, not a
model's CPU, which two cores would cap. A PDF of ``--fanout-pages`` pages
is ingested with one embed worker into one collection, then with two into
another (after a warm-up ingestion of a small file into each, so that the
first run does not pay alone for imports, Qdrant's opening and the
collections' creation); the figures are each run's end to end time, its embed stage's span
(first child's start to last child's end), the speed-up, and whether both
collections hold the same points (ids, payloads, vectors).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobplane.blobs import BlobStore
from jobplane.client import AsyncClient
from jobplane.config import Settings
from jobplane.contrib.ingest import open_index
from jobplane.store.engine import create_engine
from tests.support.documents import generated_text, minimal_pdf

if TYPE_CHECKING:
    from bench.run import Bench

INGEST = "ingest.file"
FILE = "bench/handbook.pdf"
WARM_UP = "bench/warm-up.txt"
HANDLERS = ("--handlers", "bench.ingest_handlers:registry")
#: Words per page: about a printed page's.
PAGE_WORDS = 450


async def fig_ingest_fanout(bench: Bench) -> None:
    """One PDF's ingestion with 1 and with 2 embed workers (see the module's docstring)."""
    from bench.run import Figure

    args = bench.args
    if not bench.s3_env:
        await asyncio.to_thread(bench.use_s3)
    await bench.stop_all()
    saved = dict(bench.extra_env)
    qdrant = bench.workdir / "qdrant-fanout"
    bench.extra_env = {
        **saved,
        "JOBPLANE_TOPOLOGY": "builtin:ingest",
        "JOBPLANE_QDRANT_PATH": str(qdrant),
        "BENCH_EMBED_MS_PER_CHUNK": str(args.fanout_ms_per_chunk),
    }
    pages = [generated_text(i, PAGE_WORDS) for i in range(args.fanout_pages)]
    data = minimal_pdf(pages)
    runs: dict[int, dict[str, Any]] = {}
    try:
        blob = await _put(bench, data, "application/pdf")
        small = await _put(bench, generated_text(0, 2000).encode(), "text/plain")
        await bench.start("server", "serve")
        await bench.start("relay", "relay")
        queues = ("--queue", "ingest.parse", "--queue", "ingest.chunk", "--queue", "ingest.index")
        await bench.start("ingest-worker", "worker", *HANDLERS, *queues)
        for workers in (1, 2):
            await bench.start(
                f"embed-worker{workers}",
                "worker",
                *HANDLERS,
                *("--queue", "ingest.embed", "--concurrency", "1"),
            )
            if workers == 1:  # the first run's costs: imports, Qdrant's open, the collections
                for collection in ("bench_embed_1", "bench_embed_2"):
                    await _ingest(bench, small, collection, WARM_UP)
            runs[workers] = await _ingest(bench, blob, f"bench_embed_{workers}", FILE)
        await bench.stop_all()  # the index worker holds the Qdrant path
        same = await _same_points(qdrant, str(bench.tenant))
    finally:
        await bench.stop_all()
        bench.extra_env = saved
        await bench.start_all()
    one, two = runs[1], runs[2]
    config = {
        "pages": args.fanout_pages,
        "bytes": len(data),
        "chunks": one["chunks"],
        "batches": one["batches"],
        "embedder": f"hash:v1:384 + {args.fanout_ms_per_chunk:g} ms/chunk of waiting",
        "embed_worker_concurrency": 1,
        "same_points": same,
    }
    for workers, run in runs.items():
        bench.add(Figure(f"ingest_fanout_e2e_{workers}w", run["e2e"], "s", config))
        bench.add(Figure(f"ingest_fanout_embed_{workers}w", run["embed"], "s", config))
    bench.add(Figure("ingest_fanout_speedup_e2e", one["e2e"] / two["e2e"], "x", config))
    bench.add(Figure("ingest_fanout_speedup_embed", one["embed"] / two["embed"], "x", config))
    bench.notes.append(
        f"ingest-fanout: a {args.fanout_pages}-page PDF, {one['chunks']} chunks in "
        f"{one['batches']} batches; end to end {one['e2e']:.1f} s with 1 embed worker, "
        f"{two['e2e']:.1f} s with 2 ({one['e2e'] / two['e2e']:.2f}x; embed stage "
        f"{one['embed']:.1f} s vs {two['embed']:.1f} s, {one['embed'] / two['embed']:.2f}x); "
        f"same points either way: {same}. The embedder waits "
        f"{args.fanout_ms_per_chunk:g} ms a chunk, standing for a remote embedding API's "
        "latency: what parallel workers overlap (a CPU-bound model gains at most the cores)."
    )


async def _put(bench: Bench, data: bytes, content_type: str) -> str:
    s3 = bench.s3_env
    engine = create_engine(bench.database_url, pool_size=2)
    store = BlobStore(
        engine,
        url=s3["JOBPLANE_S3_URL"],
        bucket=s3["JOBPLANE_S3_BUCKET"],
        access_key_id=s3["JOBPLANE_S3_ACCESS_KEY_ID"],
        secret_access_key=s3["JOBPLANE_S3_SECRET_ACCESS_KEY"],
    )
    try:
        info = await store.put_bytes(bench.tenant, data, content_type=content_type)
        return info.name
    finally:
        await store.close()
        await engine.dispose()


async def _ingest(bench: Bench, blob: str, collection: str, file: str) -> dict[str, Any]:
    """One ingestion of ``blob`` as ``file`` into ``collection``: its times and counts."""
    from bench.run import wait_ready

    async with AsyncClient(bench.address, bench.key) as client:
        await wait_ready(client)
        await asyncio.sleep(1.0)  # workers declare and consume
        started = time.monotonic()
        job = await client.submit(INGEST, {"blob": blob, "file": file, "collection": collection})
        done = await client.wait(job.name, timeout=3600)
        e2e = time.monotonic() - started
    if done.state.value != "succeeded" or done.result is None:
        raise RuntimeError(f"the ingestion into {collection} failed: {done.error}")
    rows = await bench.sql(
        "SELECT extract(epoch FROM max(end_time) - min(start_time)) AS s FROM jobs "
        "WHERE parent_id = $1",
        uuid.UUID(job.id),
    )
    return {
        "e2e": e2e,
        "embed": float(rows[0]["s"]),
        "chunks": int(done.result["chunks"]),
        "batches": int(done.result["batches"]),
    }


async def _same_points(qdrant: Path, tenant: str) -> bool:
    """Whether both runs' collections hold the same points: ids, payloads and vectors."""
    async with open_index(Settings(qdrant_path=qdrant)) as index:
        found = []
        for workers in (1, 2):
            name = f"bench_embed_{workers}"
            points = await index.points(tenant, FILE, collection=name)
            records = await index._client.call(
                "retrieve", collection_name=name, ids=[p.id for p in points], with_vectors=True
            )
            vectors = {str(r.id): [round(x, 6) for x in r.vector] for r in records}
            found.append(([(p.id, p.payload) for p in points], vectors))
    return bool(found[0][0]) and found[0] == found[1]
