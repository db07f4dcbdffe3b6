"""Rows to public types, and the SQL shared by every writer of job events."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from jobplane.names import job_name
from jobplane.types import EventType, Job, JobError, JobEvent, JobState

EVENTS_CHANNEL = "jobplane_events"
CANCEL_CHANNEL = "jobplane_cancel"
OUTBOX_CHANNEL = "jobplane_outbox"
# Payload: the tenant whose events were appended (SubscribeEvents reads again).
DOMAIN_EVENTS_CHANNEL = "jobplane_domain_events"

JOB_COLUMNS = """
    id, tenant_id, type, queue, state, payload, result, error_code, error_message,
    error_retryable, progress, progress_message, attempt, max_attempts, retry_base,
    request_id, correlation_id, labels, dispatch_id, lease_token, lease_expires_at,
    cancel_requested_at, next_attempt_time, last_seq, create_time, update_time,
    start_time, end_time, timeout_seconds, waiting_reason
"""


# What the event of a transition is made of; every transition returns these.
_EVENT_SOURCE = "id, tenant_id, state, progress, attempt, last_seq"


def transition_sql(set_clause: str, where_clause: str, returning: str = JOB_COLUMNS) -> str:
    """One statement that updates a job and appends one event under its row lock.

    The UPDATE takes the row lock and bumps ``last_seq``; the event gets that
    seq, so seqs are gap-free and in commit order for each job. The NOTIFY is a
    hint for watchers, sent at commit. Binds: ``:event_type``,
    ``:event_message``, ``:event_data`` (JSON text) plus the clauses' own.
    The statement returns the ``returning`` columns of the updated row (all of
    them by default; decoding fewer is cheaper) — no row when none matched.
    """
    if returning == JOB_COLUMNS:
        columns, selected = JOB_COLUMNS, "j.*"
    else:
        wanted = [c.strip() for c in returning.split(",")]
        source = [c.strip() for c in _EVENT_SOURCE.split(",")]
        columns = ", ".join(source + [c for c in wanted if c not in source])
        selected = ", ".join(f"j.{c}" for c in wanted)
    return f"""
    WITH j AS (
        UPDATE jobs SET {set_clause}, last_seq = last_seq + 1, update_time = now()
        WHERE {where_clause}
        RETURNING {columns}
    ), e AS (
        INSERT INTO job_events
            (job_id, seq, tenant_id, type, state, progress, message, data, attempt)
        SELECT id, last_seq, tenant_id, :event_type, state, progress, :event_message,
               CAST(:event_data AS jsonb), attempt
        FROM j
    )
    SELECT {selected}, pg_notify('{EVENTS_CHANNEL}', j.id::text) AS notified FROM j
    """


# A job's next dispatch, due at its next_attempt_time (now when unset): the
# outbox row whose id the job's dispatch_id names. Binds: :id, :dispatch_id.
OUTBOX_FOR_JOB_SQL = f"""
    WITH o AS (
        INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id, available_at)
        SELECT :dispatch_id, tenant_id, id, type, correlation_id, coalesce(next_attempt_time, now())
        FROM jobs WHERE id = :id
    )
    SELECT pg_notify('{OUTBOX_CHANNEL}', '')
"""


def dumps(value: Any) -> str:
    """Compact JSON for a jsonb bind."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _json(value: Any) -> Any:
    # asyncpg hands jsonb back as text unless a codec is set; accept both.
    if isinstance(value, str):
        return json.loads(value)
    return value


def job_from_row(row: Mapping[Any, Any]) -> Job:
    """A :class:`Job` from a ``jobs`` row."""
    state = JobState(row["state"])
    error = None
    if row["error_code"]:
        error = JobError(
            code=row["error_code"],
            message=row["error_message"] or "",
            retryable=bool(row["error_retryable"]),
        )
    result = _json(row["result"])
    return Job(
        name=job_name(row["id"]),
        type=row["type"],
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
        attempts_used=int(row["attempt"]) - int(row["retry_base"]),
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
    )
