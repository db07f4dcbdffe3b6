"""The ingestion figures (`--only ingest`): chunks/s and vectors/s of ``ingest.file``, per stage.

Every process restarts on the built-in ingest topology with the bench's
object store (``$JOBPLANE_S3_URL``, else a moto server) and local-mode
Qdrant in the bench's work directory: one worker for the parse, chunk and
embed queues (``--concurrency``) and one for the index queue (local mode:
one process per path). ``--ingest-docs`` generated
documents of ``--ingest-words`` words are put as blobs, submitted at once,
and the figures come from the stage rows' times: per stage, its chunks over
the span from its first start to its last end (the stage's throughput when
the queue before it keeps it busy), and end to end, from the first submit
to the last end.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from jobplane.blobs import BlobStore
from jobplane.client import AsyncClient
from jobplane.store.engine import create_engine
from tests.support.documents import generated_text

if TYPE_CHECKING:
    from bench.run import Bench

INGEST = "ingest.file"
STAGES = ("parse", "chunk", "embed", "index")


async def fig_ingest(bench: Bench) -> None:
    """Ingestion throughput per stage and end to end (see the module's docstring)."""
    from bench.run import Figure, wait_ready

    docs, words = bench.args.ingest_docs, bench.args.ingest_words
    if not bench.s3_env:
        await asyncio.to_thread(bench.use_s3)  # $JOBPLANE_S3_URL, else a moto_server
    await bench.stop_all()
    saved = dict(bench.extra_env)
    bench.extra_env = {
        **saved,
        "JOBPLANE_TOPOLOGY": "builtin:ingest",
        "JOBPLANE_QDRANT_PATH": str(bench.workdir / "qdrant"),
    }
    s3 = bench.s3_env
    engine = create_engine(bench.database_url, pool_size=4)
    store = BlobStore(
        engine,
        url=s3["JOBPLANE_S3_URL"],
        bucket=s3["JOBPLANE_S3_BUCKET"],
        access_key_id=s3["JOBPLANE_S3_ACCESS_KEY_ID"],
        secret_access_key=s3["JOBPLANE_S3_SECRET_ACCESS_KEY"],
    )
    try:
        await bench.start("server", "serve")
        await bench.start("relay", "relay")
        handlers = ["--handlers", "jobplane.contrib.ingest:registry"]
        await bench.start(
            "ingest-worker",
            "worker",
            *handlers,
            "--concurrency",
            str(bench.args.concurrency),
            *("--queue", "ingest.parse", "--queue", "ingest.chunk", "--queue", "ingest.embed"),
        )
        await bench.start("index-worker", "worker", *handlers, "--queue", "ingest.index")
        names = []
        for i in range(docs):
            info = await store.put_bytes(
                bench.tenant, generated_text(i, words).encode(), content_type="text/plain"
            )
            names.append(info.name)
        marker = time.time()
        async with AsyncClient(bench.address, bench.key) as client:
            await wait_ready(client)
            await asyncio.sleep(1.0)  # workers declare and consume
            marker = time.time()
            jobs = await asyncio.gather(
                *(
                    client.submit(INGEST, {"blob": blob, "file": f"bench/doc-{i}.txt"})
                    for i, blob in enumerate(names)
                )
            )
            done = [await client.wait(job.name, timeout=1800) for job in jobs]
        failed = [j for j in done if j.state.value != "succeeded"]
        if failed:
            raise RuntimeError(f"{len(failed)} ingestions failed, e.g. {failed[0].error}")
        chunks = sum(int((j.result or {}).get("chunks", 0)) for j in done)
        vectors = sum(int((j.result or {}).get("vectors", 0)) for j in done)
        config = {
            "docs": docs,
            "words_per_doc": words,
            "chunks": chunks,
            "embedder": "hash:v1:384",
            "qdrant": "local",
            "ingest_worker_concurrency": bench.args.concurrency,
            "index_workers": 1,
        }
        span = await bench.sql(
            "SELECT extract(epoch FROM max(end_time) - to_timestamp($2)) AS s FROM jobs "
            "WHERE tenant_id = $1 AND pipeline = 'ingest.file'",
            bench.tenant,
            marker,
        )
        seconds = float(span[0]["s"])
        bench.add(Figure("ingest_e2e_chunks", chunks / seconds, "chunks/s", config))
        bench.add(Figure("ingest_e2e_vectors", vectors / seconds, "vectors/s", config))
        bench.add(Figure("ingest_e2e_documents", docs / seconds, "docs/s", config))
        rows = await bench.sql(
            """
            SELECT s.name,
                   extract(epoch FROM max(s.end_time) - min(s.start_time)) AS span,
                   sum(extract(epoch FROM s.end_time - s.start_time)) AS busy
            FROM job_stages s JOIN jobs j ON j.id = s.job_id
            WHERE j.tenant_id = $1 AND j.pipeline = 'ingest.file'
            GROUP BY s.name
            """,
            bench.tenant,
        )
        for row in rows:
            unit = "vectors/s" if row["name"] in ("embed", "index") else "chunks/s"
            bench.add(
                Figure(f"ingest_stage_{row['name']}", chunks / float(row["span"]), unit, config)
            )
            bench.add(
                Figure(
                    f"ingest_stage_{row['name']}_per_run_ms",
                    float(row["busy"]) * 1000 / docs,
                    "ms",
                    config,
                )
            )
    finally:
        await store.close()
        await engine.dispose()
        await bench.stop_all()
        bench.extra_env = saved
        await bench.start_all()
