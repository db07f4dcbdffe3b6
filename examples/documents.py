"""The handlers of docs/workflows.md's "Fan-out and join", for the pipeline of
examples/topologies/documents.toml:

    JOBPLANE_TOPOLOGY=examples/topologies/documents.toml \\
        jobplane dev --handlers examples.documents:registry
    jobplane submit docs.ingest --payload '{"text": "one two three"}' --watch
"""

from __future__ import annotations

from typing import Any

from jobplane.workers import JobContext, Registry

registry = Registry()

#: Words per batch: one child job embeds one batch.
BATCH = 100


@registry.handler("docs.split")
async def split(ctx: JobContext) -> list[dict[str, Any]]:
    """The batches, each a child's payload (the next stage fans out)."""
    words = str(ctx.payload["text"]).split()
    return [{"batch": words[i : i + BATCH]} for i in range(0, len(words), BATCH)]


@registry.handler("docs.embed")
async def embed(ctx: JobContext) -> dict[str, Any]:
    """One batch's vectors (a stand-in model: one number a word)."""
    batch = ctx.payload["batch"]
    await ctx.progress(0.5, f"embedding {len(batch)} words")
    return {"vectors": [[float(len(word))] for word in batch]}


@registry.handler("docs.index")
async def index(ctx: JobContext) -> dict[str, Any]:
    """The join: every batch's vectors, in the document's order."""
    vectors = [v for r in ctx.results if r.ok and r.result for v in r.result["vectors"]]
    return {"indexed": len(vectors), "failed": [r.index for r in ctx.results if not r.ok]}
