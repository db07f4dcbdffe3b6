"""The API side of the job table: submit, read, list, cancel, retry, events.

Every statement is scoped by tenant: another tenant's job is simply not found.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import structlog
from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.errors import (
    InvalidArgument,
    JobAlreadyTerminal,
    JobNotFound,
    JobNotRetryable,
    JobplaneError,
    at_item,
    shown,
)
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.ids import new_id
from jobplane.store.children import cancel_descendants
from jobplane.store.concurrency import refuse_full_keys, rejects, release_key
from jobplane.store.db import Conn, Database
from jobplane.store.dependencies import (
    Found,
    check_after,
    decide,
    decided_at_submit,
    dependency_columns,
    has_after,
)
from jobplane.store.down import again_on_conflict
from jobplane.store.engine import autocommit
from jobplane.store.fan_retry import fanned, refuse_while_parent_waits, rejoin
from jobplane.store.job_reads import (
    COUNT_STATES,
    MILESTONES,
    QUEUE_RATES,
    READ_STREAMS,
    SELECT_JOB,
    STATE_PARAMS,
    ListCursor,
    StreamRead,
    with_stages,
)
from jobplane.store.job_submit import (
    NewJob,
    find_replays,
    insert_jobs,
    pipeline_stages,
    submitted,
)
from jobplane.store.job_tree import JobTree, read_tree
from jobplane.store.machine import (
    MACHINE,
    Cause,
    Row,
    StateMachine,
    Transition,
)
from jobplane.store.rows import JOB_COLUMNS, dumps, event_from_row, job_from_row
from jobplane.types import Job, JobEvent, JobState, WaitingCode

# Named here by the API's callers (and the bench), wherever they are defined.
__all__ = ["JobStore", "ListCursor", "NewJob", "StreamRead", "pipeline_stages"]

log = structlog.get_logger("jobplane.store")

_STAGE_INDEX = text(
    "SELECT idx, fan_out FROM job_stages "
    "WHERE job_id = :id AND tenant_id = :tenant_id AND name = :name"
)
# A job waiting for its fan-out's children waits for them again when retried.
_DEPS_WAITING = text(
    "SELECT CASE WHEN fan_stage = stage THEN 0 ELSE deps_waiting END FROM jobs WHERE id = :id"
)
_SELECT_JOB_FOR_UPDATE = text(
    f"SELECT {JOB_COLUMNS} FROM jobs WHERE id = :id AND tenant_id = :tenant_id FOR UPDATE"
)


def waiting_filter(code: str, now: datetime) -> tuple[list[str], dict[str, Any]]:
    """The conditions (and their binds) of the QUEUED jobs that read with ``code``
    at ``now``, as :func:`~jobplane.scheduling.scheduled` reads them: a stored
    code wins; ``SCHEDULED`` is a job without one whose schedule_time is still
    ahead. The QUEUED state keeps the walk on the tenant's queued jobs
    (``jobs_tenant_state_newest``), newest first, never the jobs that ended."""
    where = ["state = :waiting_state"]
    binds: dict[str, Any] = {"waiting_state": JobState.QUEUED.value}
    if code == WaitingCode.SCHEDULED.value:
        where += ["(waiting_code IS NULL OR waiting_code = '')", "schedule_time > :waiting_now"]
        return where, {**binds, "waiting_now": now}
    where.append("waiting_code = :waiting_code")
    return where, {**binds, "waiting_code": code}


def list_query(
    tenant_id: uuid.UUID,
    *,
    limit: int,
    after: ListCursor | None,
    state: JobState | None,
    job_type: str | None,
    labels: dict[str, str] | None,
    created_after: datetime | None,
    created_before: datetime | None,
    waiting_code: str,
    now: datetime,
    parent: uuid.UUID | None = None,
) -> tuple[TextClause, dict[str, Any]]:
    """The statement and binds of :meth:`JobStore.list_jobs` (jobs read at ``now``)."""
    where = ["tenant_id = :tenant_id"]
    params: dict[str, Any] = {"tenant_id": tenant_id, "limit": limit}
    if parent is not None:
        # The children of one job: its entries of jobs_parent, newest first.
        where.append("parent_id = :parent")
        params["parent"] = parent
    if waiting_code:
        conditions, binds = waiting_filter(waiting_code, now)
        where.extend(conditions)
        params.update(binds)
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
    return sql, params


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
        refused: dict[int, JobplaneError] = {}
        # A full key's refusal is decided under its lock, held to the commit;
        # the jobs they run after are locked to it too.
        many = rejects(news) or has_after(news)
        async with self._machine.session(self._db, Transition.SUBMIT, many=many) as conn:
            # The keys' locks first, then the jobs': a claim takes them in
            # that order too (its guard's key lock, then the row it updates).
            full_keys = await refuse_full_keys(conn, tenant_id, news)
            found, refused = await check_after(conn, tenant_id, news)
            for i, full in full_keys.items():
                refused.setdefault(i, full)
            admitted = [i for i in range(len(news)) if i not in refused]
            rows = await self._insert(
                conn,
                tenant_id,
                [news[i] for i in admitted],
                [ids[i] for i in admitted],
                field="payload",
                found=found,
            )
        missing = [
            i for i, job_id in enumerate(ids) if str(job_id) not in rows and i not in refused
        ]
        if len(missing) < len(news):
            # Committed; a failure here loses only the replies (the callers'
            # retries with the same request_ids get these jobs).
            self._faults.hit("submit.after_commit")
        replays: dict[int, Job | JobplaneError] = {}
        if missing:
            # Their request_ids exist: ON CONFLICT waited for those inserts to
            # commit, so they are visible now.
            async with self._db.connect() as conn:
                replays = await find_replays(conn, tenant_id, news, missing)
        replays.update(refused)
        return [
            (submitted(job_from_row(rows[str(ids[i])]), news[i].stages), True)
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
            # The keys' locks first, then the jobs' (see submit_each).
            for i, full in (await refuse_full_keys(conn, tenant_id, news)).items():
                raise at_item(full, i)
            found, unknown = await check_after(conn, tenant_id, news)
            for i, error in sorted(unknown.items()):
                raise at_item(error, i)
            rows = await self._insert(conn, tenant_id, news, ids, field="requests", found=found)
            missing = [i for i, job_id in enumerate(ids) if str(job_id) not in rows]
            if missing:
                for i, replay in (await find_replays(conn, tenant_id, news, missing)).items():
                    if isinstance(replay, JobplaneError):
                        raise at_item(replay, i)
                    replayed[i] = replay
        if rows:
            self._faults.hit("submit.after_commit")
        return [
            (replayed[i], False)
            if i in replayed
            else (submitted(job_from_row(rows[str(ids[i])]), news[i].stages), True)
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
        found: Found,
    ) -> dict[str, Row]:
        """Insert ``news`` under ``ids`` (a taken request_id is skipped); the rows
        written, by job id, as they are at the end: a job decided at once by
        the jobs it runs after has ended (ADR-0045)."""
        written = await insert_jobs(
            self._machine,
            conn,
            tenant_id,
            news,
            ids,
            field=field,
            extra=[dependency_columns(new, found) for new in news],
        )
        order = sorted(range(len(news)), key=lambda i: news[i].request_id)
        decided = [
            ids[i] for i in order if str(ids[i]) in written and decided_at_submit(news[i], found)
        ]
        written.update(await decide(conn, self._machine, decided))
        return written

    async def get(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> Job:
        """One job of the tenant; :class:`JobNotFound` otherwise."""
        async with self._auto.connect() as conn:
            row = (
                (await conn.execute(SELECT_JOB, {"id": job_id, "tenant_id": tenant_id}))
                .mappings()
                .first()
            )
            if row is None:
                raise JobNotFound(f"jobs/{job_id} not found")
            return await with_stages(conn, row)

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
        waiting_code: str = "",
        parent: uuid.UUID | None = None,
    ) -> list[Job]:
        """Up to ``limit`` jobs, newest first, strictly after ``after``.

        ``job_type``: plain jobs of that type and the jobs of the pipeline of
        that name, whatever stage they are at. ``labels``: jobs that carry all
        of them; ``created_after`` (inclusive) and ``created_before``
        (exclusive) bound the create time. ``waiting_code``: QUEUED jobs that
        read with that code (:func:`waiting_filter`). ``parent``: the children
        of that job.
        """
        now = datetime.now(UTC)
        sql, params = list_query(
            tenant_id,
            limit=limit,
            after=after,
            state=state,
            job_type=job_type,
            labels=labels,
            created_after=created_after,
            created_before=created_before,
            waiting_code=waiting_code,
            now=now,
            parent=parent,
        )
        async with self._auto.connect() as conn:
            rows = (await conn.execute(sql, params)).mappings().all()
        return [job_from_row(r, now) for r in rows]

    async def count_states(self, tenant_id: uuid.UUID, *, cap: int) -> dict[JobState, int]:
        """The tenant's jobs in each state, each count stopping at ``cap``.

        Capped, so that a tenant with millions of jobs costs ``cap`` index
        entries a state, not a scan of them all.
        """
        async with self._auto.connect() as conn:
            row = (
                await conn.execute(
                    COUNT_STATES, {**STATE_PARAMS, "tenant_id": tenant_id, "cap": cap}
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
                    MILESTONES, {"id": job_id, "tenant_id": tenant_id, "limit": limit}
                )
            ).mappings()
            return [event_from_row(r) for r in rows]

    async def tree(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> JobTree | None:
        """The job's tree, bounded (:mod:`jobplane.store.job_tree`); None: not found."""
        async with self._auto.connect() as conn:
            return await read_tree(conn, tenant_id, job_id)

    async def queue_rates(
        self, tenant_id: uuid.UUID, *, window_seconds: float, scan: int
    ) -> dict[str, tuple[int, int, int]]:
        """Per queue, the tenant's jobs submitted, succeeded and failed in the last
        ``window_seconds``, among its ``scan`` newest jobs created in the last hour."""
        async with self._auto.connect() as conn:
            rows = await conn.execute(
                QUEUE_RATES,
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
        """QUEUED → CANCELLED now; RUNNING → cancellation requested; terminal → error.

        The job's descendants (child jobs, theirs…) that have not ended are
        cancelled or asked to cancel in the same transaction (ADR-0046). It
        locks the job, then them; a child's end locks the child, then settles
        its fan-out's job (ADR-0047): a deadlock between the two runs the
        transaction again (the child's end has committed by then).
        """
        reason = reason or "cancelled by request"

        async def once() -> tuple[Job, Job, Sequence[str]]:
            return await self._cancel(tenant_id, job_id, reason)

        current, result, keys = await again_on_conflict(once, log, "cancel")
        if current.state is JobState.QUEUED and current.concurrency_key:
            keys = [*keys, current.concurrency_key]
        for key in dict.fromkeys(keys):
            # Its place in its key's line (held, or made due) is free now.
            async with self._engine.begin() as conn:
                await release_key(conn, self._machine, tenant_id, key)
        return result

    async def _cancel(
        self, tenant_id: uuid.UUID, job_id: uuid.UUID, reason: str
    ) -> tuple[Job, Job, Sequence[str]]:
        """:meth:`cancel`'s transaction: the job before, after, and the keys to release."""
        params = {"id": job_id, "tenant_id": tenant_id, "reason": reason}
        async with self._engine.begin() as conn:
            current = await self._lock(conn, tenant_id, job_id)
            if current.state is JobState.QUEUED:
                # The hooks drop a pending (re)dispatch, so nothing is published.
                row = await self._one(conn, Transition.CANCEL, params, Cause(reason))
            elif current.state is JobState.RUNNING:
                # The hooks wake the worker that runs it.
                row = None
                if not current.cancel_requested:
                    row = await self._one(conn, Transition.REQUEST_CANCEL, params, Cause(reason))
            else:
                raise JobAlreadyTerminal(f"jobs/{job_id} is already {current.state.name}")
            # Locked first, the parent: its running attempt cannot submit a
            # child past this (ChildStore locks it too, and sees the request).
            keys = await cancel_descendants(conn, self._machine, tenant_id, job_id, reason)
            result = current if row is None else await with_stages(conn, row)
        return current, result, keys

    async def retry(self, tenant_id: uuid.UUID, job_id: uuid.UUID, *, from_stage: str = "") -> Job:
        """A FAILED or CANCELLED job → QUEUED for a new attempt, through the outbox.

        A pipeline job resumes at its stage (the one that failed or was
        cancelled); ``from_stage`` restarts it at that stage instead. Either
        way the stages before it keep their results and are not run again.
        A job that ended waiting for its fan-out's children runs again only
        those that did not succeed, and waits for them (ADR-0047): it locks
        the job, then them, so a deadlock with a child's end runs the
        transaction again.
        """

        async def once() -> Job:
            return await self._retry(tenant_id, job_id, from_stage)

        return await again_on_conflict(once, log, "retry")

    async def _retry(self, tenant_id: uuid.UUID, job_id: uuid.UUID, from_stage: str) -> Job:
        """:meth:`retry`'s transaction."""
        dispatch_id = new_id()
        async with self._engine.begin() as conn:
            current = await self._lock(conn, tenant_id, job_id)
            if current.state not in (JobState.FAILED, JobState.CANCELLED):
                raise JobNotRetryable(
                    f"jobs/{job_id} is {current.state.name}; only FAILED or CANCELLED "
                    "jobs can be retried"
                )
            await refuse_while_parent_waits(conn, job_id)
            # A job that ended while jobs it runs after still run (cancelled,
            # past its deadline, another of them failed) would run before them.
            waiting = (await conn.execute(_DEPS_WAITING, {"id": job_id})).scalar_one()
            if waiting:
                raise JobNotRetryable(
                    f"jobs/{job_id} runs after {waiting} job(s) that have not ended; "
                    "retry it once they have"
                )
            params: dict[str, Any] = {
                "id": job_id,
                "tenant_id": tenant_id,
                "dispatch_id": dispatch_id,
            }
            if not from_stage and await fanned(conn, job_id):
                return await with_stages(conn, await rejoin(conn, self._machine, tenant_id, job_id))
            transition = Transition.RETRY
            cause = Cause("retry requested")
            if from_stage:
                found = (
                    (await conn.execute(_STAGE_INDEX, {**params, "name": from_stage}))
                    .mappings()
                    .first()
                )
                if found is None:
                    what = "has no stage" if current.stage else "is not a pipeline job; no stage"
                    raise InvalidArgument(
                        f"jobs/{job_id} {what} named {shown(from_stage)}", field="from_stage"
                    )
                if found["fan_out"]:
                    # Its handler runs per item, in the children: never on the job.
                    raise InvalidArgument(
                        f"stage {shown(from_stage)} of jobs/{job_id} fans out: restart from "
                        "the stage before it (it spawns the children again), or retry "
                        "without from_stage (only the children that did not succeed run again)",
                        field="from_stage",
                    )
                transition = Transition.RESTART
                params["stage"] = int(found["idx"])
                cause = Cause(f"restart requested from stage {from_stage}")
            # The hooks write the new dispatch and reset the stages.
            row = await self._one(conn, transition, params, cause)
            return await with_stages(conn, row)

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
            READ_STREAMS,
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
