"""The submit's binds on their short paths agree with the plain ones on every input.

A batch's rows go to the SUBMIT statement as one array a column, built
straight from each job's values (``submit_binds``); the payload is encoded
once, when its size is checked, and spliced into the request's fingerprint.
Each is held here to what the plain computation gives: the canonical JSON
of the whole request, the row as a dict of columns, the payload's size as
its encoded bytes.
"""

from __future__ import annotations

import hashlib
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.errors import PayloadTooLarge
from jobplane.store.job_submit import NewJob, submit_binds, submit_columns, submit_values
from jobplane.store.machine import SUBMIT_COLUMNS, NewStage
from jobplane.store.rows import dumps, sized_json
from jobplane.types import BlobRef, ConcurrencyMode, DependencyFailurePolicy

_text = st.text(st.characters(codec="utf-8"), max_size=12)
_json: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**60), 2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)
_payloads = st.dictionaries(_text, _json, max_size=5)
_stage = st.builds(
    NewStage,
    name=_text,
    type=_text,
    queue=_text,
    version=_text,
    max_attempts=st.integers(1, 100),
    timeout_seconds=st.floats(0.001, 1e5),
    base=st.floats(0, 1),
    span=st.floats(0, 1),
)
_times = st.none() | st.datetimes(timezones=st.just(UTC))


@st.composite
def new_jobs(draw: st.DrawFn) -> NewJob:
    """Any NewJob a submit writes: plain or pipeline, with or without every option."""
    payload = draw(_payloads)
    blob = draw(
        st.none() | st.builds(BlobRef, st.just("blobs/x"), st.just("a" * 64), st.integers(0, 10**9))
    )
    keyed = draw(st.booleans())
    return NewJob(
        type=draw(_text),
        queue=draw(_text),
        payload=payload,
        request_id=draw(_text),
        max_attempts=draw(st.integers(0, 100)),
        correlation_id=draw(_text),
        labels=draw(st.dictionaries(_text, _text, max_size=3)),
        timeout_seconds=draw(st.floats(0.001, 1e6)),
        stages=tuple(draw(st.lists(_stage, max_size=3))),
        pipeline_version=draw(_text),
        payload_blob=blob,
        blob_references=tuple(draw(st.lists(st.just("b" * 64), max_size=2))),
        schedule_time=draw(_times),
        concurrency_key=draw(_text) if keyed else None,
        concurrency_limit=draw(st.integers(0, 10)),
        concurrency_mode=draw(st.sampled_from(ConcurrencyMode)),
        deadline=draw(_times),
        after=tuple(draw(st.lists(st.uuids(), max_size=2))),
        after_failure=draw(st.sampled_from(DependencyFailurePolicy)),
        parent_id=draw(st.none() | st.uuids()),
        # As the request's checks leave it, or not encoded yet.
        payload_json=dumps(payload) if draw(st.booleans()) else None,
    )


def plain_fingerprint(new: NewJob) -> bytes:
    """The request's digest from the canonical JSON of the whole request, encoded at once."""
    canonical = dumps(
        {
            "type": new.type,
            "payload": new.payload,
            "max_attempts": new.max_attempts,
            "correlation_id": new.correlation_id,
            "labels": new.labels,
            "timeout_seconds": new.timeout_seconds,
            **({"payload_blob": new.payload_blob.sha256} if new.payload_blob else {}),
            **({"blob_references": sorted(new.blob_references)} if new.blob_references else {}),
            **(
                {
                    "concurrency_key": new.concurrency_key,
                    "concurrency_limit": new.concurrency_limit,
                    "concurrency_mode": new.concurrency_mode.value,
                }
                if new.concurrency_key is not None
                else {}
            ),
            **(
                {"after": [str(a) for a in new.after], "after_failure": new.after_failure.value}
                if new.after
                else {}
            ),
        }
    )
    return hashlib.sha256(canonical.encode()).digest()


def plain_row(new: NewJob, job_id: uuid.UUID, dispatch_id: uuid.UUID) -> dict[str, Any]:
    """The row of ``new``, column by column, as the submit's binds describe it."""
    row: dict[str, Any] = dict.fromkeys(SUBMIT_COLUMNS)
    row.update(
        id=job_id,
        type=new.type,
        queue=new.queue,
        payload=dumps(new.payload),
        max_attempts=new.max_attempts,
        request_id=new.request_id,
        request_hash=plain_fingerprint(new),
        correlation_id=new.correlation_id,
        labels=dumps(new.labels),
        dispatch_id=dispatch_id,
        timeout_seconds=new.timeout_seconds,
        payload_blob=new.payload_blob.sha256 if new.payload_blob else None,
        payload_blob_size=new.payload_blob.size if new.payload_blob else None,
        schedule_time=new.schedule_time,
        concurrency_key=new.concurrency_key,
        concurrency_limit=new.concurrency_limit if new.concurrency_key is not None else None,
        deadline=new.deadline,
        parent_id=new.parent_id,
        stage_base=0.0,
        stage_span=1.0,
    )
    if new.stages:
        first = new.stages[0]
        row.update(
            type=first.type,
            queue=first.queue,
            max_attempts=first.max_attempts,
            timeout_seconds=first.timeout_seconds,
            pipeline=new.type,
            pipeline_version=new.pipeline_version,
            stage=0,
            stage_name=first.name,
            stage_base=first.base,
            stage_span=first.span,
        )
    return row


@given(new_jobs())
def test_the_spliced_fingerprint_is_the_whole_requests(new: NewJob) -> None:
    assert new.fingerprint() == plain_fingerprint(new)


@given(new_jobs(), st.uuids(), st.uuids())
def test_a_jobs_values_are_its_row(new: NewJob, job_id: uuid.UUID, dispatch: uuid.UUID) -> None:
    values = submit_values(new, job_id, dispatch)
    assert dict(zip(SUBMIT_COLUMNS, values, strict=True)) == plain_row(new, job_id, dispatch)
    assert submit_columns(new, job_id).keys() == set(SUBMIT_COLUMNS)


_extras = st.dictionaries(
    st.sampled_from(["after_ids", "deps_waiting", "waiting_code", "dispatch_id"]),
    st.none() | st.integers(0, 3),
    max_size=3,
)


@given(st.lists(st.tuples(new_jobs(), _extras), max_size=6))
def test_the_binds_are_the_rows_column_by_column(jobs: list[tuple[NewJob, dict[str, Any]]]) -> None:
    news = [new for new, _ in jobs]
    extra = [columns for _, columns in jobs]
    ids = [uuid.uuid4() for _ in news]
    binds = submit_binds(news, ids, extra)
    assert binds.keys() == {f"new_{c}" for c in SUBMIT_COLUMNS}
    dispatches = binds["new_dispatch_id"] + [None] * (len(news) - len(binds["new_dispatch_id"]))
    rows = [
        {**plain_row(new, job_id, dispatch), **columns}
        for new, job_id, dispatch, columns in zip(news, ids, dispatches, extra, strict=True)
    ]
    for column in SUBMIT_COLUMNS:
        bound = binds[f"new_{column}"]
        # unnest pads a shorter array with NULLs: an empty one is NULL for every job.
        padded = bound + [None] * (len(news) - len(bound))
        assert padded == [row[column] for row in rows], column
        assert bound == [] or len(bound) == len(news), column
        if not bound:
            assert all(row[column] is None for row in rows)


def test_the_dispatch_ids_are_fresh_and_a_column_null_for_all_binds_empty() -> None:
    news = [
        NewJob(type="t", queue="q", payload={}, request_id=str(i), max_attempts=1) for i in range(3)
    ]
    binds = submit_binds(news, [uuid.uuid4() for _ in news])
    assert len(set(binds["new_dispatch_id"])) == 3
    assert binds["new_pipeline"] == binds["new_parent_id"] == binds["new_deadline"] == []
    assert binds["new_stage_span"] == [1.0, 1.0, 1.0]
    when = datetime(2030, 1, 1, tzinfo=UTC)
    later = NewJob(
        type="t", queue="q", payload={}, request_id="x", max_attempts=1, schedule_time=when
    )
    binds = submit_binds([*news, later], [uuid.uuid4() for _ in range(4)])
    assert binds["new_schedule_time"] == [None, None, None, when]
    assert submit_binds([], []) == {f"new_{c}": [] for c in SUBMIT_COLUMNS}


@given(_payloads, st.integers(0, 400))
def test_the_checked_payloads_json_is_its_encoding_and_its_size_the_bytes(
    payload: dict[str, Any], limit: int
) -> None:
    text = dumps(payload)
    size = len(text.encode())
    if size > limit:
        with pytest.raises(PayloadTooLarge) as refused:
            sized_json(payload, limit)
        assert refused.value.metadata == {"limit": str(limit), "size": str(size)}
    else:
        assert sized_json(payload, limit) == text
