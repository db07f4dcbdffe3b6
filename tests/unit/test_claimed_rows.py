"""How a claimed job row is read into the attempt a handler runs: its fields,
its payload blob, the pipeline stage it runs with the results before it, a
join stage's children, and the limit a held job's flow key names."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from jobplane.fanout import ItemResult
from jobplane.store.claims import (
    _CHILDREN,
    _STAGES,
    Attempt,
    StageRun,
    attempt_from_row,
    item_results,
    limit_name,
    stage_run,
)
from jobplane.types import BlobRef, JobError, JobState
from tests.support.store_fakes import ScriptedConn

CREATED = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)


def _row(**changes: Any) -> dict[str, Any]:
    row = {
        "type": "mail",
        "payload": '{"to": "a@b"}',
        "attempt": "3",
        "max_attempts": "5",
        "retry_base": "1",
        "correlation_id": "corr",
        "request_id": "req",
        "timeout_seconds": "90",
        "queue": "bulk",
        "create_time": CREATED,
    }
    return {**row, **changes}


def test_a_claimed_row_reads_as_its_attempt() -> None:
    job, tenant, token, started = uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    attempt = attempt_from_row(job, tenant, token, _row(), None, started)
    assert attempt == Attempt(
        job_id=job,
        tenant_id=tenant,
        type="mail",
        payload={"to": "a@b"},
        attempt=3,
        max_attempts=5,
        retry_base=1,
        lease_token=token,
        correlation_id="corr",
        request_id="req",
        timeout_seconds=90.0,
        queue="bulk",
        started_event_id=started,
        stage=None,
        payload_blob=None,
        create_time=CREATED,
    )
    assert type(attempt.timeout_seconds) is float
    assert attempt.attempts_left == 3 and attempt.budget_attempt == 2
    assert attempt.fence() == {"id": job, "attempt": 3, "lease_token": token}


def test_a_row_read_without_its_start_names_no_started_event_or_create_time() -> None:
    row = _row(payload={"k": [1]})
    del row["create_time"]
    attempt = attempt_from_row(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), row, None)
    assert attempt.started_event_id is None and attempt.create_time is None
    assert attempt.payload == {"k": [1]}


def test_a_payload_submitted_by_reference_names_its_blob() -> None:
    row = _row(payload="{}", payload_blob="ab12", payload_blob_size=2048)
    attempt = attempt_from_row(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), row, None)
    assert attempt.payload_blob == BlobRef("blobs/ab12", "ab12", 2048)
    unsized = _row(payload_blob="ab12", payload_blob_size=None)
    blob = attempt_from_row(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), unsized, None).payload_blob
    assert blob == BlobRef("blobs/ab12", "ab12", 0)
    empty = _row(payload_blob="")
    assert (
        attempt_from_row(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), empty, None).payload_blob is None
    )


def _stage(idx: int, name: str, result: Any = None, *, fan_out: bool = False) -> dict[str, Any]:
    text = None if result is None else json.dumps(result)
    return {"idx": idx, "name": name, "version": f"v{idx}", "result": text, "fan_out": fan_out}


async def test_a_stage_runs_with_the_results_of_the_stages_before_it() -> None:
    conn, job = ScriptedConn(), uuid.uuid4()
    stages = [
        _stage(0, "fetch", {"a": 1}),
        _stage(1, "skip"),
        _stage(2, "parse", {"old": True}),
        _stage(3, "split", fan_out=True),
        _stage(4, "store", {"stale": 1}),
    ]
    conn.answer(_STAGES, stages)
    row = {"stage": "2", "pipeline": "ingest", "pipeline_version": None}
    run = await stage_run(conn, job, row)  # type: ignore[arg-type]
    assert run == StageRun(
        pipeline="ingest",
        pipeline_version="",
        name="parse",
        index=2,
        count=5,
        version="v2",
        inputs={"fetch": {"a": 1}},
        fans_out=True,
        results=None,
    )
    assert not run.last
    assert conn.ran(_STAGES) == [{"id": job}]
    assert conn.ran(_CHILDREN) == []


async def test_the_stage_after_a_fan_out_joins_its_childrens_results_in_item_order() -> None:
    conn, job = ScriptedConn(), uuid.uuid4()
    conn.answer(
        _STAGES, [_stage(0, "list", {"n": 2}), _stage(1, "each", fan_out=True), _stage(2, "sum")]
    )
    ok, bad, lost = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    children = [
        _child(1, ok, "succeeded", result='{"v": 1}', error_code="OLD", error_message="x"),
        _child(2, bad, "failed", error_code="BROKE", error_message=None, error_retryable=1),
        _child(3, lost, "cancelled"),
    ]
    conn.answer(_CHILDREN, children)
    row = {"stage": 2, "pipeline": "fan", "pipeline_version": "7"}
    run = await stage_run(conn, job, row)  # type: ignore[arg-type]
    assert (run.name, run.index, run.count, run.pipeline_version) == ("sum", 2, 3, "7")
    assert run.last and not run.fans_out
    assert run.inputs == {"list": {"n": 2}}
    assert run.results == (
        ItemResult(0, f"jobs/{ok}", JobState.SUCCEEDED, {"v": 1}, None),
        ItemResult(1, f"jobs/{bad}", JobState.FAILED, None, JobError("BROKE", "", True)),
        ItemResult(2, f"jobs/{lost}", JobState.CANCELLED, None, None),
    )
    assert conn.ran(_CHILDREN) == [{"id": job}]


def _child(idx: int, job: uuid.UUID, state: str, **changes: Any) -> dict[str, Any]:
    row = {
        "idx": idx,
        "id": job,
        "state": state,
        "result": None,
        "error_code": None,
        "error_message": None,
        "error_retryable": None,
    }
    return {**row, **changes}


async def test_a_failed_childs_error_keeps_its_message() -> None:
    conn, child = ScriptedConn(), uuid.uuid4()
    conn.answer(
        _CHILDREN,
        [
            _child(
                4,
                child,
                "failed",
                error_code="E",
                error_message="why",
                error_retryable=False,
                result={"partial": 1},
            )
        ],
    )
    (result,) = await item_results(conn, uuid.uuid4())  # type: ignore[arg-type]
    assert result == ItemResult(
        3, f"jobs/{child}", JobState.FAILED, {"partial": 1}, JobError("E", "why", False)
    )


@pytest.mark.parametrize(
    ("flow_key", "name"),
    [
        (None, ""),
        ("", ""),
        ("limit/emails", "emails"),
        ("limit/emails/tenant-1", "emails"),
        ("limit/emails/tenant-1@rate", "emails"),
        ("queue/bulk/tenant-1", "queue/bulk"),
        ("queue/bulk@rate", "queue/bulk"),
    ],
)
def test_a_flow_key_names_its_limit(flow_key: Any, name: str) -> None:
    assert limit_name(flow_key) == name
