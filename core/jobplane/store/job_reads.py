"""The reads of the job table for the API: one job, pages of jobs, counts, event streams.

Every statement is scoped by tenant: another tenant's job is simply not found.
:class:`~jobplane.store.jobs.JobStore` runs them; what is here is their SQL
and the shapes of their results.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import text

from jobplane.store.machine import AnyConn, fetch_rows
from jobplane.store.rows import JOB_COLUMNS, job_from_row, stage_from_row
from jobplane.types import Job, JobEvent, JobState


@dataclass(frozen=True, slots=True)
class ListCursor:
    """Keyset position: the last job of the previous page."""

    create_time: datetime
    job_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class StreamRead:
    """A watcher's read: the next events, and whether nothing will follow them."""

    events: list[JobEvent]
    ended: bool
    last_seq: int  # the job's last seq when read


SELECT_JOB = text(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = :id AND tenant_id = :tenant_id")
_SELECT_STAGES = text(
    "SELECT name, type, version, state, attempts, max_attempts, timeout_seconds, start_time, "
    "end_time, error_code, error_message, result, fan_out, max_failures, fail_fast "
    "FROM job_stages "
    "WHERE job_id = :id AND tenant_id = :tenant_id ORDER BY idx"
)

# Many watchers' reads in one statement: for each (job, tenant, after_seq) the
# next events and the job's state, all from one snapshot. A job missing from
# the result (no row with its k) does not exist for that tenant.
READ_STREAMS = text(
    """
    SELECT w.k, j.state AS job_state, j.last_seq AS job_last_seq,
           e.job_id, e.seq, e.type, e.state, e.progress, e.message, e.data, e.attempt,
           e.event_time, e.stage
    FROM unnest(CAST(:ids AS uuid[]), CAST(:tenants AS uuid[]), CAST(:afters AS bigint[]))
        WITH ORDINALITY AS w(id, tenant_id, after_seq, k)
    JOIN jobs j ON j.id = w.id AND j.tenant_id = w.tenant_id
    LEFT JOIN LATERAL (
        SELECT * FROM job_events
        WHERE job_id = j.id AND seq > w.after_seq
        ORDER BY seq
        LIMIT :limit
    ) e ON true
    ORDER BY w.k, e.seq
    """
)


# One capped count a state, each through jobs_tenant_state_newest.
COUNT_STATES = text(
    ", ".join(
        f"(SELECT count(*) FROM (SELECT 1 FROM jobs WHERE tenant_id = :tenant_id "
        f"AND state = :state{i} LIMIT :cap) c{i})"
        for i, _state in enumerate(JobState)
    ).join(("SELECT ", ""))
)
STATE_PARAMS = {f"state{i}": state.value for i, state in enumerate(JobState)}
MILESTONES = text(
    """
    SELECT e.job_id, e.seq, e.type, e.state, e.progress, e.message, e.data, e.attempt,
           e.event_time, e.stage
    FROM job_events e JOIN jobs j ON j.id = e.job_id AND j.tenant_id = :tenant_id
    WHERE e.job_id = :id AND e.type <> 'progress'
    ORDER BY e.seq
    LIMIT :limit
    """
)
QUEUE_RATES = text(
    """
    SELECT queue,
           count(*) FILTER (WHERE create_time > now() - make_interval(secs => :window)),
           count(*) FILTER (WHERE state = :succeeded
                            AND end_time > now() - make_interval(secs => :window)),
           count(*) FILTER (WHERE state = :failed
                            AND end_time > now() - make_interval(secs => :window))
    FROM (
        SELECT queue, state, create_time, end_time FROM jobs
        WHERE tenant_id = :tenant_id AND create_time > now() - interval '1 hour'
        ORDER BY create_time DESC, id DESC
        LIMIT :scan
    ) recent
    GROUP BY queue
    """
)


async def with_stages(conn: AnyConn, row: Any) -> Job:
    """The job of ``row``, with its stages when it is a pipeline job."""
    job = job_from_row(row)
    if row["pipeline"] is None:
        return job
    found = await fetch_rows(conn, _SELECT_STAGES, {"id": row["id"], "tenant_id": row["tenant_id"]})
    stages = tuple(stage_from_row(r) for r in found)
    fan_out = job.fan_out
    if fan_out is not None and not fan_out.stage and 0 <= row["fan_stage"] < len(stages):
        # Past its fan-out stage: named by the stage's row.
        fan_out = replace(fan_out, stage=stages[row["fan_stage"]].name)
    return replace(job, stages=stages, fan_out=fan_out)
