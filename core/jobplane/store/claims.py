"""A claim of a delivered job: the attempt it starts, and what else a delivery may find.

:class:`~jobplane.store.attempts.AttemptStore` claims through the machine's
CLAIM transition; what is here is the attempt that claim hands the worker
(the fence of its later writes), the answers a claim or a hand-back can
give, and how a claimed row is read back into an :class:`Attempt`.
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text

from jobplane.envelope import Envelope
from jobplane.fanout import ItemResult
from jobplane.names import job_name
from jobplane.store.db import Conn
from jobplane.store.machine import Cause, Returning
from jobplane.types import BlobRef, JobError, JobState


class ClaimStatus(enum.Enum):
    """What a worker found when it tried to claim a delivered job."""

    CLAIMED = "claimed"
    NOT_FOUND = "not_found"  # no such job for that tenant: dead-letter the message
    FINISHED = "finished"  # terminal already: a duplicate, ack it
    STALE = "stale"  # the message is for an older dispatch: ack it
    IN_FLIGHT = "in_flight"  # another attempt holds a live lease
    EXHAUSTED = "exhausted"  # no attempts left; the job was failed now
    HELD = "held"  # its key or a flow limit holds it (ADR-0040, ADR-0043); ack it


class HandBack(enum.Enum):
    """What became of a job a worker without its handler gave back."""

    HANDED_BACK = "handed_back"  # a new dispatch is due shortly, for another worker
    PARKED = "parked"  # no live worker handles it: no dispatch until one starts
    NOT_QUEUED = "not_queued"  # finished, running, or the message is stale: ack it
    NOT_FOUND = "not_found"  # no such job for that tenant: dead-letter the message


@dataclass(frozen=True, slots=True)
class StageRun:
    """The stage of a pipeline job an attempt runs, and what the stages before it returned."""

    pipeline: str
    pipeline_version: str
    name: str
    index: int
    count: int
    version: str
    #: The results of the stages before this one, by stage name, in order.
    inputs: Mapping[str, dict[str, Any]]
    #: The next stage is a fan-out stage: this one returns its items (ADR-0047).
    fans_out: bool = False
    #: The stage before was a fan-out stage: its children's results, in item
    #: order (None for any other stage).
    results: tuple[ItemResult, ...] | None = None

    @property
    def last(self) -> bool:
        """Whether this is the pipeline's last stage."""
        return self.index == self.count - 1


@dataclass(frozen=True, slots=True)
class Attempt:
    """A claimed attempt: what the handler needs, and the fence of its writes."""

    job_id: uuid.UUID
    tenant_id: uuid.UUID
    type: str
    payload: dict[str, Any]
    attempt: int
    max_attempts: int
    retry_base: int
    lease_token: uuid.UUID
    correlation_id: str
    request_id: str
    timeout_seconds: float = 3600.0
    queue: str = ""
    #: The event_id of this attempt's ``job.started`` (the default cause of
    #: the events its handler emits); None for a job from before lifecycle
    #: events had ids.
    started_event_id: uuid.UUID | None = None
    #: The pipeline stage this attempt runs; None for a plain job.
    stage: StageRun | None = None
    #: The blob holding the payload when it was submitted by reference
    #: (``payload`` is then ``{}``; the worker reads the blob for the handler).
    payload_blob: BlobRef | None = None
    #: When the job was submitted (for the submit-to-start metric); None when not read.
    create_time: datetime | None = None

    @property
    def attempts_left(self) -> int:
        """Attempts still allowed after this one."""
        return self.max_attempts - (self.attempt - self.retry_base)

    @property
    def budget_attempt(self) -> int:
        """This attempt's number within its budget, from 1: the stage's for a pipeline job.

        ``attempt`` counts every attempt of the job, across its stages; a
        retry's backoff grows with this one, or a late stage's first retry
        would wait as long as if it had failed for every earlier stage's
        attempts too.
        """
        return self.attempt - self.retry_base

    def fence(self) -> dict[str, Any]:
        """Bind parameters of the fence."""
        return {"id": self.job_id, "attempt": self.attempt, "lease_token": self.lease_token}


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """The outcome of :meth:`AttemptStore.claim`."""

    status: ClaimStatus
    attempt: Attempt | None = None
    lease_expires_at: datetime | None = None
    state: JobState | None = None
    #: HELD: the job's waiting code now, and the flow limit that holds it
    #: ('' for its concurrency key).
    waiting_code: str = ""
    limit: str = ""


@dataclass(frozen=True, slots=True)
class ClaimRequest:
    """A delivery to claim in a group: its envelope, the lease token its attempt
    will hold, and the claim's binds (taken in the delivery's own context)."""

    envelope: Envelope
    lease_token: uuid.UUID
    binds: Mapping[str, Any]
    #: The claiming worker's id (a claim its key refused is tried again alone).
    worker: str = ""


CLAIMED: Returning = (
    "type",
    "payload",
    "payload_blob",
    "payload_blob_size",
    "attempt",
    "max_attempts",
    "retry_base",
    "correlation_id",
    "request_id",
    "timeout_seconds",
    "queue",
    "lifecycle_seq",
    "pipeline",
    "pipeline_version",
    "stage",
    "create_time",
)
# A pipeline job's stages, for the one that runs: its version, and the
# results of those before it.
_STAGES = text(
    "SELECT idx, name, version, result, fan_out FROM job_stages WHERE job_id = :id ORDER BY idx"
)
# The children of the job's last fan-out, in item order (ADR-0047).
_CHILDREN = text(
    """
    SELECT d.idx, x.id, x.state, x.result, x.error_code, x.error_message, x.error_retryable
    FROM job_dependencies d JOIN jobs x ON x.id = d.depends_on
    WHERE d.job_id = :id AND d.idx IS NOT NULL
    ORDER BY d.idx
    """
)
INSPECT = text(
    """
    SELECT state, dispatch_id, type, lease_expires_at, lease_expires_at < now() AS lease_expired,
           attempt - retry_base >= max_attempts AS exhausted, tenant_id, concurrency_key,
           flow_key, coalesce(deadline <= now(), false) AS past_deadline
    FROM jobs WHERE id = :id AND tenant_id = :tenant_id
    """
)


def limit_name(flow_key: Any) -> str:
    """The limit a ``jobs.flow_key`` names: a ``[[rate_limits]]`` entry's name, or
    ``queue/{queue}`` for a queue's per-tenant limit; '' for none."""
    if not flow_key:
        return ""
    kind, _, rest = str(flow_key).removesuffix("@rate").partition("/")
    name = rest.split("/", 1)[0]
    return name if kind == "limit" else f"queue/{name}"


def claim_cause(worker: str) -> Cause:
    """Why an attempt started: its worker, for the dashboard's attempts."""
    return Cause("attempt started", {"worker": worker} if worker else {})


def attempt_from_row(
    job_id: uuid.UUID,
    tenant_id: uuid.UUID,
    lease_token: uuid.UUID,
    row: Any,
    stage: StageRun | None,
    started_event_id: uuid.UUID | None = None,
) -> Attempt:
    """The :class:`Attempt` of a claimed (or read back) job ``row`` under ``lease_token``."""
    return Attempt(
        job_id=job_id,
        tenant_id=tenant_id,
        type=row["type"],
        payload=_obj(row["payload"]),
        attempt=int(row["attempt"]),
        max_attempts=int(row["max_attempts"]),
        retry_base=int(row["retry_base"]),
        lease_token=lease_token,
        correlation_id=row["correlation_id"],
        request_id=row["request_id"],
        timeout_seconds=float(row["timeout_seconds"]),
        queue=row["queue"],
        started_event_id=started_event_id,
        stage=stage,
        payload_blob=(
            BlobRef(f"blobs/{digest}", digest, int(row.get("payload_blob_size") or 0))
            if (digest := row.get("payload_blob"))
            else None
        ),
        create_time=row.get("create_time"),
    )


async def stage_run(conn: Conn, job_id: uuid.UUID, row: Any) -> StageRun:
    """The stage a claimed ``row`` of a pipeline job runs, with the results before it.

    ``row`` has the job's ``stage``, ``pipeline`` and ``pipeline_version``.
    """
    index = int(row["stage"])
    stages = await conn.fetch(_STAGES, {"id": job_id})
    inputs = {
        s["name"]: _obj(s["result"]) for s in stages if s["idx"] < index and s["result"] is not None
    }
    current = next(s for s in stages if s["idx"] == index)
    fans_out = any(s["idx"] == index + 1 and s["fan_out"] for s in stages)
    joins = any(s["idx"] == index - 1 and s["fan_out"] for s in stages)
    return StageRun(
        pipeline=str(row["pipeline"]),
        pipeline_version=str(row["pipeline_version"] or ""),
        name=str(current["name"]),
        index=index,
        count=len(stages),
        version=str(current["version"]),
        inputs=inputs,
        fans_out=fans_out,
        results=await item_results(conn, job_id) if joins else None,
    )


async def item_results(conn: Conn, job_id: uuid.UUID) -> tuple[ItemResult, ...]:
    """The results of the children of ``job_id``'s last fan-out, in item order."""
    results = []
    for row in await conn.fetch(_CHILDREN, {"id": job_id}):
        state = JobState(row["state"])
        error = None
        if row["error_code"] is not None and state is not JobState.SUCCEEDED:
            code, message = str(row["error_code"]), str(row["error_message"] or "")
            error = JobError(code, message, bool(row["error_retryable"]))
        results.append(
            ItemResult(
                index=int(row["idx"]) - 1,
                job=job_name(row["id"]),
                state=state,
                result=_obj(row["result"]) if row["result"] is not None else None,
                error=error,
            )
        )
    return tuple(results)


def _obj(value: Any) -> dict[str, Any]:
    parsed = json.loads(value) if isinstance(value, str) else value
    return dict(parsed)
