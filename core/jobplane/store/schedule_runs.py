"""A schedule's run: its template submitted as SubmitJob would, in the ticker's transaction.

A plain job type goes through ``jobplane.submit_job``, which routes it and
checks it as the RPC does. A pipeline of the ticker's topology (ADR-0017) is
written through the state machine's SUBMIT transition, as the RPC writes a
pipeline job: its stages as the topology declares them now go with it. A
ticker whose topology does not declare the pipeline hands it to
``jobplane.submit_job`` too, which refuses it (the refusal is the schedule's
``last_error``): the stages are the topology's, not the database's.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.errors import BlobReferenceNotFound
from jobplane.ids import new_id
from jobplane.schedule_types import SCHEDULE_LABEL, Schedule
from jobplane.store.down import sqlstate
from jobplane.store.job_submit import NewJob, pipeline_stages, submit_columns
from jobplane.store.machine import MACHINE, SUBMIT_COLUMNS, Cause, Transition
from jobplane.topology import PipelineSpec, Topology
from jobplane.txn import submit_job

__all__ = ["submit_template"]

_BY_REQUEST = text("SELECT id FROM jobs WHERE tenant_id = :tenant_id AND request_id = :request_id")
_FOREIGN_KEY_VIOLATION = "23503"


async def submit_template(
    conn: AsyncConnection,
    row: Mapping[Any, Any],
    schedule: Schedule,
    request_id: str,
    topology: Topology | None,
) -> uuid.UUID:
    """SubmitJob of ``schedule``'s template in ``conn``'s transaction, carrying the
    schedule's name; the job's id (the first one's, for a request_id used before)."""
    template = schedule.template
    labels = {**template.labels, SCHEDULE_LABEL: schedule.name}
    pipeline = topology.pipeline(template.type) if topology is not None else None
    if pipeline is not None:
        return await _submit_pipeline(
            conn, row["tenant_id"], schedule, pipeline, labels, request_id
        )
    return await submit_job(
        conn,
        tenant=row["tenant_name"],
        type=template.type,
        payload=template.payload,
        request_id=request_id,
        max_attempts=template.max_attempts,
        labels=labels,
        attempt_timeout=template.timeout_seconds,
    )


async def _submit_pipeline(
    conn: AsyncConnection,
    tenant_id: uuid.UUID,
    schedule: Schedule,
    pipeline: PipelineSpec,
    labels: dict[str, str],
    request_id: str,
) -> uuid.UUID:
    """A pipeline job, as ``JobService.submit`` writes one (its row, first stage,
    first event, dispatch and job.queued in one statement)."""
    template = schedule.template
    stages = pipeline_stages(
        pipeline, max_attempts=template.max_attempts, timeout_seconds=template.timeout_seconds
    )
    new = NewJob(
        type=pipeline.name,
        queue=stages[0].queue,
        payload=template.payload,
        request_id=request_id,
        max_attempts=template.max_attempts,
        labels=labels,
        timeout_seconds=template.timeout_seconds or 0.0,
        pipeline_version=pipeline.version,
        stages=stages,
    )
    job_id = new_id()
    columns = submit_columns(new, job_id)
    # A column the job does not set (its dependencies: none) is NULL.
    params = {"tenant_id": tenant_id, **{f"new_{c}": [columns.get(c)] for c in SUBMIT_COLUMNS}}
    try:
        created = await MACHINE.apply(
            conn, Transition.SUBMIT, params, Cause("queued", stages=[(job_id, stages)])
        )
    except IntegrityError as exc:
        # The payload names a blob deleted since the schedule was written.
        if sqlstate(exc) == _FOREIGN_KEY_VIOLATION:
            raise BlobReferenceNotFound(
                "the payload references a blob that does not exist", field="payload"
            ) from None
        raise
    if created:
        return job_id
    # The request_id is taken: this tick (or trigger) ran before.
    found = await conn.execute(_BY_REQUEST, {"tenant_id": tenant_id, "request_id": request_id})
    return uuid.UUID(str(found.scalar_one()))
