"""Ingestion: an uploaded file into Qdrant points, as the pipeline ``ingest.file``.

Stages (``topologies/ingest.toml``): parse (fetch the blob, extract text
from plain text, Markdown, HTML or PDF) → chunk (overlapping spans) →
embed (an :class:`Embedder`; the default hashes features, offline) → index
(upsert points with deterministic ids, then delete the file's older ones).
See docs/ingestion.md and docs/adr/0021-ingestion.md.

``jobplane worker --handlers jobplane.contrib.ingest:registry`` runs the
handlers; ``jobplane ingest FILE...`` uploads and ingests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobplane.contrib.ingest.chunker import Chunk, chunk_text
from jobplane.contrib.ingest.embedders import Embedder, HashingEmbedder, load_embedder
from jobplane.contrib.ingest.formats import Document, UnsupportedFormat, parse

if TYPE_CHECKING:
    from jobplane.contrib.ingest.handlers import STAGE_TYPES, Ingest, registry
    from jobplane.contrib.ingest.index import (
        DEFAULT_COLLECTION,
        Hit,
        Index,
        IndexUnavailable,
        open_index,
        point_id,
    )
    from jobplane.contrib.ingest.stages import PIPELINE, content_version

__all__ = [
    "DEFAULT_COLLECTION",
    "PIPELINE",
    "STAGE_TYPES",
    "Chunk",
    "Document",
    "Embedder",
    "HashingEmbedder",
    "Hit",
    "Index",
    "IndexUnavailable",
    "Ingest",
    "UnsupportedFormat",
    "chunk_text",
    "content_version",
    "load_embedder",
    "open_index",
    "parse",
    "point_id",
    "registry",
]


def __getattr__(name: str) -> Any:
    # The handlers import the worker runtime (SQLAlchemy, aio-pika), the index
    # structlog: only when asked for, so that the client side (jobplane
    # ingest) needs the SDK alone.
    if name in ("DEFAULT_COLLECTION", "Hit", "Index", "IndexUnavailable", "open_index", "point_id"):
        from jobplane.contrib.ingest import index

        return getattr(index, name)
    if name in ("STAGE_TYPES", "Ingest", "registry"):
        from jobplane.contrib.ingest import handlers

        return getattr(handlers, name)
    if name in ("PIPELINE", "content_version"):
        from jobplane.contrib.ingest import stages

        return getattr(stages, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
