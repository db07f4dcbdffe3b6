"""The four stages of ``ingest.file``: parse, chunk, embed, index.

Each stage reads what the stage before it left in blobs and leaves its own
output in a blob (``ctx.put_blob``: content-addressed, so a stage run again
writes the same name); its result carries the names, counts and digests.
The embed stage fans out (pipeline version ``ingest-2``, see
:mod:`jobplane.contrib.ingest.batches`): the chunk stage returns its batches,
one child job embeds each, and the index stage joins them in chunk order. A
job of ``ingest-1`` (no fan-out, frozen at its submit) still runs: its chunk
stage returns its spans, its embed stage embeds every chunk, as before.
The index stage is the only one with an effect outside jobplane, and it is
idempotent: point ids depend on (tenant, file, chunk index, pipeline
version) only, an upsert overwrites a point in place, and the points of the
file's other versions are deleted after the new ones are in. A crash at any
point leaves at worst a mix of the file's old and new chunks (never two
points of one chunk), which the stage's next attempt resolves.

The stages are coded against :class:`StageContext`, the part of
:class:`jobplane.workers.JobContext` they use.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import hashlib
import json
import sys
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from jobplane.contrib.ingest import batches
from jobplane.contrib.ingest.batches import DEFAULT_BATCH, Embedded
from jobplane.contrib.ingest.chunker import (
    DEFAULT_CHUNK_OVERLAP,
    DEFAULT_CHUNK_SIZE,
    check_params,
    chunk_text,
)
from jobplane.contrib.ingest.embedders import Embedder
from jobplane.contrib.ingest.formats import UnsupportedFormat, parse
from jobplane.contrib.ingest.index import (
    DEFAULT_COLLECTION,
    CollectionMismatch,
    Index,
    IndexUnavailable,
    Point,
    check_collection,
    point_id,
)
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.workers.handlers import PermanentError, RetryableError

#: The pipeline (and its stages' job types) in topologies/ingest.toml.
PIPELINE = "ingest.file"
#: The largest source file a parse stage reads into memory.
MAX_SOURCE_BYTES = 256 * 1024 * 1024
#: Chunks embedded per call (and per progress report).
EMBED_BATCH = 64
#: Blobs a stage puts or reads at once (the chunk stage's batches, the join's).
BLOB_CALLS = 8
MAX_FILE_NAME = 1024


class BlobInfoLike(Protocol):
    """What a stage reads of a blob's metadata."""

    @property
    def size(self) -> int: ...

    @property
    def content_type(self) -> str | None: ...


class StageContext(Protocol):
    """The part of :class:`jobplane.workers.JobContext` the stages use."""

    @property
    def tenant_id(self) -> str: ...

    @property
    def payload(self) -> dict[str, Any]: ...

    @property
    def inputs(self) -> Mapping[str, dict[str, Any]]: ...

    @property
    def pipeline(self) -> str: ...

    @property
    def pipeline_version(self) -> str: ...

    @property
    def stage_version(self) -> str: ...

    @property
    def fans_out(self) -> bool: ...

    @property
    def results(self) -> tuple[batches.ResultLike, ...]: ...

    async def progress(
        self, fraction: float, message: str = "", data: dict[str, Any] | None = None
    ) -> None: ...

    def open_blob(self, name: str) -> AbstractAsyncContextManager[Any]: ...

    async def read_blob(self, name: str, *, limit: int | None = None) -> bytes: ...

    async def put_blob(
        self, data: bytes | AsyncIterable[bytes], *, content_type: str | None = None
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class Request:
    """The payload of ``ingest.file``, checked."""

    blob: str
    digest: str
    file: str
    content_type: str | None
    collection: str
    chunk_size: int
    chunk_overlap: int


_KEYS = frozenset({"blob", "file", "content_type", "collection", "chunk_size", "chunk_overlap"})


def request_of(payload: Mapping[str, Any]) -> Request:
    """The job's request, or ``PermanentError(code="BAD_PAYLOAD")`` naming what is wrong."""
    from jobplane.blobs.names import parse_blob_name

    def bad(message: str) -> PermanentError:
        return PermanentError(message, code="BAD_PAYLOAD")

    unknown = sorted(set(payload) - _KEYS)
    if unknown:
        raise bad(f"unknown payload keys {unknown}; ingest.file takes {sorted(_KEYS)}")
    blob = payload.get("blob")
    if not isinstance(blob, str):
        raise bad("blob must be the name of the uploaded file's blob (blobs/<sha256>)")
    try:
        digest = parse_blob_name(blob)
    except ValueError as exc:
        raise bad(f"blob: {exc}") from None
    file = payload.get("file")
    if not isinstance(file, str) or not file.strip() or len(file) > MAX_FILE_NAME:
        raise bad(f"file must be the file's name, 1..{MAX_FILE_NAME} characters")
    content_type = payload.get("content_type")
    if content_type is not None and (not isinstance(content_type, str) or len(content_type) > 255):
        raise bad("content_type must be a MIME type such as text/markdown")
    collection = payload.get("collection", DEFAULT_COLLECTION)
    try:
        check_collection(collection)
    except ValueError as exc:
        raise bad(f"collection: {exc}") from None
    size = payload.get("chunk_size", DEFAULT_CHUNK_SIZE)
    overlap = payload.get("chunk_overlap")
    if overlap is None:  # the default, within what a small chunk_size allows
        overlap = min(DEFAULT_CHUNK_OVERLAP, size // 2) if type(size) is int else 0
    try:
        check_params(size, overlap)
    except (TypeError, ValueError) as exc:
        raise bad(str(exc)) from None
    return Request(blob, digest, file, content_type or None, collection, size, overlap)


async def parse_stage(ctx: StageContext, faults: FaultPoints = NO_FAULTS) -> dict[str, Any]:
    """Fetch the uploaded file, extract its text, keep the text in a blob."""
    request = request_of(ctx.payload)
    await ctx.progress(0.0, f"fetching {request.file}")
    async with ctx.open_blob(request.blob) as reader:
        info = reader.info
        if info.size > MAX_SOURCE_BYTES:
            raise PermanentError(
                f"{request.file} has {info.size} bytes; ingestion reads at most {MAX_SOURCE_BYTES}",
                code="FILE_TOO_LARGE",
            )
        data = await reader.read()
        stored_type = info.content_type
    await ctx.progress(0.3, f"parsing {len(data)} bytes")
    try:
        document = await asyncio.to_thread(
            parse, data, file=request.file, content_type=request.content_type or stored_type
        )
    except UnsupportedFormat as exc:
        raise PermanentError(f"{request.file}: {exc}", code="UNSUPPORTED_FORMAT") from None
    text = document.text.encode()
    name = await ctx.put_blob(text, content_type="text/plain; charset=utf-8")
    faults.hit("ingest.parse.stored")
    counts = {"pages": document.pages, "chars": len(document.text)}
    await ctx.progress(1.0, f"parsed {document.pages} page(s), {len(document.text)} chars", counts)
    return {
        "file": request.file,
        "digest": request.digest,
        "format": document.format,
        **counts,
        "text": name,
    }


async def chunk_stage(
    ctx: StageContext, faults: FaultPoints = NO_FAULTS, *, batch: int = DEFAULT_BATCH
) -> dict[str, Any] | list[dict[str, Any]]:
    """Cut the text into chunks; keep each batch of ``batch`` chunks in a blob, and
    return one item per batch (the embed stage's children).

    In a job of ``ingest-1`` (whose embed stage does not fan out): keep the
    spans in one blob and return its name.
    """
    request = request_of(ctx.payload)
    parsed = _input(ctx, "parse")
    text = (await ctx.read_blob(parsed["text"])).decode()
    chunks = await asyncio.to_thread(chunk_text, text, request.chunk_size, request.chunk_overlap)
    if ctx.fans_out:
        cuts = [(c.start, c.end) for c in chunks]
        docs = await asyncio.to_thread(batches.batch_documents, text, parsed["text"], cuts, batch)
        limit = asyncio.Semaphore(BLOB_CALLS)

        async def put(first: int, count: int, data: bytes) -> dict[str, Any]:
            async with limit:
                name = await ctx.put_blob(data, content_type="application/json")
            return {"chunks": name, "first": first, "count": count}

        items = list(await asyncio.gather(*(put(*doc) for doc in docs)))
        faults.hit("ingest.chunk.stored")
        await ctx.progress(
            1.0, f"{len(chunks)} chunks in {len(items)} batch(es)", {"chunks": len(chunks)}
        )
        return items
    spans = {
        "text": parsed["text"],
        "chunk_size": request.chunk_size,
        "chunk_overlap": request.chunk_overlap,
        "spans": [[c.start, c.end] for c in chunks],
    }
    name = await ctx.put_blob(_json(spans), content_type="application/json")
    faults.hit("ingest.chunk.stored")
    await ctx.progress(1.0, f"{len(chunks)} chunks", {"chunks": len(chunks)})
    return {
        "chunks": len(chunks),
        "chunk_size": request.chunk_size,
        "chunk_overlap": request.chunk_overlap,
        "spans": name,
    }


async def embed_stage(
    ctx: StageContext, embedder: Embedder, faults: FaultPoints = NO_FAULTS
) -> dict[str, Any]:
    """Embed one batch of chunks (a child job: its payload is the batch); keep the
    vectors in a blob (float32, little-endian, row by row).

    In a job of ``ingest-1`` (a stage of the pipeline, with the chunk stage's
    spans among its inputs): embed every chunk of the file.
    """
    chunked = ctx.inputs.get("chunk")
    if chunked is not None and "spans" in chunked:
        texts, _spans = await _chunks(ctx)
        name = await _embed(ctx, embedder, texts, faults)
        return {"vectors": len(texts), "dim": embedder.dim, "embedder": embedder.name, "blob": name}
    batch = batches.batch_of(ctx.payload)
    _spans, texts = batches.batch_chunks(batch, await ctx.read_blob(batch.chunks))
    name = await _embed(ctx, embedder, texts, faults)
    return {
        "chunks": batch.chunks,
        "first": batch.first,
        "count": batch.count,
        "vectors": name,
        "dim": embedder.dim,
        "embedder": embedder.name,
    }


async def _embed(
    ctx: StageContext, embedder: Embedder, texts: list[str], faults: FaultPoints
) -> str:
    vectors = array.array("f")
    done = 0
    for at in range(0, len(texts), EMBED_BATCH):
        batch = texts[at : at + EMBED_BATCH]
        rows = await asyncio.to_thread(embedder.embed, batch)
        if len(rows) != len(batch) or any(len(r) != embedder.dim for r in rows):
            raise RuntimeError(f"embedder {embedder.name} returned vectors of the wrong shape")
        for row in rows:
            vectors.extend(row)
        done += len(batch)
        faults.hit("ingest.embed.batch")
        await ctx.progress(
            done / max(1, len(texts)), f"{done}/{len(texts)} vectors", {"vectors": done}
        )
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is
        vectors.byteswap()
    data = vectors.tobytes()
    name = await ctx.put_blob(data, content_type="application/octet-stream")
    if not texts:
        await ctx.progress(1.0, "0 vectors", {"vectors": 0})
    return name


async def index_stage(
    ctx: StageContext, index: Index, faults: FaultPoints = NO_FAULTS
) -> dict[str, Any]:
    """Upsert the file's points, then delete its points of any other version."""
    request = request_of(ctx.payload)
    parsed = _input(ctx, "parse")
    if "blob" in _input(ctx, "embed"):  # ingest-1: one vectors blob
        embedded = await _whole(ctx)
    else:
        embedded = await _joined(ctx)
    texts, spans, vectors, dim = embedded.texts, embedded.spans, embedded.vectors, embedded.dim
    version = content_version(
        digest=request.digest,
        pipeline_version=ctx.pipeline_version,
        chunk_size=request.chunk_size,
        chunk_overlap=request.chunk_overlap,
        embedder=embedded.embedder,
    )
    base = {
        "tenant_id": ctx.tenant_id,
        "file": request.file,
        "digest": request.digest,
        "blob": request.blob,
        "format": parsed.get("format"),
        "pipeline": ctx.pipeline or PIPELINE,
        "pipeline_version": ctx.pipeline_version,
        "embedder": embedded.embedder,
        "version": version,
    }
    points = [
        Point(
            id=point_id(ctx.tenant_id, request.file, i, ctx.pipeline_version),
            vector=vectors[i * dim : (i + 1) * dim],
            payload={**base, "chunk_index": i, "start": s, "end": e, "text": texts[i]},
        )
        for i, (s, e) in enumerate(spans)
    ]
    # One file's versions are written one at a time in this process: two
    # uploads of one name racing here would otherwise delete each other's points.
    async with _file_lock((request.collection, ctx.tenant_id, request.file)):
        return await _index(ctx, index, request, points, version, parsed, embedded, faults)


async def _joined(ctx: StageContext) -> Embedded:
    """The embed children's batches and vectors, in chunk order (the join of ``ingest-2``)."""
    done = batches.joined(ctx.results)
    limit = asyncio.Semaphore(BLOB_CALLS)

    async def read(one: batches.Embedding) -> tuple[bytes, bytes]:
        async with limit:
            return await ctx.read_blob(one.batch.chunks), await ctx.read_blob(one.vectors)

    blobs = await asyncio.gather(*(read(one) for one in done))
    first = done[0]
    embedded = Embedded([], [], array.array("f"), first.dim, first.embedder, len(done))
    for index, (one, (chunks, data)) in enumerate(zip(done, blobs, strict=True)):
        spans, texts = batches.batch_chunks(one.batch, chunks)
        what = f"the vectors blob of item {index}"
        embedded.vectors.extend(batches.vectors_of(data, one.batch.count, one.dim, what))
        embedded.texts.extend(texts)
        embedded.spans.extend(spans)
    return embedded


async def _whole(ctx: StageContext) -> Embedded:
    """The file's chunks and the embed stage's one vectors blob (``ingest-1``)."""
    found = _input(ctx, "embed")
    texts, spans = await _chunks(ctx)
    dim = int(found["dim"])
    data = await ctx.read_blob(found["blob"])
    vectors = batches.vectors_of(data, len(texts), dim, "the vectors blob")
    return Embedded(texts, spans, vectors, dim, str(found["embedder"]), 1)


_file_locks: dict[tuple[str, str, str], tuple[asyncio.Lock, int]] = {}


@contextlib.asynccontextmanager
async def _file_lock(key: tuple[str, str, str]) -> AsyncIterator[None]:
    lock, users = _file_locks.get(key, (asyncio.Lock(), 0))
    _file_locks[key] = (lock, users + 1)
    try:
        async with lock:
            yield
    finally:
        lock, users = _file_locks[key]
        if users <= 1:
            del _file_locks[key]
        else:
            _file_locks[key] = (lock, users - 1)


async def _index(
    ctx: StageContext,
    index: Index,
    request: Request,
    points: list[Point],
    version: str,
    parsed: Mapping[str, Any],
    embedded: Embedded,
    faults: FaultPoints,
) -> dict[str, Any]:
    try:
        collection = await index.ensure_collection(embedded.dim, collection=request.collection)
        written = 0
        step = 256
        for at in range(0, len(points), step):
            written += await index.upsert(points[at : at + step], collection=collection)
            faults.hit("ingest.index.upserted")
            await ctx.progress(
                0.95 * written / max(1, len(points)),
                f"{written}/{len(points)} points",
                {"points": written},
            )
        # Only now, with every new point in: what is left of the file's other
        # versions (the chunks past the new count, an older pipeline's ids).
        await index.delete_file_points(
            ctx.tenant_id, request.file, keep_version=version, collection=collection
        )
        faults.hit("ingest.index.deleted")
        stored = await index.count(ctx.tenant_id, request.file, collection=collection)
        if stored != written:
            # Another process indexed another version of this file meanwhile
            # (the lock above is this process's only): its points replaced or
            # deleted some of these. Write them again, so the file ends with
            # the points of one version, the one whose index stage ended last.
            raise RetryableError(
                f"{request.file} has {stored} points, not the {written} just written: "
                "another version of it was indexed at the same time",
                delay=1.0,
                code="INDEX_CONFLICT",
            )
    except IndexUnavailable as exc:
        raise RetryableError(str(exc), code="INDEX_UNAVAILABLE") from exc
    except CollectionMismatch as exc:
        raise PermanentError(str(exc), code="COLLECTION_MISMATCH") from None
    await ctx.progress(1.0, f"{written} points in {collection}", {"points": written})
    return {
        "collection": collection,
        "file": request.file,
        "digest": request.digest,
        "version": version,
        "pages": int(parsed["pages"]),
        "chunks": len(embedded.spans),
        "vectors": len(embedded.spans),
        "batches": embedded.batches,
        "points": written,
        "file_points": stored,
        "embedder": embedded.embedder,
    }


def content_version(
    *, digest: str, pipeline_version: str, chunk_size: int, chunk_overlap: int, embedder: str
) -> str:
    """What makes a file's points what they are: its bytes, the pipeline, chunking and embedder.

    The same upload ingested again has the same version (its points are
    rewritten as they were); anything else is a new version whose ingestion
    deletes the points of the old one.
    """
    key = json.dumps([digest, pipeline_version, chunk_size, chunk_overlap, embedder])
    return hashlib.sha256(key.encode()).hexdigest()[:32]


async def _chunks(ctx: StageContext) -> tuple[list[str], list[tuple[int, int]]]:
    """The chunks' texts and spans, from the chunk stage's blob and the parse stage's text."""
    chunked = _input(ctx, "chunk")
    spans_doc = json.loads(await ctx.read_blob(chunked["spans"]))
    text = (await ctx.read_blob(spans_doc["text"])).decode()
    spans = [(int(s), int(e)) for s, e in spans_doc["spans"]]
    return [text[s:e] for s, e in spans], spans


def _input(ctx: StageContext, stage: str) -> dict[str, Any]:
    found = ctx.inputs.get(stage)
    if found is None:
        raise PermanentError(
            f"the {stage} stage's result is missing: ingest stages run inside {PIPELINE}",
            code="NOT_IN_PIPELINE",
        )
    return found


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
