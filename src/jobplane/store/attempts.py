"""The worker side of the job table: claims and fenced writes.

A claim bumps ``attempt`` and sets a fresh lease token; every later write of
that attempt (progress, heartbeat, outcome) matches on (job id, attempt, lease
token, state = running). A write that matches no row was fenced out: another
attempt owns the job now, or it was changed under us; nothing is written.
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.envelope import Envelope
from jobplane.ids import new_id
from jobplane.store.engine import autocommit
from jobplane.store.rows import (
    EVENTS_CHANNEL,
    OUTBOX_CHANNEL,
    OUTBOX_FOR_JOB_SQL,
    dumps,
    transition_sql,
)
from jobplane.types import JobState


class LeaseLost(Exception):
    """This attempt no longer owns the job; its writes are refused."""


class ClaimStatus(enum.Enum):
    """What a worker found when it tried to claim a delivered job."""

    CLAIMED = "claimed"
    NOT_FOUND = "not_found"  # no such job for that tenant: dead-letter the message
    FINISHED = "finished"  # terminal already: a duplicate, ack it
    STALE = "stale"  # the message is for an older dispatch: ack it
    IN_FLIGHT = "in_flight"  # another attempt holds a live lease
    EXHAUSTED = "exhausted"  # no attempts left; the job was failed now


class HandBack(enum.Enum):
    """What became of a job a worker without its handler gave back."""

    HANDED_BACK = "handed_back"  # a new dispatch is due shortly, for another worker
    PARKED = "parked"  # no live worker handles it: no dispatch until one starts
    NOT_QUEUED = "not_queued"  # finished, running, or the message is stale: ack it
    NOT_FOUND = "not_found"  # no such job for that tenant: dead-letter the message


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

    @property
    def attempts_left(self) -> int:
        """Attempts still allowed after this one."""
        return self.max_attempts - (self.attempt - self.retry_base)

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


@dataclass(frozen=True, slots=True)
class ProgressUpdate:
    """One progress report of a handler, waiting to be written."""

    progress: float
    message: str
    data: dict[str, Any]


_FENCE = "id = :id AND attempt = :attempt AND lease_token = :lease_token AND state = 'running'"

_CLAIM = text(
    transition_sql(
        "state = 'running', attempt = attempt + 1, lease_token = :lease_token, "
        "lease_expires_at = now() + make_interval(secs => :lease_seconds), "
        "start_time = now(), next_attempt_time = NULL, cancel_requested_at = NULL, "
        # A new attempt starts from nothing: its STARTED event must not carry
        # the last attempt's progress.
        "cancel_reason = NULL, progress = 0, progress_message = '', waiting_reason = NULL, "
        "handbacks = 0",
        # The message's type must be the job's: the worker chose its handler
        # by the message before it read the job.
        "id = :id AND tenant_id = :tenant_id AND dispatch_id = :dispatch_id AND type = :type "
        "AND attempt - retry_base < max_attempts "
        "AND (state = 'queued' OR (state = 'running' AND lease_expires_at < now()))",
        "type, payload, attempt, max_attempts, retry_base, correlation_id, request_id, "
        "timeout_seconds, queue",
    )
)
_INSPECT = text(
    """
    SELECT state, dispatch_id, type, lease_expires_at, lease_expires_at < now() AS lease_expired,
           attempt - retry_base >= max_attempts AS exhausted
    FROM jobs WHERE id = :id AND tenant_id = :tenant_id
    """
)
_EXHAUST = text(
    transition_sql(
        "state = 'failed', end_time = now(), error_code = 'ATTEMPTS_EXHAUSTED', "
        "error_message = 'no attempts left (max_attempts reached)', error_retryable = false, "
        "lease_token = NULL, lease_expires_at = NULL, dispatch_id = NULL, "
        "next_attempt_time = NULL",
        "id = :id AND tenant_id = :tenant_id AND dispatch_id = :dispatch_id "
        "AND attempt - retry_base >= max_attempts "
        "AND (state = 'queued' OR (state = 'running' AND lease_expires_at < now()))",
        "id",
    )
)
_HEARTBEAT = text(
    f"""
    UPDATE jobs SET lease_expires_at = now() + make_interval(secs => :lease_seconds)
    WHERE {_FENCE}
    RETURNING cancel_requested_at IS NOT NULL AS cancel_requested
    """
)
# The queued progress of many attempts in one statement: each attempt's row is
# updated under its fence (locked in id order, so two batches never deadlock)
# and its events get the seqs after the row's last_seq. Attempts fenced out
# are missing from the result. Binds: per attempt (index k) :ids, :attempts,
# :tokens, :ns, :last_progress, :last_message; per event :ks, :ords,
# :progresses, :messages, :datas.
_PROGRESS = text(
    f"""
    WITH i AS (
        SELECT * FROM unnest(CAST(:ids AS uuid[]), CAST(:attempts AS int[]),
                             CAST(:tokens AS uuid[]), CAST(:ns AS int[]),
                             CAST(:last_progress AS float8[]), CAST(:last_message AS text[]))
            WITH ORDINALITY AS i(id, attempt, lease_token, n, last_progress, last_message, k)
    ), locked AS (
        SELECT jobs.id FROM jobs JOIN i USING (id)
        WHERE jobs.attempt = i.attempt AND jobs.lease_token = i.lease_token
          AND jobs.state = 'running'
        ORDER BY jobs.id
        FOR UPDATE OF jobs
    ), j AS (
        UPDATE jobs SET progress = i.last_progress, progress_message = i.last_message,
                        last_seq = jobs.last_seq + i.n, update_time = now()
        FROM i, locked
        WHERE jobs.id = locked.id AND jobs.id = i.id AND jobs.attempt = i.attempt
          AND jobs.lease_token = i.lease_token AND jobs.state = 'running'
        RETURNING jobs.id, jobs.tenant_id, jobs.last_seq, jobs.state, jobs.attempt,
                  jobs.cancel_requested_at, i.n, i.k
    ), e AS (
        INSERT INTO job_events
            (job_id, seq, tenant_id, type, state, progress, message, data, attempt)
        SELECT j.id, j.last_seq - j.n + p.ord, j.tenant_id, 'progress', j.state, p.progress,
               p.message, CAST(p.data AS jsonb), j.attempt
        FROM unnest(CAST(:ks AS bigint[]), CAST(:ords AS int[]), CAST(:progresses AS float8[]),
                    CAST(:messages AS text[]), CAST(:datas AS text[]))
            AS p(k, ord, progress, message, data)
        JOIN j ON j.k = p.k
    )
    SELECT j.k, j.cancel_requested_at IS NOT NULL AS cancel_requested,
           pg_notify('{EVENTS_CHANNEL}', j.id::text) AS notified
    FROM j
    """
)
_END = "lease_token = NULL, lease_expires_at = NULL, next_attempt_time = NULL, end_time = now()"
_SUCCEED = text(
    transition_sql(
        f"state = 'succeeded', result = CAST(:result AS jsonb), progress = 1, "
        f"error_code = NULL, error_message = NULL, error_retryable = false, {_END}",
        _FENCE,
        "id",
    )
)
_FAIL = text(
    transition_sql(
        f"state = 'failed', error_code = :error_code, error_message = :error_message, "
        f"error_retryable = :retryable, {_END}",
        _FENCE,
        "id",
    )
)
_CANCELLED = text(
    transition_sql(
        f"state = 'cancelled', error_code = 'CANCELLED', "
        f"error_message = coalesce(cancel_reason, 'cancelled'), error_retryable = false, {_END}",
        _FENCE,
        "id",
    )
)
_SCHEDULE_RETRY = text(
    transition_sql(
        "state = 'queued', error_code = :error_code, error_message = :error_message, "
        "error_retryable = true, lease_token = NULL, lease_expires_at = NULL, "
        "dispatch_id = :dispatch_id, retry_base = retry_base + :refund, "
        "next_attempt_time = now() + make_interval(secs => :delay)",
        _FENCE,
        "id",
    )
)
_INSERT_RETRY_OUTBOX = text(OUTBOX_FOR_JOB_SQL)

# A worker without the job's handler gives the job back without claiming it,
# in one statement fenced on the message's dispatch: when a live worker
# handles the job's type on its queue, a new dispatch is due after a jittered
# delay that doubles with each hand-back (no event: hand-backs are noise);
# otherwise the job is parked (no dispatch at all) with one event saying why.
# Neither counts as an attempt.
_HAND_BACK = text(
    f"""
    WITH cur AS (
        SELECT id, type, queue, handbacks FROM jobs
        WHERE id = :id AND tenant_id = :tenant_id AND state = 'queued'
          AND dispatch_id = :dispatch_id
        FOR UPDATE
    ), live AS (
        SELECT cur.id,
               EXISTS (
                   SELECT 1 FROM workers w
                   WHERE w.stop_time IS NULL AND w.expire_time > now()
                     AND cur.type = ANY (w.types) AND cur.queue = ANY (w.queues)
               ) AS handled,
               least(CAST(:max_delay AS float8),
                     CAST(:base_delay AS float8) * power(2, least(cur.handbacks, 30)))
                   * (0.5 + random()) AS delay
        FROM cur
    ), j AS (
        UPDATE jobs SET
            dispatch_id = CASE WHEN live.handled THEN CAST(:new_dispatch_id AS uuid) END,
            next_attempt_time = CASE WHEN live.handled
                THEN now() + make_interval(secs => live.delay) END,
            handbacks = jobs.handbacks + 1,
            waiting_reason = CASE WHEN live.handled
                THEN format('waiting for a worker that handles %s (handed back %s times by '
                            'workers without its handler)', jobs.type, jobs.handbacks + 1)
                ELSE format('no live worker handles type %s on queue %s', jobs.type, jobs.queue)
                END,
            last_seq = jobs.last_seq + CASE WHEN live.handled THEN 0 ELSE 1 END,
            update_time = now()
        FROM live
        WHERE jobs.id = live.id
        RETURNING jobs.id, jobs.tenant_id, jobs.type, jobs.correlation_id, jobs.state,
                  jobs.progress, jobs.attempt, jobs.last_seq, jobs.next_attempt_time,
                  jobs.waiting_reason, live.handled
    ), e AS (
        INSERT INTO job_events
            (job_id, seq, tenant_id, type, state, progress, message, data, attempt)
        SELECT id, last_seq, tenant_id, 'queued', state, progress, waiting_reason,
               jsonb_build_object('waiting_reason', waiting_reason), attempt
        FROM j WHERE NOT handled
    ), o AS (
        INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id, available_at)
        SELECT CAST(:new_dispatch_id AS uuid), tenant_id, id, type, correlation_id,
               next_attempt_time
        FROM j WHERE handled
    )
    SELECT handled, waiting_reason,
           pg_notify(CASE WHEN handled THEN '{OUTBOX_CHANNEL}' ELSE '{EVENTS_CHANNEL}' END,
                     CASE WHEN handled THEN '' ELSE id::text END) AS notified
    FROM j
    """
)
# Parked jobs of the given types and queues get a new dispatch (a worker that
# runs them is live now), with one event each.
_UNPARK = text(
    f"""
    WITH p AS (
        SELECT id FROM jobs
        WHERE state = 'queued' AND dispatch_id IS NULL
          AND type = ANY (CAST(:types AS text[])) AND queue = ANY (CAST(:queues AS text[]))
        ORDER BY id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ), j AS (
        UPDATE jobs SET dispatch_id = gen_random_uuid(), waiting_reason = NULL, handbacks = 0,
                        next_attempt_time = NULL, last_seq = jobs.last_seq + 1,
                        update_time = now()
        FROM p
        WHERE jobs.id = p.id AND jobs.state = 'queued' AND jobs.dispatch_id IS NULL
        RETURNING jobs.id, jobs.tenant_id, jobs.type, jobs.correlation_id, jobs.dispatch_id,
                  jobs.state, jobs.progress, jobs.attempt, jobs.last_seq
    ), e AS (
        INSERT INTO job_events
            (job_id, seq, tenant_id, type, state, progress, message, data, attempt)
        SELECT id, last_seq, tenant_id, 'queued', state, progress,
               format('dispatched again: a worker that handles %s is live', type),
               '{{}}'::jsonb, attempt
        FROM j
    ), o AS (
        INSERT INTO outbox (id, tenant_id, job_id, routing_key, correlation_id)
        SELECT dispatch_id, tenant_id, id, type, correlation_id FROM j
    )
    SELECT id, pg_notify('{EVENTS_CHANNEL}', id::text) AS notified,
           pg_notify('{OUTBOX_CHANNEL}', '') AS woke_relay
    FROM j
    """
)


class AttemptStore:
    """Claims attempts and writes their progress and outcome, fenced."""

    def __init__(self, engine: AsyncEngine, *, lease_seconds: float = 30.0) -> None:
        self._engine = engine
        # Claims, heartbeats, progress and most outcomes are one statement
        # each: atomic alone, without BEGIN/COMMIT round trips.
        self._auto = autocommit(engine)
        self.lease_seconds = lease_seconds

    async def claim(self, envelope: Envelope) -> ClaimResult:
        """Try to start the attempt this message dispatches."""
        token = uuid.uuid4()
        params = {
            "id": envelope.job_id,
            "tenant_id": envelope.tenant_id,
            "dispatch_id": envelope.event_id,
            "type": envelope.job_type,
            "lease_token": token,
            "lease_seconds": self.lease_seconds,
        }
        async with self._auto.connect() as conn:
            row = (
                (await conn.execute(_CLAIM, _event(params, "started", "attempt started")))
                .mappings()
                .first()
            )
            if row is not None:
                return ClaimResult(
                    ClaimStatus.CLAIMED,
                    attempt=Attempt(
                        job_id=envelope.job_id,
                        tenant_id=envelope.tenant_id,
                        type=row["type"],
                        payload=_obj(row["payload"]),
                        attempt=int(row["attempt"]),
                        max_attempts=int(row["max_attempts"]),
                        retry_base=int(row["retry_base"]),
                        lease_token=token,
                        correlation_id=row["correlation_id"],
                        request_id=row["request_id"],
                        timeout_seconds=float(row["timeout_seconds"]),
                        queue=row["queue"],
                    ),
                )
            found = (await conn.execute(_INSPECT, params)).mappings().first()
            if found is None:
                return ClaimResult(ClaimStatus.NOT_FOUND)
            state = JobState(found["state"])
            if state.terminal:
                return ClaimResult(ClaimStatus.FINISHED, state=state)
            if (
                str(found["dispatch_id"]) != str(envelope.event_id)
                or found["type"] != envelope.job_type
            ):
                # Not this job's current dispatch (or not a message our relay
                # wrote): the job's own message is elsewhere.
                return ClaimResult(ClaimStatus.STALE, state=state)
            if state is JobState.RUNNING and not found["lease_expired"]:
                return ClaimResult(
                    ClaimStatus.IN_FLIGHT, state=state, lease_expires_at=found["lease_expires_at"]
                )
            if found["exhausted"]:
                exhausted = await conn.execute(
                    _EXHAUST, _event(params, "failed", "no attempts left")
                )
                if exhausted.first() is not None:
                    return ClaimResult(ClaimStatus.EXHAUSTED, state=JobState.FAILED)
            # Changed between the two statements; the caller looks again.
            return ClaimResult(ClaimStatus.IN_FLIGHT, state=state)

    async def hand_back(
        self, envelope: Envelope, *, base_delay: float, max_delay: float
    ) -> tuple[HandBack, str]:
        """Give back a delivered job this worker has no handler for, without claiming it.

        Returns what became of it and the waiting reason now on the job.
        """
        params = {
            "id": envelope.job_id,
            "tenant_id": envelope.tenant_id,
            "dispatch_id": envelope.event_id,
            "new_dispatch_id": new_id(),
            "base_delay": base_delay,
            "max_delay": max_delay,
        }
        async with self._auto.connect() as conn:
            row = (await conn.execute(_HAND_BACK, params)).mappings().first()
            if row is not None:
                status = HandBack.HANDED_BACK if row["handled"] else HandBack.PARKED
                return status, str(row["waiting_reason"])
            found = (await conn.execute(_INSPECT, params)).first()
        return (HandBack.NOT_FOUND if found is None else HandBack.NOT_QUEUED), ""

    async def unpark(self, types: Sequence[str], queues: Sequence[str], *, limit: int = 500) -> int:
        """Dispatch parked jobs of ``types`` on ``queues`` again; how many were."""
        if not types or not queues:
            return 0
        params = {"types": list(types), "queues": list(queues), "limit": limit}
        async with self._auto.connect() as conn:
            return len((await conn.execute(_UNPARK, params)).all())

    async def heartbeat(self, attempt: Attempt) -> bool:
        """Extend the lease; returns whether cancellation was requested."""
        async with self._auto.connect() as conn:
            row = (
                await conn.execute(
                    _HEARTBEAT, {**attempt.fence(), "lease_seconds": self.lease_seconds}
                )
            ).first()
        if row is None:
            raise LeaseLost(f"jobs/{attempt.job_id} attempt {attempt.attempt} lost its lease")
        return bool(row[0])

    async def write_progress(self, attempt: Attempt, updates: Sequence[ProgressUpdate]) -> bool:
        """Store progress events in one statement; returns whether cancel was requested."""
        async with self._auto.connect() as conn:
            return await self._progress(conn, attempt, updates)

    async def write_progress_many(
        self, batches: Sequence[tuple[Attempt, Sequence[ProgressUpdate]]]
    ) -> list[bool | None]:
        """Store the progress of many attempts in one statement.

        For each batch, in order: whether cancellation of its job was
        requested, or None when the attempt was fenced out (nothing of it was
        written).
        """
        async with self._auto.connect() as conn:
            return await self._progress_many(conn, batches)

    async def succeed(
        self, attempt: Attempt, result: dict[str, Any], pending: Sequence[ProgressUpdate] = ()
    ) -> None:
        """Commit SUCCEEDED (after any pending progress) or raise :class:`LeaseLost`."""
        await self._finish(
            attempt, pending, _SUCCEED, {"result": dumps(result)}, "succeeded", "succeeded"
        )

    async def fail(
        self,
        attempt: Attempt,
        code: str,
        message: str,
        *,
        retryable: bool,
        pending: Sequence[ProgressUpdate] = (),
        details: Mapping[str, Any] | None = None,
    ) -> None:
        """Commit FAILED with the error, or raise :class:`LeaseLost`.

        ``details`` (e.g. the traceback) go into the failed event's
        ``data.error``, not the job row.
        """
        error = {**(details or {}), "code": code, "message": message, "retryable": retryable}
        await self._finish(
            attempt,
            pending,
            _FAIL,
            {"error_code": code, "error_message": message, "retryable": retryable},
            "failed",
            message,
            {"error": error},
        )

    async def cancelled(self, attempt: Attempt, pending: Sequence[ProgressUpdate] = ()) -> None:
        """Commit CANCELLED, or raise :class:`LeaseLost`."""
        await self._finish(attempt, pending, _CANCELLED, {}, "cancelled", "cancelled")

    async def schedule_retry(
        self,
        attempt: Attempt,
        code: str,
        message: str,
        *,
        delay: float,
        pending: Sequence[ProgressUpdate] = (),
        refund: bool = False,
        details: Mapping[str, Any] | None = None,
    ) -> None:
        """Back to QUEUED with a new dispatch due after ``delay`` seconds, via the outbox.

        ``refund``: the attempt does not count against max_attempts (it was
        interrupted by a shutdown, not failed by the job). ``details`` go into
        the event's ``data.error``.
        """
        dispatch_id = new_id()
        extra = {
            "error_code": code,
            "error_message": message,
            "dispatch_id": dispatch_id,
            "delay": float(delay),
            "refund": 1 if refund else 0,
        }
        data = {
            "error": {**(details or {}), "code": code, "message": message, "retryable": True},
            "delay_seconds": round(delay, 3),
            "next_attempt": attempt.attempt + 1,
        }
        async with self._engine.begin() as conn:
            if pending:
                await self._progress(conn, attempt, pending)
            row = (
                await conn.execute(
                    _SCHEDULE_RETRY,
                    _event({**attempt.fence(), **extra}, "retry_scheduled", message, data),
                )
            ).first()
            if row is None:
                raise LeaseLost(f"jobs/{attempt.job_id} attempt {attempt.attempt} was fenced out")
            await conn.execute(
                _INSERT_RETRY_OUTBOX, {"id": attempt.job_id, "dispatch_id": dispatch_id}
            )

    async def _finish(
        self,
        attempt: Attempt,
        pending: Sequence[ProgressUpdate],
        statement: Any,
        extra: dict[str, Any],
        event_type: str,
        message: str,
        data: dict[str, Any] | None = None,
    ) -> None:
        # Pending progress and the outcome commit together; the outcome alone
        # is one statement.
        scope = self._engine.begin() if pending else self._auto.connect()
        async with scope as conn:
            if pending:
                await self._progress(conn, attempt, pending)
            row = (
                await conn.execute(
                    statement, _event({**attempt.fence(), **extra}, event_type, message, data)
                )
            ).first()
            if row is None:
                raise LeaseLost(f"jobs/{attempt.job_id} attempt {attempt.attempt} was fenced out")

    async def _progress(
        self, conn: AsyncConnection, attempt: Attempt, updates: Sequence[ProgressUpdate]
    ) -> bool:
        written = await self._progress_many(conn, [(attempt, updates)])
        if written[0] is None:
            raise LeaseLost(f"jobs/{attempt.job_id} attempt {attempt.attempt} was fenced out")
        return written[0]

    async def _progress_many(
        self, conn: AsyncConnection, batches: Sequence[tuple[Attempt, Sequence[ProgressUpdate]]]
    ) -> list[bool | None]:
        names = (
            "ids attempts tokens ns last_progress last_message ks ords progresses messages datas"
        )
        params: dict[str, list[Any]] = {name: [] for name in names.split(" ")}
        for k, (attempt, updates) in enumerate(batches, start=1):
            params["ids"].append(attempt.job_id)
            params["attempts"].append(attempt.attempt)
            params["tokens"].append(attempt.lease_token)
            params["ns"].append(len(updates))
            params["last_progress"].append(updates[-1].progress)
            params["last_message"].append(updates[-1].message)
            for ord_, update in enumerate(updates, start=1):
                params["ks"].append(k)
                params["ords"].append(ord_)
                params["progresses"].append(update.progress)
                params["messages"].append(update.message)
                params["datas"].append(dumps(update.data))
        rows = (await conn.execute(_PROGRESS, params)).all()
        written: list[bool | None] = [None] * len(batches)
        for row in rows:
            written[int(row[0]) - 1] = bool(row[1])
        return written


def _event(
    params: dict[str, Any], event_type: str, message: str, data: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        **params,
        "event_type": event_type,
        "event_message": message,
        "event_data": dumps(data or {}),
    }


def _obj(value: Any) -> dict[str, Any]:
    parsed = json.loads(value) if isinstance(value, str) else value
    return dict(parsed)
