"""The API side of the job table: submit, read, list, cancel, retry, events.

Every statement is scoped by tenant: another tenant's job is simply not found.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.errors import (
    BlobReferenceNotFound,
    InvalidArgument,
    JobAlreadyTerminal,
    JobNotFound,
    JobNotRetryable,
    JobplaneError,
    RequestIdReused,
    at_item,
    shown,
)
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.ids import new_id
from jobplane.store.db import Conn, Database
from jobplane.store.down import sqlstate
from jobplane.store.engine import autocommit
from jobplane.store.machine import (
    MACHINE,
    SUBMIT_COLUMNS,
    AnyConn,
    Cause,
    NewStage,
    Row,
    StateMachine,
    Transition,
    fetch_rows,
)
from jobplane.store.rows import JOB_COLUMNS, dumps, event_from_row, job_from_row, stage_from_row
from jobplane.topology import PipelineSpec
from jobplane.types import BlobRef, Job, JobEvent, JobState, Stage, StageState


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

    def fingerprint(self) -> bytes:
        """A digest of the request, stored with the job: equal digests are the same request.

        (Different digests may still be: the replay check compares the stored values.)
        """
        canonical = dumps(
            {
                "type": self.type,
                "payload": self.payload,
                "max_attempts": self.max_attempts,
                "correlation_id": self.correlation_id,
                "labels": self.labels,
                "timeout_seconds": self.timeout_seconds,
                # Only when set: the digests of jobs submitted before stay theirs.
                **({"payload_blob": self.payload_blob.sha256} if self.payload_blob else {}),
                **(
                    {"blob_references": sorted(self.blob_references)}
                    if self.blob_references
                    else {}
                ),
            }
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
            )
        )
        done += stage.weight
    return tuple(stages)


@dataclass(frozen=True, slots=True)
class ListCursor:
    """Keyset position: the last job of the previous page."""

    create_time: datetime
    job_id: uuid.UUID


_SELECT_JOB = text(f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = :id AND tenant_id = :tenant_id")
_SELECT_STAGES = text(
    "SELECT name, type, version, state, attempts, max_attempts, timeout_seconds, start_time, "
    "end_time, error_code, error_message, result FROM job_stages "
    "WHERE job_id = :id AND tenant_id = :tenant_id ORDER BY idx"
)
_STAGE_INDEX = text(
    "SELECT idx FROM job_stages WHERE job_id = :id AND tenant_id = :tenant_id AND name = :name"
)
_FOREIGN_KEY_VIOLATION = "23503"

# A plain job's pipeline columns.
_PLAIN: dict[str, Any] = {
    "pipeline": None,
    "pipeline_version": None,
    "stage": None,
    "stage_name": None,
    "stage_base": 0.0,
    "stage_span": 1.0,
}
_SELECT_JOB_FOR_UPDATE = text(
    f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = :id AND tenant_id = :tenant_id FOR UPDATE"
)
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

# Many watchers' reads in one statement: for each (job, tenant, after_seq) the
# next events and the job's state, all from one snapshot. A job missing from
# the result (no row with its k) does not exist for that tenant.
_READ_STREAMS = text(
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
_COUNT_STATES = text(
    ", ".join(
        f"(SELECT count(*) FROM (SELECT 1 FROM jobs WHERE tenant_id = :tenant_id "
        f"AND state = :state{i} LIMIT :cap) c{i})"
        for i, _state in enumerate(JobState)
    ).join(("SELECT ", ""))
)
_STATE_PARAMS = {f"state{i}": state.value for i, state in enumerate(JobState)}
_MILESTONES = text(
    """
    SELECT e.job_id, e.seq, e.type, e.state, e.progress, e.message, e.data, e.attempt,
           e.event_time, e.stage
    FROM job_events e JOIN jobs j ON j.id = e.job_id AND j.tenant_id = :tenant_id
    WHERE e.job_id = :id AND e.type <> 'progress'
    ORDER BY e.seq
    LIMIT :limit
    """
)
_QUEUE_RATES = text(
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


@dataclass(frozen=True, slots=True)
class StreamRead:
    """A watcher's read: the next events, and whether nothing will follow them."""

    events: list[JobEvent]
    ended: bool
    last_seq: int  # the job's last seq when read


class JobStore:
    """Job reads and writes for the API, one short transaction each."""

    def __init__(
        self,
        engine: AsyncEngine,
        db: Database,
        *,
        faults: FaultPoints = NO_FAULTS,
        machine: StateMachine = MACHINE,
    ) -> None:
        self._engine = engine
        # Submits and the watch read run on asyncpg (ADR-0030).
        self._db = db
        # Single statements need no BEGIN/COMMIT round trips of their own.
        self._auto = autocommit(engine)
        self._faults = faults
        self._machine = machine

    async def submit(self, tenant_id: uuid.UUID, new: NewJob) -> tuple[Job, bool]:
        """Create the job and, by the machine's hooks, its first event and its
        outbox row, in one statement: a job exists iff its dispatch intent does.

        Returns the job and whether it was created now. A replay with the same
        request_id and the same request returns the stored job; a different
        request with that request_id raises :class:`RequestIdReused`.
        """
        (submitted,) = await self.submit_each(tenant_id, [new])
        if isinstance(submitted, BaseException):
            raise submitted
        return submitted

    async def submit_each(
        self, tenant_id: uuid.UUID, news: Sequence[NewJob]
    ) -> list[tuple[Job, bool] | JobplaneError]:
        """:meth:`submit` for several independent requests in one statement.

        Each request has its own result, in order: its job and whether it was
        created now, or the :class:`RequestIdReused` it alone is refused with
        (nothing of it written); the others are unaffected. The request_ids
        must differ from each other. A blob one of them references that was
        deleted since the caller checked it refuses the statement
        (:class:`BlobReferenceNotFound`, nothing written): submit each alone
        to learn whose.
        """
        ids = [new_id() for _ in news]
        async with self._machine.session(self._db, Transition.SUBMIT) as conn:
            rows = await self._insert(conn, tenant_id, news, ids, field="payload")
        missing = [i for i, job_id in enumerate(ids) if str(job_id) not in rows]
        if len(missing) < len(news):
            # Committed; a failure here loses only the replies (the callers'
            # retries with the same request_ids get these jobs).
            self._faults.hit("submit.after_commit")
        replays: dict[int, Job | JobplaneError] = {}
        if missing:
            # Their request_ids exist: ON CONFLICT waited for those inserts to
            # commit, so they are visible now.
            async with self._db.connect() as conn:
                replays = await _replays(conn, tenant_id, news, missing)
        return [
            (_submitted(job_from_row(rows[str(ids[i])]), news[i].stages), True)
            if i not in replays
            else (replay if isinstance(replay := replays[i], JobplaneError) else (replay, False))
            for i in range(len(news))
        ]

    async def submit_many(
        self, tenant_id: uuid.UUID, news: Sequence[NewJob]
    ) -> list[tuple[Job, bool]]:
        """:meth:`submit` for many jobs in one transaction and one statement.

        Each job in order with whether it was created now: a job whose
        request_id the tenant has used is the stored one (not created). When
        one of them reuses a request_id for a different request,
        :class:`RequestIdReused` at its index (:func:`at_item`) and nothing is
        written. The request_ids must differ from each other.
        """
        ids = [new_id() for _ in news]
        replayed: dict[int, Job] = {}
        # A batch is one transaction: a refused replay in it undoes the rest.
        async with self._machine.session(self._db, Transition.SUBMIT, many=True) as conn:
            rows = await self._insert(conn, tenant_id, news, ids, field="requests")
            missing = [i for i, job_id in enumerate(ids) if str(job_id) not in rows]
            if missing:
                for i, replay in (await _replays(conn, tenant_id, news, missing)).items():
                    if isinstance(replay, JobplaneError):
                        raise at_item(replay, i)
                    replayed[i] = replay
        if rows:
            self._faults.hit("submit.after_commit")
        return [
            (replayed[i], False)
            if i in replayed
            else (_submitted(job_from_row(rows[str(ids[i])]), news[i].stages), True)
            for i in range(len(news))
        ]

    async def _insert(
        self,
        conn: Conn,
        tenant_id: uuid.UUID,
        news: Sequence[NewJob],
        ids: Sequence[uuid.UUID],
        *,
        field: str,
    ) -> dict[str, Row]:
        """Insert ``news`` under ``ids`` (a taken request_id is skipped); the rows
        written, by job id."""
        # Inserted in request_id order (see the machine's submit statement).
        order = sorted(range(len(news)), key=lambda i: news[i].request_id)
        columns = [_submit_columns(news[i], ids[i]) for i in order]
        params: dict[str, Any] = {
            "tenant_id": tenant_id,
            **{f"new_{c}": [row[c] for row in columns] for c in SUBMIT_COLUMNS},
        }
        cause = Cause(
            "queued",
            stages=[(ids[i], news[i].stages) for i in order if news[i].stages],
            blobs=[(ids[i], news[i].blob_references) for i in order if news[i].blob_references],
        )
        try:
            created = await self._machine.apply(conn, Transition.SUBMIT, params, cause)
        except IntegrityError as exc:
            # The references' trigger found a blob gone since the caller's
            # check (deleted meanwhile): nothing was written.
            if sqlstate(exc) == _FOREIGN_KEY_VIOLATION:
                raise BlobReferenceNotFound(
                    "the payload references a blob that does not exist", field=field
                ) from None
            raise
        return {str(row["id"]): row for row in created}

    async def get(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job:
        """One job of the tenant; :class:`JobNotFound` otherwise."""
        async with self._auto.connect() as conn:
            row = (
                (await conn.execute(_SELECT_JOB, {"id": job_id, "tenant_id": tenant_id}))
                .mappings()
                .first()
            )
            if row is None:
                raise JobNotFound(f"jobs/{job_id} not found")
            return await _with_stages(conn, row)

    async def list_jobs(
        self,
        tenant_id: uuid.UUID,
        *,
        limit: int,
        after: ListCursor | None = None,
        state: JobState | None = None,
        job_type: str | None = None,
        labels: dict[str, str] | None = None,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
    ) -> list[Job]:
        """Up to ``limit`` jobs, newest first, strictly after ``after``.

        ``job_type``: plain jobs of that type and the jobs of the pipeline of
        that name, whatever stage they are at. ``labels``: jobs that carry all
        of them; ``created_after`` (inclusive) and ``created_before``
        (exclusive) bound the create time.
        """
        where = ["tenant_id = :tenant_id"]
        params: dict[str, Any] = {"tenant_id": tenant_id, "limit": limit}
        if labels:
            where.append("labels @> CAST(:labels AS jsonb)")
            params["labels"] = dumps(labels)
        if created_after is not None:
            where.append("create_time >= :created_after")
            params["created_after"] = created_after
        if created_before is not None:
            where.append("create_time < :created_before")
            params["created_before"] = created_before
        if state is not None:
            where.append("state = :state")
            params["state"] = state.value
        if after is not None:
            where.append("(create_time, id) < (:after_time, :after_id)")
            params["after_time"] = after.create_time
            params["after_id"] = after.job_id
        order = "ORDER BY create_time DESC, id DESC LIMIT :limit"
        if job_type is None:
            sql = text(f"SELECT {JOB_COLUMNS} FROM jobs WHERE {' AND '.join(where)} {order}")
        else:
            # A pipeline job is stored under the pipeline's name (its type is
            # the running stage's), a plain job under its type. Both are read
            # from the rows, not from the topology: a server whose topology
            # no longer (or not yet) declares the pipeline still lists its
            # jobs. Each half walks its own newest-first index.
            params["type"] = job_type
            halves = (
                " AND ".join([*where, "pipeline = :type"]),
                " AND ".join([*where, "type = :type", "pipeline IS NULL"]),
            )
            sql = text(
                " UNION ALL ".join(
                    f"(SELECT {JOB_COLUMNS} FROM jobs WHERE {h} {order})" for h in halves
                )
                + f" {order}"
            )
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql, params)).mappings().all()
        return [job_from_row(r) for r in rows]

    async def count_states(self, tenant_id: uuid.UUID, *, cap: int) -> dict[JobState, int]:
        """The tenant's jobs in each state, each count stopping at ``cap``.

        Capped, so that a tenant with millions of jobs costs ``cap`` index
        entries a state, not a scan of them all.
        """
        async with self._auto.connect() as conn:
            row = (
                await conn.execute(
                    _COUNT_STATES, {**_STATE_PARAMS, "tenant_id": tenant_id, "cap": cap}
                )
            ).one()
        return {state: int(count) for state, count in zip(JobState, row, strict=True)}

    async def milestones(
        self, tenant_id: uuid.UUID, job_id: uuid.UUID, limit: int
    ) -> list[JobEvent]:
        """The job's events other than progress reports, oldest first (at most ``limit``)."""
        async with self._auto.connect() as conn:
            rows = (
                await conn.execute(
                    _MILESTONES, {"id": job_id, "tenant_id": tenant_id, "limit": limit}
                )
            ).mappings()
            return [event_from_row(r) for r in rows]

    async def queue_rates(
        self, tenant_id: uuid.UUID, *, window_seconds: float, scan: int
    ) -> dict[str, tuple[int, int, int]]:
        """Per queue, the tenant's jobs submitted, succeeded and failed in the last
        ``window_seconds``, among its ``scan`` newest jobs created in the last hour."""
        async with self._auto.connect() as conn:
            rows = await conn.execute(
                _QUEUE_RATES,
                {
                    "tenant_id": tenant_id,
                    "window": window_seconds,
                    "scan": scan,
                    "succeeded": JobState.SUCCEEDED.value,
                    "failed": JobState.FAILED.value,
                },
            )
            return {str(q): (int(a), int(b), int(c)) for q, a, b, c in rows}

    async def cancel(self, tenant_id: uuid.UUID, job_id: uuid.UUID, reason: str) -> Job:
        """QUEUED → CANCELLED now; RUNNING → cancellation requested; terminal → error."""
        reason = reason or "cancelled by request"
        params = {"id": job_id, "tenant_id": tenant_id, "reason": reason}
        async with self._engine.begin() as conn:
            current = await self._lock(conn, tenant_id, job_id)
            if current.state is JobState.QUEUED:
                # The hooks drop a pending (re)dispatch, so nothing is published.
                row = await self._one(conn, Transition.CANCEL, params, Cause(reason))
                return await _with_stages(conn, row)
            if current.state is JobState.RUNNING:
                if current.cancel_requested:
                    return current
                # The hooks wake the worker that runs it.
                row = await self._one(conn, Transition.REQUEST_CANCEL, params, Cause(reason))
                return await _with_stages(conn, row)
        raise JobAlreadyTerminal(f"jobs/{job_id} is already {current.state.name}")

    async def retry(self, tenant_id: uuid.UUID, job_id: uuid.UUID, *, from_stage: str = "") -> Job:
        """A FAILED or CANCELLED job → QUEUED for a new attempt, through the outbox.

        A pipeline job resumes at its stage (the one that failed or was
        cancelled); ``from_stage`` restarts it at that stage instead. Either
        way the stages before it keep their results and are not run again.
        """
        dispatch_id = new_id()
        async with self._engine.begin() as conn:
            current = await self._lock(conn, tenant_id, job_id)
            if current.state not in (JobState.FAILED, JobState.CANCELLED):
                raise JobNotRetryable(
                    f"jobs/{job_id} is {current.state.name}; only FAILED or CANCELLED "
                    "jobs can be retried"
                )
            params: dict[str, Any] = {
                "id": job_id,
                "tenant_id": tenant_id,
                "dispatch_id": dispatch_id,
            }
            transition = Transition.RETRY
            cause = Cause("retry requested")
            if from_stage:
                found = (
                    await conn.execute(_STAGE_INDEX, {**params, "name": from_stage})
                ).scalar_one_or_none()
                if found is None:
                    what = "has no stage" if current.stage else "is not a pipeline job; no stage"
                    raise InvalidArgument(
                        f"jobs/{job_id} {what} named {shown(from_stage)}", field="from_stage"
                    )
                transition = Transition.RESTART
                params["stage"] = int(found)
                cause = Cause(f"restart requested from stage {from_stage}")
            # The hooks write the new dispatch and reset the stages.
            row = await self._one(conn, transition, params, cause)
            return await _with_stages(conn, row)

    async def read_stream(
        self, tenant_id: uuid.UUID, job_id: uuid.UUID, after_seq: int, limit: int = 500
    ) -> StreamRead:
        """Events with seq > ``after_seq`` (at most ``limit``), and whether the job
        has ended with them; :class:`JobNotFound` when there is no such job."""
        read = (await self.read_streams([(tenant_id, job_id, after_seq)], limit))[0]
        if read is None:
            raise JobNotFound(f"jobs/{job_id} not found")
        return read

    async def read_streams(
        self, wanted: Sequence[tuple[uuid.UUID, uuid.UUID, int]], limit: int = 500
    ) -> list[StreamRead | None]:
        """:meth:`read_stream` for many (tenant, job, after_seq) at once, in one
        statement; None for a job that does not exist (for that tenant)."""
        rows = await self._db.fetch(
            _READ_STREAMS,
            {
                "ids": [job_id for _, job_id, _ in wanted],
                "tenants": [tenant for tenant, _, _ in wanted],
                "afters": [after for _, _, after in wanted],
                "limit": limit,
            },
        )
        by_k: dict[int, list[Any]] = {}
        for row in rows:
            by_k.setdefault(int(row["k"]), []).append(row)
        reads: list[StreamRead | None] = []
        for k, (_, _, after_seq) in enumerate(wanted, start=1):
            found = by_k.get(k)
            if not found:
                reads.append(None)
                continue
            events = [event_from_row(r) for r in found if r["seq"] is not None]
            last_sent = events[-1].seq if events else after_seq
            last_seq = int(found[0]["job_last_seq"])
            ended = JobState(found[0]["job_state"]).terminal and last_sent >= last_seq
            reads.append(StreamRead(events=events, ended=ended, last_seq=last_seq))
        return reads

    async def _one(
        self, conn: AsyncConnection, transition: Transition, params: dict[str, Any], cause: Cause
    ) -> Any:
        """Apply ``transition`` to a job locked in state; the row after (it must match)."""
        rows = await self._machine.apply(conn, transition, params, cause)
        if len(rows) != 1:
            raise RuntimeError(f"{transition} did not apply to a job locked in a state it allows")
        return rows[0]

    async def _lock(self, conn: AsyncConnection, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job:
        row = (
            (await conn.execute(_SELECT_JOB_FOR_UPDATE, {"id": job_id, "tenant_id": tenant_id}))
            .mappings()
            .first()
        )
        if row is None:
            raise JobNotFound(f"jobs/{job_id} not found")
        return job_from_row(row)


async def _with_stages(conn: AnyConn, row: Any) -> Job:
    """The job of ``row``, with its stages when it is a pipeline job."""
    job = job_from_row(row)
    if row["pipeline"] is None:
        return job
    found = await fetch_rows(conn, _SELECT_STAGES, {"id": row["id"], "tenant_id": row["tenant_id"]})
    return replace(job, stages=tuple(stage_from_row(r) for r in found))


def _submitted(job: Job, stages: Sequence[NewStage]) -> Job:
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


def _submit_columns(new: NewJob, job_id: uuid.UUID) -> dict[str, Any]:
    """The row of ``new`` as the submit statement binds it (SUBMIT_COLUMNS)."""
    row: dict[str, Any] = {
        "id": job_id,
        "type": new.type,
        "queue": new.queue,
        "payload": dumps(new.payload),
        "max_attempts": new.max_attempts,
        "request_id": new.request_id,
        "request_hash": new.fingerprint(),
        "correlation_id": new.correlation_id,
        "labels": dumps(new.labels),
        "dispatch_id": new_id(),
        "timeout_seconds": new.timeout_seconds,
        "payload_blob": new.payload_blob.sha256 if new.payload_blob else None,
        "payload_blob_size": new.payload_blob.size if new.payload_blob else None,
        **_PLAIN,
    }
    if new.stages:
        # The row runs the first stage: its type, queue, budget and share.
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


async def _replays(
    conn: Conn, tenant_id: uuid.UUID, news: Sequence[NewJob], indexes: Sequence[int]
) -> dict[int, Job | JobplaneError]:
    """For the requests at ``indexes``, whose request_ids were taken: the stored
    job, or :class:`RequestIdReused` when it was stored for a different request."""
    rows = [(i, _submit_columns(news[i], uuid.UUID(int=0))) for i in indexes]
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
            replays[i] = await _with_stages(conn, existing)
    return replays
