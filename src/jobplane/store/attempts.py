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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.envelope import Envelope
from jobplane.ids import new_id
from jobplane.store.engine import autocommit
from jobplane.store.rows import EVENTS_CHANNEL, OUTBOX_FOR_JOB_SQL, dumps, transition_sql
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
        "cancel_reason = NULL",
        "id = :id AND tenant_id = :tenant_id AND dispatch_id = :dispatch_id "
        "AND attempt - retry_base < max_attempts "
        "AND (state = 'queued' OR (state = 'running' AND lease_expires_at < now()))",
        "type, payload, attempt, max_attempts, retry_base, correlation_id, request_id, "
        "timeout_seconds, queue",
    )
)
_INSPECT = text(
    """
    SELECT state, dispatch_id, lease_expires_at, lease_expires_at < now() AS lease_expired,
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
            if str(found["dispatch_id"]) != str(envelope.event_id):
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
    ) -> None:
        """Commit FAILED with the error, or raise :class:`LeaseLost`."""
        await self._finish(
            attempt,
            pending,
            _FAIL,
            {"error_code": code, "error_message": message, "retryable": retryable},
            "failed",
            message,
            {"error": {"code": code, "message": message, "retryable": retryable}},
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
    ) -> None:
        """Back to QUEUED with a new dispatch due after ``delay`` seconds, via the outbox.

        ``refund``: the attempt does not count against max_attempts (it was
        interrupted by a shutdown, not failed by the job).
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
            "error": {"code": code, "message": message, "retryable": True},
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
