"""How a stored ``jobs``/``job_stages``/``schedules`` row reads as the public type.

Each row has every column distinct, so a column read in place of another, a
default lost or a state's rule changed shows in the object callers get.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from jobplane.schedule_spec import CatchUp, Overlap, Spec
from jobplane.schedule_types import JobTemplate, Schedule
from jobplane.store.rows import event_from_row, job_from_row, stage_from_row
from jobplane.store.schedules import schedule_from_row
from jobplane.types import (
    BlobRef,
    DependencyFailurePolicy,
    EventType,
    FanOut,
    Job,
    JobError,
    JobEvent,
    JobState,
    Stage,
    StageState,
)

_ID = uuid.UUID("11111111-1111-4111-8111-111111111111")
_AFTER = (
    uuid.UUID("22222222-2222-4222-8222-222222222222"),
    uuid.UUID("33333333-3333-4333-8333-333333333333"),
)
_PARENT = uuid.UUID("44444444-4444-4444-8444-444444444444")
_T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def _at(minutes: int) -> datetime:
    return _T0 + timedelta(minutes=minutes)


def _job_row(**changes: Any) -> dict[str, Any]:
    """A succeeded pipeline job's row, every column its own value."""
    row: dict[str, Any] = {
        "id": _ID,
        "tenant_id": "tenant-a",
        "type": "stage-type",
        "queue": "q1",
        "state": "succeeded",
        "payload": json.dumps({"in": 1}),
        "result": {"out": 2},
        "error_code": "FLAKY",
        "error_message": "it broke",
        "error_retryable": 1,
        "progress": "0.25",
        "progress_message": "a quarter",
        "attempt": 7,
        "max_attempts": 9,
        "retry_base": 3,
        "request_id": "req-1",
        "correlation_id": "corr-1",
        "labels": json.dumps({"team": "x"}),
        "dispatch_id": uuid.uuid4(),
        "lease_token": 5,
        "lease_expires_at": _at(50),
        "cancel_requested_at": _at(6),
        "next_attempt_time": _at(7),
        "last_seq": "41",
        "create_time": _at(1),
        "update_time": _at(2),
        "start_time": _at(3),
        "end_time": _at(4),
        "timeout_seconds": "90.5",
        "waiting_reason": "why it waits",
        "waiting_code": "SOME_CODE",
        "payload_blob": "aa" * 32,
        "payload_blob_size": 123,
        "result_blob": "bb" * 32,
        "result_blob_size": 456,
        "pipeline": "the-pipeline",
        "pipeline_version": "v3",
        "stage": 2,
        "stage_name": "resize",
        "stage_base": 0,
        "stage_span": 1,
        "schedule_time": _at(8),
        "concurrency_key": "ck",
        "concurrency_limit": 4,
        "deadline": _at(9),
        "after_ids": list(_AFTER),
        "after_failure": "run_anyway",
        "parent_id": _PARENT,
        "fan_stage": 2,
        "fan_size": 10,
        "deps_waiting": 6,
        "deps_failed": 2,
    }
    row.update(changes)
    return row


def test_a_succeeded_job_row_reads_every_column_into_its_field() -> None:
    expected = Job(
        name=f"jobs/{_ID}",
        type="the-pipeline",
        state=JobState.SUCCEEDED,
        payload={"in": 1},
        result={"out": 2},
        error=JobError("FLAKY", "it broke", retryable=True),
        progress=0.25,
        progress_message="a quarter",
        attempt=7,
        max_attempts=9,
        request_id="req-1",
        correlation_id="corr-1",
        labels={"team": "x"},
        create_time=_at(1),
        update_time=_at(2),
        start_time=_at(3),
        end_time=_at(4),
        next_attempt_time=None,
        cancel_requested=True,
        last_seq=41,
        timeout=timedelta(seconds=90.5),
        waiting_reason="",
        waiting_code="",
        attempts_used=4,
        stage="resize",
        pipeline_version="v3",
        payload_blob=BlobRef(f"blobs/{'aa' * 32}", "aa" * 32, 123),
        result_blob=BlobRef(f"blobs/{'bb' * 32}", "bb" * 32, 456),
        schedule_time=_at(8),
        concurrency_key="ck",
        concurrency_limit=4,
        deadline=_at(9),
        after=(f"jobs/{_AFTER[0]}", f"jobs/{_AFTER[1]}"),
        after_failure=DependencyFailurePolicy.RUN_ANYWAY,
        parent=f"jobs/{_PARENT}",
        # Not waiting at its fan-out any more: every child counts as ended.
        fan_out=FanOut("resize", 10, 10, 2),
    )
    assert job_from_row(_job_row()) == expected


def test_a_plain_job_row_without_the_optional_columns_reads_their_defaults() -> None:
    row = _job_row(
        state="running",
        pipeline=None,
        pipeline_version=None,
        stage_name=None,
        error_code=None,
        error_message=None,
        error_retryable=None,
        cancel_requested_at=None,
        payload_blob=None,
        result_blob="cc" * 32,
    )
    for column in (
        "schedule_time",
        "concurrency_key",
        "concurrency_limit",
        "deadline",
        "after_ids",
        "after_failure",
        "parent_id",
        "fan_stage",
    ):
        del row[column]
    job = job_from_row(row)
    assert (job.type, job.stage, job.pipeline_version) == ("stage-type", "", "")
    assert (job.error, job.cancel_requested, job.payload_blob) == (None, False, None)
    # Only a succeeded job shows its result, inline or as a blob.
    assert (job.result, job.result_blob) == (None, None)
    # Waiting reasons and the next attempt's time are a queued job's only.
    assert (job.next_attempt_time, job.waiting_reason, job.waiting_code) == (None, "", "")
    assert (job.schedule_time, job.deadline, job.concurrency_key) == (None, None, "")
    assert (job.concurrency_limit, job.after, job.parent) == (0, (), "")
    assert job.after_failure is DependencyFailurePolicy.FAIL
    assert job.fan_out is None


def test_a_failed_job_row_reads_its_error_with_an_empty_message_when_none() -> None:
    row = _job_row(state="failed", error_message=None, error_retryable=0, payload_blob_size=None)
    job = job_from_row(row)
    assert job.error == JobError("FLAKY", "", retryable=False)
    assert job.payload_blob == BlobRef(f"blobs/{'aa' * 32}", "aa" * 32, 0)
    # Failed (or cancelled) while it waited at its fan-out: only the ended children count.
    assert job.fan_out == FanOut("resize", 10, 4, 2)
    assert job_from_row(_job_row(state="cancelled")).fan_out == FanOut("resize", 10, 4, 2)


def test_a_queued_job_row_reads_why_it_waits_and_its_next_attempt() -> None:
    row = _job_row(state="queued", result_blob=None, deps_waiting=None, deps_failed=None)
    job = job_from_row(row, now=_at(100))
    assert job.state is JobState.QUEUED
    assert (job.result, job.result_blob) == (None, None)
    assert job.next_attempt_time == _at(7)
    assert (job.waiting_reason, job.waiting_code) == ("why it waits", "SOME_CODE")
    assert job.fan_out == FanOut("resize", 10, 10, 0)


def test_a_queued_job_row_due_later_reads_as_scheduled_at_the_given_time() -> None:
    row = _job_row(state="queued", waiting_reason=None, waiting_code=None, schedule_time=_at(30))
    early = job_from_row(row, now=_at(29))
    assert early.waiting_code == "SCHEDULED"
    assert early.waiting_reason == f"scheduled: due at {_at(30).isoformat()}"
    due = job_from_row(row, now=_at(30))
    assert (due.waiting_code, due.waiting_reason) == ("", "")


def test_a_job_row_fanned_out_at_another_stage_names_no_stage() -> None:
    # Waiting at a later stage; the fan-out was an earlier one's: all ended.
    row = _job_row(state="cancelled", fan_stage=1, fan_size=None, deps_waiting=3)
    assert job_from_row(row).fan_out == FanOut("", 0, 0, 2)
    waiting = _job_row(state="queued", fan_size=2, deps_waiting=5, stage_name=None)
    # More waiting than children (a count ahead of its rows) never reads negative.
    assert job_from_row(waiting, now=_at(100)).fan_out == FanOut("", 2, 0, 2)


def _stage_row(**changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "name": "resize",
        "type": "image.resize",
        "version": "v2",
        "state": "succeeded",
        "attempts": "3",
        "max_attempts": "5",
        "timeout_seconds": "12.5",
        "start_time": _at(1),
        "end_time": _at(2),
        "error_code": "OOM",
        "error_message": "out of memory",
        "result": json.dumps({"w": 10}),
        "fan_out": 1,
        "max_failures": 4,
        "fail_fast": 1,
    }
    row.update(changes)
    return row


def test_a_stage_row_reads_every_column_into_its_field() -> None:
    assert stage_from_row(_stage_row()) == Stage(
        name="resize",
        type="image.resize",
        version="v2",
        state=StageState.SUCCEEDED,
        attempts=3,
        max_attempts=5,
        timeout=timedelta(seconds=12.5),
        start_time=_at(1),
        end_time=_at(2),
        error=JobError("OOM", "out of memory", retryable=True),
        result={"w": 10},
        fan_out=True,
        max_failures=4,
        fail_fast=True,
    )


def test_a_stage_rows_error_is_retryable_only_while_the_stage_has_not_ended() -> None:
    for state, retryable in (("failed", False), ("cancelled", False), ("running", True)):
        stage = stage_from_row(_stage_row(state=state, error_message=None))
        assert stage.error == JobError("OOM", "", retryable=retryable), state
        assert stage.result is None, state


def test_a_stage_row_without_the_fan_out_columns_reads_their_defaults() -> None:
    row = _stage_row(error_code=None, max_failures=None)
    del row["fan_out"], row["fail_fast"]
    stage = stage_from_row(row)
    assert (stage.error, stage.fan_out, stage.max_failures, stage.fail_fast) == (
        None,
        False,
        0,
        False,
    )


def test_a_job_event_row_reads_every_column_into_its_field() -> None:
    row = {
        "job_id": _ID,
        "seq": "5",
        "type": "progress",
        "state": "running",
        "progress": "0.5",
        "message": "half",
        "data": json.dumps({"step": 2}),
        "event_time": _at(3),
        "attempt": "2",
        "stage": "resize",
    }
    assert event_from_row(row) == JobEvent(
        name=f"jobs/{_ID}",
        seq=5,
        type=EventType.PROGRESS,
        state=JobState.RUNNING,
        progress=0.5,
        message="half",
        event_time=_at(3),
        attempt=2,
        data={"step": 2},
        stage="resize",
    )
    assert event_from_row({**row, "stage": None}).stage == ""


def _schedule_row(**changes: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": "nightly",
        "uid": uuid.uuid4(),
        "description": "every night",
        "job_type": "report.build",
        "payload": {"day": 1},
        "labels": {"team": "x"},
        "max_attempts": 4,
        "timeout_seconds": 30.5,
        "cron": "0 3 * * *",
        "time_zone": "Europe/Paris",
        "interval_seconds": 600,
        "start_time": _at(1),
        "end_time": _at(2),
        "jitter_seconds": 15,
        "overlap": "allow_all",
        "catch_up": "all",
        "catch_up_limit": 7,
        "paused": False,
        "anchor_time": _at(0),
        "next_tick": _at(3),
        "next_run_time": _at(4),
        "buffered_tick": None,
        "last_run_time": _at(5),
        "recent_runs": [_AFTER[1], _AFTER[0]],
        "runs": 12,
        "skipped": 3,
        "last_error": "type not routed",
        "create_time": _at(6),
        "update_time": _at(7),
    }
    row.update(changes)
    return row


def test_a_schedule_row_reads_every_column_into_its_field() -> None:
    assert schedule_from_row(_schedule_row()) == Schedule(
        name="schedules/nightly",
        template=JobTemplate(
            type="report.build",
            payload={"day": 1},
            labels={"team": "x"},
            max_attempts=4,
            timeout_seconds=30.5,
        ),
        spec=Spec(
            cron="0 3 * * *",
            time_zone="Europe/Paris",
            interval_seconds=600,
            start_time=_at(1),
            end_time=_at(2),
            jitter_seconds=15,
        ),
        description="every night",
        overlap=Overlap.ALLOW_ALL,
        catch_up=CatchUp.ALL,
        catch_up_limit=7,
        paused=False,
        next_run_time=_at(4),
        last_run_time=_at(5),
        recent_runs=(f"jobs/{_AFTER[1]}", f"jobs/{_AFTER[0]}"),
        runs=12,
        skipped=3,
        last_error="type not routed",
        create_time=_at(6),
        update_time=_at(7),
    )


def test_a_paused_schedule_row_reads_no_next_run() -> None:
    schedule = schedule_from_row(_schedule_row(paused=True))
    assert (schedule.paused, schedule.next_run_time) == (True, None)
