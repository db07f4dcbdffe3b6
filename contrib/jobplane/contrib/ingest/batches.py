"""The embed stage as a fan-out (pipeline version ``ingest-2``): one child job per batch.

The chunk stage stores each batch of chunks in a blob of its own (their
spans and texts, JSON) and returns one item per batch, ``{"chunks": blob,
"first": i, "count": n}``; each item becomes an ``ingest.embed`` child job
(ADR-0047), on whichever worker takes it, which embeds its batch and keeps
the vectors in a blob (float32, little-endian, row by row). The index stage
is the join: it reads the children's results in item order — each names its
batch's blob and its vectors' blob — and checks that the batches follow one
another from chunk 0, so the points are those of an embed stage run serially.

A child's result is small (names and counts, about 300 bytes): a result
stored by reference would reach the join as ``{}`` (docs/workflows.md,
"Limits"), which the join refuses as ``CORRUPT_STAGE_OUTPUT``.
"""

from __future__ import annotations

import array
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jobplane.fanout import MAX_FAN_OUT
from jobplane.workers.handlers import PermanentError

#: Chunks per child job, unless ``JOBPLANE_INGEST_BATCH`` says otherwise.
DEFAULT_BATCH = 64


class ResultLike(Protocol):
    """What the join reads of one child (:class:`jobplane.fanout.ItemResult`)."""

    @property
    def index(self) -> int: ...

    @property
    def result(self) -> Mapping[str, Any] | None: ...

    @property
    def ok(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class Batch:
    """One child's item: its batch's blob, its first chunk's index, its size."""

    chunks: str
    first: int
    count: int


@dataclass(slots=True)
class Embedded:
    """Every chunk of the file with its vector, in chunk order."""

    texts: list[str]
    spans: list[tuple[int, int]]
    vectors: array.array[float]
    dim: int
    embedder: str
    batches: int


def batch_size(chunks: int, batch: int) -> int:
    """``batch``, or larger when ``chunks`` would make more children than a fan-out takes."""
    return max(batch, -(-chunks // MAX_FAN_OUT))


def batch_documents(
    text: str, text_blob: str, spans: Sequence[tuple[int, int]], batch: int
) -> list[tuple[int, int, bytes]]:
    """Each batch's first chunk, size and blob's bytes; one empty batch for no chunks.

    An empty file still has one child: the embedder's name and size reach
    the join from it, as from any batch.
    """
    size = batch_size(len(spans), batch)
    out = []
    for first in range(0, max(1, len(spans)), size):
        part = spans[first : first + size]
        doc = {
            "text": text_blob,
            "first": first,
            "spans": [[s, e] for s, e in part],
            "texts": [text[s:e] for s, e in part],
        }
        out.append((first, len(part), _json(doc)))
    return out


def batch_of(payload: Mapping[str, Any]) -> Batch:
    """The child's item, checked; ``PermanentError(code="BAD_PAYLOAD")`` otherwise."""
    chunks, first, count = payload.get("chunks"), payload.get("first"), payload.get("count")
    if (
        set(payload) != {"chunks", "first", "count"}
        or not isinstance(chunks, str)
        or not chunks.startswith("blobs/")
        or type(first) is not int
        or type(count) is not int
        or first < 0
        or count < 0
    ):
        raise PermanentError(
            "ingest.embed takes one batch of the chunk stage: "
            '{"chunks": "blobs/…", "first": <int ≥ 0>, "count": <int ≥ 0>}',
            code="BAD_PAYLOAD",
        )
    return Batch(chunks, first, count)


def batch_chunks(batch: Batch, data: bytes) -> tuple[list[tuple[int, int]], list[str]]:
    """The batch's spans and texts from its blob, checked against the item."""
    try:
        doc = json.loads(data)
        spans = [(int(s), int(e)) for s, e in doc["spans"]]
        texts = [str(t) for t in doc["texts"]]
        first = doc["first"]
    except (ValueError, TypeError, KeyError) as exc:
        raise corrupt(f"the batch blob {batch.chunks} is not a batch of chunks: {exc}") from None
    if first != batch.first or len(spans) != len(texts) or len(texts) != batch.count:
        raise corrupt(f"the batch blob {batch.chunks} is not the batch of chunk {batch.first}")
    return spans, texts


def vectors_of(data: bytes, rows: int, dim: int, what: str) -> array.array[float]:
    """Float32 little-endian rows from a blob, checked for their size."""
    if len(data) != rows * dim * 4:
        raise corrupt(f"{what} has {len(data)} bytes, not {rows} x {dim} float32")
    vectors = array.array("f")
    vectors.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is
        vectors.byteswap()
    return vectors


@dataclass(frozen=True, slots=True)
class Embedding:
    """What one embed child returned: its batch, its vectors' blob and embedder."""

    batch: Batch
    vectors: str
    dim: int
    embedder: str


def child_result(result: ResultLike, expected_first: int) -> Embedding:
    """One child's result, checked: it succeeded and its batch starts where the last ended."""
    if not result.ok:
        raise PermanentError(
            f"the embed child of item {result.index} did not succeed", code="CHILDREN_FAILED"
        )
    found = result.result or {}
    try:
        done = Embedding(
            Batch(str(found["chunks"]), int(found["first"]), int(found["count"])),
            str(found["vectors"]),
            int(found["dim"]),
            str(found["embedder"]),
        )
    except (KeyError, TypeError, ValueError):
        done = None
    if done is None or done.batch.first != expected_first or done.batch.count < 0:
        raise corrupt(
            f"the embed child of item {result.index} returned {sorted(found)}, "
            f"not the vectors of the batch from chunk {expected_first}"
        )
    return done


def joined(results: Sequence[ResultLike]) -> list[Embedding]:
    """The children's results in chunk order, checked: one after another from chunk 0,
    all of one embedder, at least one (an empty file has one empty batch)."""
    out: list[Embedding] = []
    for item in results:
        done = child_result(item, out[-1].batch.first + out[-1].batch.count if out else 0)
        if out and (done.embedder, done.dim) != (out[0].embedder, out[0].dim):
            raise PermanentError(
                f"the batches were embedded by {out[0].embedder} and {done.embedder}: "
                "every worker of ingest.embed must have the same JOBPLANE_EMBEDDER",
                code="EMBEDDER_MISMATCH",
            )
        out.append(done)
    if not out:
        raise corrupt("the embed stage has no children: no embedder's vectors to index")
    return out


def corrupt(message: str) -> PermanentError:
    return PermanentError(message, code="CORRUPT_STAGE_OUTPUT")


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
