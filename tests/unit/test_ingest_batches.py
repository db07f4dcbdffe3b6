"""The embed stage's batches: how the chunk stage cuts them, what a child and the join accept."""

from __future__ import annotations

import array
import json
from typing import Any

import pytest

from jobplane.config import ConfigError, Settings
from jobplane.contrib.ingest.batches import (
    Batch,
    batch_chunks,
    batch_documents,
    batch_of,
    batch_size,
    child_result,
    joined,
    vectors_of,
)
from jobplane.fanout import MAX_FAN_OUT, ItemResult
from jobplane.types import JobState
from jobplane.workers.handlers import PermanentError

BLOB = "blobs/" + "ab" * 32


def test_the_batch_setting() -> None:
    assert Settings.from_env({}).ingest_batch == 64
    assert Settings.from_env({"JOBPLANE_INGEST_BATCH": "8"}).ingest_batch == 8
    for bad in ("0", "-1", "many"):
        with pytest.raises(ConfigError, match="JOBPLANE_INGEST_BATCH"):
            Settings.from_env({"JOBPLANE_INGEST_BATCH": bad})


def test_batches_cover_the_chunks_in_order() -> None:
    text = "abcdefghij" * 3
    spans = [(i, i + 5) for i in range(0, 26, 3)]  # 9 chunks
    docs = batch_documents(text, "blobs/t", spans, 4)
    assert [(first, count) for first, count, _ in docs] == [(0, 4), (4, 4), (8, 1)]
    got: list[tuple[int, int]] = []
    texts: list[str] = []
    for first, count, data in docs:
        part, words = batch_chunks(Batch("blobs/b", first, count), data)
        got += part
        texts += words
    assert got == spans and texts == [text[s:e] for s, e in spans]


def test_no_chunks_is_one_empty_batch() -> None:
    [(first, count, data)] = batch_documents("", "blobs/t", [], 64)
    assert (first, count) == (0, 0)
    assert batch_chunks(Batch("blobs/b", 0, 0), data) == ([], [])


def test_the_batch_grows_rather_than_pass_the_fan_out_cap() -> None:
    assert batch_size(640, 64) == 64
    assert batch_size(MAX_FAN_OUT * 64, 64) == 64
    assert batch_size(MAX_FAN_OUT * 64 + 1, 64) == 65
    spans = [(0, 1)] * (MAX_FAN_OUT * 2 + 1)
    assert len(batch_documents("x", "blobs/t", spans, 1)) <= MAX_FAN_OUT


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"chunks": BLOB, "first": 0},
        {"chunks": "s3://x", "first": 0, "count": 1},
        {"chunks": BLOB, "first": -1, "count": 1},
        {"chunks": BLOB, "first": 0, "count": "1"},
        {"chunks": BLOB, "first": True, "count": 1},
        {"chunks": BLOB, "first": 0, "count": 1, "extra": 1},
        {"blob": BLOB, "file": "a.txt"},  # an ingest.file payload is not a batch
    ],
)
def test_a_child_refuses_a_payload_that_is_not_a_batch(payload: dict[str, Any]) -> None:
    with pytest.raises(PermanentError) as caught:
        batch_of(payload)
    assert caught.value.code == "BAD_PAYLOAD" and "ingest.embed takes" in str(caught.value)


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        json.dumps({"first": 0, "spans": [[0, 1]], "texts": ["a"]}).encode(),  # count 2
        json.dumps({"first": 4, "spans": [[0, 1], [1, 2]], "texts": ["a", "b"]}).encode(),
        json.dumps({"first": 0, "spans": [[0, 1], [1, 2]], "texts": ["a"]}).encode(),
        json.dumps(["a", "b"]).encode(),
    ],
)
def test_a_batch_blob_that_does_not_match_its_item_is_corrupt(data: bytes) -> None:
    with pytest.raises(PermanentError) as caught:
        batch_chunks(Batch("blobs/b", 0, 2), data)
    assert caught.value.code == "CORRUPT_STAGE_OUTPUT"


def test_vectors_are_checked_for_their_size() -> None:
    rows = array.array("f", [0.5] * 6).tobytes()
    assert list(vectors_of(rows, 2, 3, "v")) == [0.5] * 6
    with pytest.raises(PermanentError, match="24 bytes, not 3 x 3 float32"):
        vectors_of(rows, 3, 3, "v")


def _child(
    index: int, result: dict[str, Any] | None, state: JobState = JobState.SUCCEEDED
) -> ItemResult:
    return ItemResult(index=index, job=f"jobs/{index}", state=state, result=result)


def _found(first: int, count: int, embedder: str = "e", dim: int = 3) -> dict[str, Any]:
    return {
        "chunks": BLOB,
        "first": first,
        "count": count,
        "vectors": BLOB,
        "dim": dim,
        "embedder": embedder,
    }


def test_the_join_takes_the_children_in_chunk_order() -> None:
    done = joined([_child(0, _found(0, 4)), _child(1, _found(4, 4)), _child(2, _found(8, 1))])
    assert [(d.batch.first, d.batch.count) for d in done] == [(0, 4), (4, 4), (8, 1)]
    assert {(d.vectors, d.dim, d.embedder) for d in done} == {(BLOB, 3, "e")}
    assert child_result(_child(1, _found(4, 4)), 4) == done[1]


@pytest.mark.parametrize(
    ("children", "code"),
    [
        ([], "CORRUPT_STAGE_OUTPUT"),  # no batch: no embedder to index with
        ([_child(0, _found(0, 4)), _child(1, _found(8, 4))], "CORRUPT_STAGE_OUTPUT"),  # a gap
        ([_child(0, _found(4, 4))], "CORRUPT_STAGE_OUTPUT"),  # not from chunk 0
        ([_child(0, _found(0, 4)), _child(1, {})], "CORRUPT_STAGE_OUTPUT"),  # by reference: {}
        ([_child(0, {**_found(0, 4), "first": "x"})], "CORRUPT_STAGE_OUTPUT"),
        ([_child(0, _found(0, 4)), _child(1, None, JobState.FAILED)], "CHILDREN_FAILED"),
        ([_child(0, _found(0, 4)), _child(1, _found(4, 4, "other"))], "EMBEDDER_MISMATCH"),
        ([_child(0, _found(0, 4)), _child(1, _found(4, 4, dim=5))], "EMBEDDER_MISMATCH"),
    ],
)
def test_the_join_refuses_what_is_not_every_batch_in_order(
    children: list[ItemResult], code: str
) -> None:
    with pytest.raises(PermanentError) as caught:
        joined(children)
    assert caught.value.code == code


def test_the_live_view_counts_the_embed_batches_as_they_end() -> None:
    from datetime import UTC, datetime

    from rich.progress import Progress

    from jobplane.contrib.ingest.cli import _stage_row
    from jobplane.types import EventType, JobEvent

    def event(data: dict[str, Any], stage: str) -> JobEvent:
        now = datetime.now(UTC)
        return JobEvent(
            "jobs/j", 1, EventType.PROGRESS, JobState.QUEUED, 0.5, "", now, 1, data, stage
        )

    progress = Progress()
    stages: dict[str, Any] = {}
    _stage_row(progress, stages, event({"chunks": 130}, "chunk"))
    _stage_row(progress, stages, event({"children": 3, "ended": 2}, "embed"))
    assert stages["chunk"][1] == "  130 chunks"
    assert stages["embed"][1] == "  2/3 batches"
