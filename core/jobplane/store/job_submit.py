"""The submit path of the job table: a validated request, its row, and its replays.

:class:`~jobplane.store.jobs.JobStore` writes a new job through the machine's
SUBMIT transition; what is here turns a request into the row that statement
binds, and finds the stored job of a request_id already taken.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from jobplane.errors import BlobReferenceNotFound, JobplaneError, RequestIdReused
from jobplane.ids import new_id
from jobplane.store.db import Conn
from jobplane.store.down import sqlstate
from jobplane.store.job_reads import with_stages
from jobplane.store.machine import (
    SUBMIT_COLUMNS,
    AnyConn,
    Cause,
    NewStage,
    Row,
    StateMachine,
    Transition,
)
from jobplane.store.rows import JOB_COLUMNS, dumps
from jobplane.topology import PipelineSpec
from jobplane.types import (
    BlobRef,
    ConcurrencyMode,
    DependencyFailurePolicy,
    Job,
    Stage,
    StageState,
)

# The limits of a job's request, the same for SubmitJob (jobplane.server.
# job_requests), a schedule's template and a handler's child.
MAX_ATTEMPTS_LIMIT = 100
# The relay sends correlation_id as the AMQP correlation-id property, a short
# string of at most 255 bytes: a longer one could never be published.
MAX_CORRELATION_ID_BYTES = 255
# A job's timeout is read back in whole milliseconds or finer; anything
# shorter would read back as no time at all.
MIN_TIMEOUT_SECONDS = 0.001
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class NewJob:
    """A validated SubmitJob request."""

    type: str
    queue: str
    payload: dict[str, Any]
    request_id: str
    max_attempts: int
    correlation_id: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    timeout_seconds: float = 3600.0
    #: A pipeline job's stages (``type`` is then the pipeline's name, and
    #: max_attempts / timeout_seconds what the request set: 0 for the stages' own).
    stages: tuple[NewStage, ...] = ()
    pipeline_version: str = ""
    #: The payload by reference (``payload`` is then ``{}``).
    payload_blob: BlobRef | None = None
    #: Digests of blobs the job references beyond its payload's names.
    blob_references: tuple[str, ...] = ()
    #: Delayed jobs: when it may first start (None: at once). Not part of the
    #: request's identity: a delay's time differs on every retry (ADR-0039).
    schedule_time: datetime | None = None
    # Concurrency keys (docs/flow-control.md, ADR-0040): None for no key.
    concurrency_key: str | None = None
    concurrency_limit: int = 0
    concurrency_mode: ConcurrencyMode = ConcurrencyMode.QUEUE
    #: Deadlines (ADR-0044): when the job must have ended (None: no deadline).
    #: Not part of the request's identity, as schedule_time is not.
    deadline: datetime | None = None
    # Dependencies (docs/workflows.md, ADR-0045): the ids of the jobs it runs after.
    after: tuple[uuid.UUID, ...] = ()
    after_failure: DependencyFailurePolicy = DependencyFailurePolicy.FAIL
    #: Child jobs (ADR-0046): the job whose running attempt submitted it. Not
    #: part of the request's identity: its request_id names the parent already.
    parent_id: uuid.UUID | None = None

    #: ``payload`` as compact JSON (:func:`~jobplane.store.rows.dumps`), when the
    #: request's checks encoded it already; None: encoded when needed. It must
    #: be the payload's: a copy that changes ``payload`` drops it.
    payload_json: str | None = field(default=None, compare=False, repr=False)

    def encoded_payload(self) -> str:
        """``payload`` as compact JSON, encoded once."""
        return self.payload_json if self.payload_json is not None else dumps(self.payload)

    def fingerprint(self) -> bytes:
        """A digest of the request, stored with the job: equal digests are the same request.

        (Different digests may still be: the replay check compares the stored values.)
        The digest is of the compact JSON of the request's fields, in a fixed
        order; the payload's part is its encoding, spliced in rather than
        encoded again.
        """
        rest = {
            "max_attempts": self.max_attempts,
            "correlation_id": self.correlation_id,
            "labels": self.labels,
            "timeout_seconds": self.timeout_seconds,
            # Only when set: the digests of jobs submitted before stay theirs.
            **({"payload_blob": self.payload_blob.sha256} if self.payload_blob else {}),
            **({"blob_references": sorted(self.blob_references)} if self.blob_references else {}),
            **(
                {
                    "concurrency_key": self.concurrency_key,
                    "concurrency_limit": self.concurrency_limit,
                    "concurrency_mode": self.concurrency_mode.value,
                }
                if self.concurrency_key is not None
                else {}
            ),
            **(
                {
                    "after": [str(a) for a in self.after],
                    "after_failure": self.after_failure.value,
                }
                if self.after
                else {}
            ),
        }
        # dumps({"type": …, "payload": …, **rest}), the payload's text as it is.
        canonical = (
            f'{{"type":{dumps(self.type)},"payload":{self.encoded_payload()},{dumps(rest)[1:]}'
        )
        return hashlib.sha256(canonical.encode()).digest()


def pipeline_stages(
    pipeline: PipelineSpec, *, max_attempts: int = 0, timeout_seconds: float | None = None
) -> tuple[NewStage, ...]:
    """The stages of a new job of ``pipeline``, each with its share of the job's progress.

    ``max_attempts`` and ``timeout_seconds``, when set, replace every stage's own.
    """
    total = sum(stage.weight for stage in pipeline.stages)
    stages = []
    done = 0.0
    for stage in pipeline.stages:
        stages.append(
            NewStage(
                name=stage.name,
                type=stage.type,
                queue=stage.queue,
                version=stage.version,
                max_attempts=max_attempts or stage.max_attempts,
                timeout_seconds=timeout_seconds or stage.timeout_seconds,
                base=done / total,
                span=stage.weight / total,
                fan_out=stage.fan_out,
                max_failures=stage.max_failures,
                fail_fast=stage.fail_fast,
            )
        )
        done += stage.weight
    return tuple(stages)


_FOREIGN_KEY_VIOLATION = "23503"
# The same request is the same stored values, compared as Postgres compares
# them (jsonb: key order and 1 vs 1.0 do not matter), as jobplane.submit_job
# compares them: a request replayed through the other path is the same one.
# For many requests at once (k: the request's index), bound as arrays.
_REPLAY_COLUMNS = (
    "request_id",
    "type",
    "payload",
    "max_attempts",
    "correlation_id",
    "labels",
    "timeout_seconds",
    "payload_blob",
)
_SELECT_BY_REQUESTS = text(
    f"""
    SELECT {JOB_COLUMNS}, request_hash, r.k,
           (coalesce(pipeline, type) = r.r_type AND payload = CAST(r.r_payload AS jsonb)
            AND max_attempts = r.r_max_attempts AND correlation_id = r.r_correlation_id
            AND labels = CAST(r.r_labels AS jsonb) AND timeout_seconds = r.r_timeout_seconds
            AND payload_blob IS NOT DISTINCT FROM r.r_payload_blob)
               AS same_request
    FROM unnest(CAST(:ks AS int[]), CAST(:r_request_id AS text[]), CAST(:r_type AS text[]),
                CAST(:r_payload AS text[]), CAST(:r_max_attempts AS int[]),
                CAST(:r_correlation_id AS text[]), CAST(:r_labels AS text[]),
                CAST(:r_timeout_seconds AS float8[]), CAST(:r_payload_blob AS text[]))
        AS r(k, r_request_id, r_type, r_payload, r_max_attempts, r_correlation_id, r_labels,
             r_timeout_seconds, r_payload_blob)
    JOIN jobs ON jobs.tenant_id = :tenant_id AND jobs.request_id = r.r_request_id
    """
)


def submitted(job: Job, stages: Sequence[NewStage]) -> Job:
    """A job just submitted, with its stages as the submit wrote them."""
    if not stages:
        return job
    written = tuple(
        Stage(
            name=st.name,
            type=st.type,
            version=st.version,
            state=StageState.QUEUED if i == 0 else StageState.PENDING,
            attempts=0,
            max_attempts=st.max_attempts,
            timeout=timedelta(seconds=st.timeout_seconds),
        )
        for i, st in enumerate(stages)
    )
    return replace(job, stages=written)


def submit_columns(new: NewJob, job_id: uuid.UUID) -> dict[str, Any]:
    """The row of ``new`` as the submit statement binds it (SUBMIT_COLUMNS)."""
    return dict(zip(SUBMIT_COLUMNS, submit_values(new, job_id, new_id()), strict=True))


def submit_values(new: NewJob, job_id: uuid.UUID, dispatch_id: uuid.UUID) -> list[Any]:
    """The row of ``new``, values in the order of SUBMIT_COLUMNS."""
    blob = new.payload_blob
    keyed = new.concurrency_key is not None
    if not new.stages:
        return [
            job_id,
            new.type,
            new.queue,
            new.encoded_payload(),
            new.max_attempts,
            new.request_id,
            new.fingerprint(),
            new.correlation_id,
            dumps(new.labels),
            dispatch_id,
            new.timeout_seconds,
            # A plain job's pipeline columns.
            None,
            None,
            None,
            None,
            0.0,
            1.0,
            blob.sha256 if blob else None,
            blob.size if blob else None,
            new.schedule_time,
            new.concurrency_key,
            new.concurrency_limit if keyed else None,
            new.deadline,
            # The dependencies' columns (store.dependencies gives them).
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            new.parent_id,
        ]
    # The row runs the first stage: its type, queue, budget and share.
    first = new.stages[0]
    values = submit_values(replace(new, stages=()), job_id, dispatch_id)
    for column, value in (
        ("type", first.type),
        ("queue", first.queue),
        ("max_attempts", first.max_attempts),
        ("timeout_seconds", first.timeout_seconds),
        ("pipeline", new.type),
        ("pipeline_version", new.pipeline_version),
        ("stage", 0),
        ("stage_name", first.name),
        ("stage_base", first.base),
        ("stage_span", first.span),
    ):
        values[_AT[column]] = value
    return values


# Each SUBMIT column's place in submit_values' list.
_AT = {column: i for i, column in enumerate(SUBMIT_COLUMNS)}


def submit_binds(
    news: Sequence[NewJob],
    ids: Sequence[uuid.UUID],
    extra: Sequence[Mapping[str, Any]] = (),
) -> dict[str, list[Any]]:
    """The SUBMIT statement's arrays (``new_<column>``) for ``news`` under ``ids``, in
    their order; ``extra``: more columns of each, over its own.

    A column NULL for every job is bound as an empty array: unnest pads the
    shorter arrays with NULLs, so the statement reads the same rows, and the
    column costs nothing to encode, send or read.
    """
    rows = []
    for i, new in enumerate(news):
        row = submit_values(new, ids[i], new_id())
        for column, value in extra[i].items() if extra else ():
            row[_AT[column]] = value
        rows.append(row)
    columns = zip(*rows, strict=True) if rows else ((),) * len(SUBMIT_COLUMNS)
    return {
        f"new_{name}": [] if values.count(None) == len(rows) else list(values)
        for name, values in zip(SUBMIT_COLUMNS, columns, strict=True)
    }


async def find_replays(
    conn: Conn, tenant_id: uuid.UUID, news: Sequence[NewJob], indexes: Sequence[int]
) -> dict[int, Job | JobplaneError]:
    """For the requests at ``indexes``, whose request_ids were taken: the stored
    job, or :class:`RequestIdReused` when it was stored for a different request."""
    rows = [(i, submit_columns(news[i], uuid.UUID(int=0))) for i in indexes]
    params = {
        "tenant_id": tenant_id,
        "ks": list(indexes),
        **{f"r_{c}": [row[c] for _, row in rows] for c in _REPLAY_COLUMNS},
        # The job's type is the pipeline's for a pipeline job.
        "r_type": [news[i].type for i in indexes],
    }
    found = {int(row["k"]): row for row in await conn.fetch(_SELECT_BY_REQUESTS, params)}
    replays: dict[int, Job | JobplaneError] = {}
    for i, row in rows:
        existing = found.get(i)
        if existing is None:
            raise RuntimeError(f"request_id {news[i].request_id!r} conflicted but has no job")
        if bytes(existing["request_hash"]) != row["request_hash"] and not existing["same_request"]:
            replays[i] = RequestIdReused(
                f"request_id {news[i].request_id!r} was used for a different request",
                field="request_id",
            )
        else:
            replays[i] = await with_stages(conn, existing)
    return replays


async def insert_jobs(
    machine: StateMachine,
    conn: AnyConn,
    tenant_id: uuid.UUID,
    news: Sequence[NewJob],
    ids: Sequence[uuid.UUID],
    *,
    field: str,
    extra: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Row]:
    """Insert ``news`` under ``ids`` by the SUBMIT transition (a taken request_id
    is skipped); the rows written, by job id. ``extra``: more columns of each
    (the dependencies' of store.dependencies), over its own; a column neither
    gives is NULL. A blob referenced that is gone raises
    :class:`BlobReferenceNotFound` naming ``field``."""
    # Inserted in request_id order (see the machine's submit statement).
    order = sorted(range(len(news)), key=lambda i: news[i].request_id)
    params: dict[str, Any] = {
        "tenant_id": tenant_id,
        **submit_binds(
            [news[i] for i in order],
            [ids[i] for i in order],
            [extra[i] for i in order] if extra else (),
        ),
    }
    cause = Cause(
        "queued",
        stages=[(ids[i], news[i].stages) for i in order if news[i].stages],
        blobs=[(ids[i], news[i].blob_references) for i in order if news[i].blob_references],
    )
    try:
        created = await machine.apply(conn, Transition.SUBMIT, params, cause)
    except IntegrityError as exc:
        # The references' trigger found a blob gone since the caller's
        # check (deleted meanwhile): nothing was written.
        if sqlstate(exc) == _FOREIGN_KEY_VIOLATION:
            raise BlobReferenceNotFound(
                "the payload references a blob that does not exist", field=field
            ) from None
        raise
    return {str(row["id"]): row for row in created}
