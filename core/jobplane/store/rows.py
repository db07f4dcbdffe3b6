"""Rows to public types, the job's columns and the channels of NOTIFY hints."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from jobplane.errors import PayloadTooLarge
from jobplane.names import job_name
from jobplane.scheduling import scheduled
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

EVENTS_CHANNEL = "jobplane_events"
CANCEL_CHANNEL = "jobplane_cancel"
OUTBOX_CHANNEL = "jobplane_outbox"
# Payload: the tenant whose events were appended (SubscribeEvents reads again).
DOMAIN_EVENTS_CHANNEL = "jobplane_domain_events"

# Every column of a job a reader gets, in this order.
JOB_FIELDS = (
    "id",
    "tenant_id",
    "type",
    "queue",
    "state",
    "payload",
    "result",
    "error_code",
    "error_message",
    "error_retryable",
    "progress",
    "progress_message",
    "attempt",
    "max_attempts",
    "retry_base",
    "request_id",
    "correlation_id",
    "labels",
    "dispatch_id",
    "lease_token",
    "lease_expires_at",
    "cancel_requested_at",
    "next_attempt_time",
    "last_seq",
    "create_time",
    "update_time",
    "start_time",
    "end_time",
    "timeout_seconds",
    "waiting_reason",
    "waiting_code",
    "payload_blob",
    "payload_blob_size",
    "result_blob",
    "result_blob_size",
    "pipeline",
    "pipeline_version",
    "stage",
    "stage_name",
    "stage_base",
    "stage_span",
    "schedule_time",
    # Concurrency keys (docs/flow-control.md).
    "concurrency_key",
    "concurrency_limit",
    # Deadlines (docs/scheduling.md#deadlines).
    "deadline",
    # Dependencies (docs/workflows.md).
    "after_ids",
    "after_failure",
    # Child jobs (docs/workflows.md): the job that submitted it, or NULL.
    "parent_id",
    # Fan-out (ADR-0047): the stage whose children it waits or waited for
    # (NULL: none), how many, and the counts their ends keep.
    "fan_stage",
    "fan_size",
    "deps_waiting",
    "deps_failed",
)
JOB_COLUMNS = ", ".join(JOB_FIELDS)


def dumps(value: Any) -> str:
    """Compact JSON for a jsonb bind."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def check_payload_size(payload: Any, limit: int) -> None:
    """Refuse a payload larger than ``limit`` bytes as stored (compact JSON).

    The one size check of a job's or an event's payload, wherever it is
    written: SubmitJob, PublishEvent, ``ctx.emit``.
    """
    sized_json(payload, limit)


def sized_json(payload: Any, limit: int) -> str:
    """:func:`check_payload_size`, and the payload's compact JSON it measured."""
    text = dumps(payload)
    # A character is at most 4 bytes in UTF-8: most payloads need no encoding to know.
    size = len(text) if len(text) * 4 <= limit or text.isascii() else len(text.encode())
    if size > limit:
        raise PayloadTooLarge(
            f"payload is {size} bytes serialized; the limit is {limit}",
            field="payload",
            metadata={"limit": str(limit), "size": str(size)},
        )
    return text


def _json(value: Any) -> Any:
    # asyncpg hands jsonb back as text unless a codec is set; accept both.
    if isinstance(value, str):
        return json.loads(value)
    return value


def job_from_row(row: Mapping[Any, Any], now: datetime | None = None) -> Job:
    """A :class:`Job` from a ``jobs`` row, as it reads at ``now`` (None: the clock's)."""
    state = JobState(row["state"])
    error = None
    if row["error_code"]:
        error = JobError(
            code=row["error_code"],
            message=row["error_message"] or "",
            retryable=bool(row["error_retryable"]),
        )
    result = _json(row["result"])
    job = Job(
        name=job_name(row["id"]),
        # A pipeline job's type is its pipeline's name; the row's is its stage's.
        type=row["pipeline"] or row["type"],
        state=state,
        payload=_json(row["payload"]),
        result=result if state is JobState.SUCCEEDED else None,
        error=error,
        progress=float(row["progress"]),
        progress_message=row["progress_message"],
        attempt=int(row["attempt"]),
        max_attempts=int(row["max_attempts"]),
        request_id=row["request_id"],
        correlation_id=row["correlation_id"],
        labels=dict(_json(row["labels"])),
        create_time=row["create_time"],
        update_time=row["update_time"],
        start_time=row["start_time"],
        end_time=row["end_time"],
        next_attempt_time=row["next_attempt_time"] if state is JobState.QUEUED else None,
        cancel_requested=row["cancel_requested_at"] is not None,
        last_seq=int(row["last_seq"]),
        timeout=timedelta(seconds=float(row["timeout_seconds"])),
        waiting_reason=(row["waiting_reason"] or "") if state is JobState.QUEUED else "",
        waiting_code=(row["waiting_code"] or "") if state is JobState.QUEUED else "",
        attempts_used=int(row["attempt"]) - int(row["retry_base"]),
        stage=row["stage_name"] or "",
        pipeline_version=row["pipeline_version"] or "",
        payload_blob=_blob_ref(row, "payload_blob"),
        result_blob=_blob_ref(row, "result_blob") if state is JobState.SUCCEEDED else None,
        schedule_time=row.get("schedule_time"),
        concurrency_key=row.get("concurrency_key") or "",
        concurrency_limit=int(row.get("concurrency_limit") or 0),
        deadline=row.get("deadline"),
        after=tuple(job_name(a) for a in row.get("after_ids") or ()),
        after_failure=DependencyFailurePolicy(row.get("after_failure") or "fail"),
        parent=job_name(parent) if (parent := row.get("parent_id")) else "",
        fan_out=_fan_out(row),
    )
    return scheduled(job, now) if state is JobState.QUEUED else job


def _fan_out(row: Mapping[Any, Any]) -> FanOut | None:
    """The counts of a job's last fan-out; its stage's name is the job's own
    while it waits at it (``with_stages`` names it otherwise)."""
    if row.get("fan_stage") is None:
        return None
    size = int(row.get("fan_size") or 0)
    waiting = row["fan_stage"] == row["stage"] and row["state"] in ("queued", "failed", "cancelled")
    ended = size - int(row.get("deps_waiting") or 0) if waiting else size
    stage = row["stage_name"] if row["fan_stage"] == row["stage"] else ""
    return FanOut(stage or "", size, max(ended, 0), int(row.get("deps_failed") or 0))


def _blob_ref(row: Mapping[Any, Any], column: str) -> BlobRef | None:
    digest = row.get(column)
    if not digest:
        return None
    return BlobRef(name=f"blobs/{digest}", sha256=digest, size=int(row.get(f"{column}_size") or 0))


def stage_from_row(row: Mapping[Any, Any]) -> Stage:
    """A :class:`Stage` from a ``job_stages`` row."""
    state = StageState(row["state"])
    error = None
    if row["error_code"]:
        ended = state in (StageState.FAILED, StageState.CANCELLED)
        error = JobError(row["error_code"], row["error_message"] or "", retryable=not ended)
    return Stage(
        name=row["name"],
        type=row["type"],
        version=row["version"],
        state=state,
        attempts=int(row["attempts"]),
        max_attempts=int(row["max_attempts"]),
        timeout=timedelta(seconds=float(row["timeout_seconds"])),
        start_time=row["start_time"],
        end_time=row["end_time"],
        error=error,
        result=_json(row["result"]) if state is StageState.SUCCEEDED else None,
        fan_out=bool(row.get("fan_out", False)),
        max_failures=int(row.get("max_failures") or 0),
        fail_fast=bool(row.get("fail_fast", False)),
    )


def event_from_row(row: Mapping[Any, Any]) -> JobEvent:
    """A :class:`JobEvent` from a ``job_events`` row."""
    return JobEvent(
        name=job_name(row["job_id"]),
        seq=int(row["seq"]),
        type=EventType(row["type"]),
        state=JobState(row["state"]),
        progress=float(row["progress"]),
        message=row["message"],
        data=_json(row["data"]),
        event_time=row["event_time"],
        attempt=int(row["attempt"]),
        stage=row["stage"] or "",
    )
