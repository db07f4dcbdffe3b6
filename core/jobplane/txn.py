"""Enqueue inside your own database transaction.

A service whose database is jobplane's Postgres can create a job in the same
transaction as its own rows: the job exists (and will run) if and only if
that transaction commits. Nothing goes to RabbitMQ from here: the job's
outbox row does, through the relay, after the commit::

    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("INSERT INTO source_files ...", ...)
        job_id = await txn.submit_job(
            conn, tenant="acme", type="ingestion.file", payload={"file_id": file_id},
            request_id=f"ingest-{file_id}",
        )

``conn`` is an asyncpg connection, or a SQLAlchemy ``AsyncConnection`` or
``AsyncSession``; the call joins whatever transaction it is in. Each helper
is a thin call of a function in the database's ``jobplane`` schema, which
any language can call the same way (``SELECT jobplane.submit_job(...)``);
the function applies the SubmitJob RPC's validation, idempotency and tenant
rules, and the refusals come back as the SDK's exceptions
(:class:`~jobplane.errors.InvalidArgument`,
:class:`~jobplane.errors.RequestIdReused`, …). A refusal is a failed
statement: like any, it aborts the transaction it is in unless that runs it
in a savepoint.

Domain events are published the same way, with :func:`publish_event` over
``jobplane.publish_event``: the event reaches the events exchange (through
the relay) and subscribers if and only if the caller's transaction commits::

    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("INSERT INTO artifacts ...", ...)
        await txn.publish_event(
            conn, tenant="acme", event_type="artifact.created",
            payload={"artifact": path}, event_id=artifact_event_id,
        )
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from jobplane.errors import (
    BlobReferenceNotFound,
    ConcurrencyLimitReached,
    EventIdReused,
    InvalidArgument,
    JobplaneError,
    PayloadTooLarge,
    RequestIdReused,
    TenantNotFound,
    UnroutableJobType,
)
from jobplane.ids import new_id
from jobplane.store.sqlapi import (
    PUBLISH_EVENT,
    PUBLISH_EVENT_ASYNCPG,
    SQLSTATE_REASONS,
    SUBMIT_JOB,
    SUBMIT_JOB_ASYNCPG,
)

__all__ = ["publish_event", "submit_job"]

_FOREIGN_KEY_VIOLATION = "23503"
_ERRORS: dict[str, type[JobplaneError]] = {
    cls.reason: cls
    for cls in (
        InvalidArgument,
        PayloadTooLarge,
        UnroutableJobType,
        RequestIdReused,
        TenantNotFound,
        EventIdReused,
        ConcurrencyLimitReached,
    )
}

# A NUL written as JSON: \u0000 behind an even number of backslashes (an odd
# number would make it an escaped backslash followed by "u0000").
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _job_id(job: uuid.UUID | str) -> uuid.UUID:
    """A job's id from its id or its name (``jobs/{id}``)."""
    if isinstance(job, uuid.UUID):
        return job
    try:
        return uuid.UUID(str(job).removeprefix("jobs/"))
    except ValueError:
        raise InvalidArgument(f"after names no job: {str(job)[:64]!r}", field="after") from None


# long: a keyword for each of SubmitJob's fields, each documented here
async def submit_job(
    conn: Any,
    *,
    tenant: str,
    type: str,
    payload: Mapping[str, Any] | None = None,
    request_id: str = "",
    correlation_id: str = "",
    max_attempts: int = 0,
    labels: Mapping[str, str] | None = None,
    attempt_timeout: float | timedelta | None = None,
    schedule_time: datetime | None = None,
    schedule_delay: float | timedelta | None = None,
    concurrency_key: str = "",
    concurrency_limit: int = 0,
    concurrency_mode: str | None = None,
    deadline: datetime | float | timedelta | None = None,
    after: Sequence[uuid.UUID | str] = (),
    after_failure: str | None = None,
) -> uuid.UUID:
    """Create a job in ``conn``'s transaction; its id.

    ``tenant`` is the tenant's name. The other arguments are SubmitJob's,
    as in :meth:`jobplane.client.AsyncClient.submit`: ``request_id`` is the
    idempotency key (the same request again returns the same job, in this
    transaction or any other; a different one with the same id raises
    :class:`~jobplane.errors.RequestIdReused`), ``max_attempts`` 0 and
    ``attempt_timeout`` None mean the queue's defaults. ``schedule_time``
    (timezone-aware) or ``schedule_delay`` (seconds or a timedelta, from
    this call) delays the job's start (docs/scheduling.md). ``concurrency_key``,
    ``concurrency_limit`` and ``concurrency_mode`` (``"queue"`` or
    ``"reject"``) as in ``submit`` (docs/flow-control.md); a full key in reject
    mode raises :class:`~jobplane.errors.ConcurrencyLimitReached`.
    ``deadline``: the time (timezone-aware) by which the job must have ended,
    or how long after this call (seconds or a timedelta); past it the job
    ends FAILED, DEADLINE_EXCEEDED (docs/scheduling.md#deadlines). ``after``
    (job ids, or names ``jobs/{id}``) and ``after_failure`` (``"fail"``,
    ``"cancel"``, ``"run_anyway"``) as in ``submit`` (docs/workflows.md).
    """
    # Postgres text holds no NUL: refused here, as the RPC refuses it.
    if "\x00" in tenant:
        raise TenantNotFound("no tenant's name has a NUL character", field="tenant")
    # A NUL elsewhere goes as another control character, which the function
    # refuses in its turn among its checks, naming the field the RPC names.
    type, request_id, correlation_id, concurrency_key = (
        _without_nul(v) for v in (type, request_id, correlation_id, concurrency_key)
    )
    # What jsonb cannot hold goes as JSON null, which the function refuses where it
    # checks that field; that refusal is then this one (the RPC's order of checks).
    payload_json, bad_payload = _json_or_refusal(payload or {}, "payload")
    labels_json, bad_labels = _json_or_refusal(labels or {}, "labels")
    timeout = attempt_timeout.total_seconds() if isinstance(attempt_timeout, timedelta) else None
    if attempt_timeout is not None and not isinstance(attempt_timeout, timedelta):
        timeout = float(attempt_timeout)
    args = (
        tenant,
        type,
        payload_json,
        request_id,
        correlation_id,
        max_attempts,
        labels_json,
        timeout,
        *_schedule_args(schedule_time, schedule_delay),
        concurrency_key,
        concurrency_limit,
        concurrency_mode,
        *_deadline_args(deadline),
        [_job_id(a) for a in after] or None,
        after_failure,
    )
    try:
        return uuid.UUID(str(await _scalar(conn, args)))
    except Exception as exc:
        refusal = refusal_of(exc)
        if refusal is None:
            raise
        for bad in (bad_payload, bad_labels):
            if bad is not None and refusal.field == bad.field:
                raise bad from exc
        raise refusal from exc


def _json_or_refusal(value: Mapping[str, Any], field: str) -> tuple[str, InvalidArgument | None]:
    """``value`` as JSON text, or JSON null and the refusal of what jsonb cannot hold."""
    try:
        return _json(value, field), None
    except InvalidArgument as refused:
        return "null", refused


def _without_nul(value: str) -> str:
    """``value`` with each NUL (which Postgres text cannot hold) as U+0001: a control
    character too, refused where the function refuses those, in its order of checks."""
    return value.replace("\x00", "\x01")


def _schedule_args(
    schedule_time: datetime | None, schedule_delay: float | timedelta | None
) -> tuple[str | None, float | None]:
    """The schedule's two arguments as bound: the time as text, the delay in seconds.

    What cannot be bound is refused here with the field the function would name.
    """
    if schedule_time is not None and schedule_time.utcoffset() is None:
        raise InvalidArgument("schedule_time must be timezone-aware", field="schedule_time")
    delay = (
        schedule_delay.total_seconds()
        if isinstance(schedule_delay, timedelta)
        else None
        if schedule_delay is None
        else float(schedule_delay)
    )
    if delay is not None and not math.isfinite(delay):
        raise InvalidArgument("schedule_delay must be a finite duration", field="schedule_delay")
    return (None if schedule_time is None else schedule_time.isoformat()), _whole_micros(delay)


def _deadline_args(
    deadline: datetime | float | timedelta | None,
) -> tuple[str | None, float | None]:
    """The deadline's two arguments as bound: a time as text, or seconds after the call."""
    if isinstance(deadline, datetime):
        if deadline.utcoffset() is None:
            raise InvalidArgument("deadline must be timezone-aware", field="deadline")
        return deadline.isoformat(), None
    if deadline is None:
        return None, None
    after = deadline.total_seconds() if isinstance(deadline, timedelta) else float(deadline)
    if not math.isfinite(after):
        raise InvalidArgument("deadline must be a finite duration", field="deadline_after")
    return None, _whole_micros(after)


def _whole_micros(seconds: float | None) -> float | None:
    """``seconds`` in whole microseconds (what an interval keeps), a fraction rounded away
    from zero: a delay the RPC refuses by a nanosecond (below 0, beyond the horizon) is
    refused by the function too, not rounded into its range."""
    if seconds is None:
        return None
    micros = math.ceil(abs(seconds) * 1e6)
    return math.copysign(micros / 1e6, seconds)


def _json(value: Mapping[str, Any], field: str) -> str:
    """``value`` as JSON text for a jsonb argument; what jsonb cannot hold is refused here.

    Postgres refuses NUL, NaN and ±Infinity in jsonb before the function
    runs; refused here they get the field-level error the RPC gives.
    """
    try:
        encoded = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise InvalidArgument(
            f"{field} has NaN or Infinity; JSON numbers are finite", field=field
        ) from None
    except RecursionError:
        raise InvalidArgument(f"{field} is nested too deep", field=field) from None
    if _NUL_ESCAPE.search(encoded):
        raise InvalidArgument(f"{field} has a NUL character", field=field)
    if not _utf8(encoded):
        raise InvalidArgument(f"{field} has an unpaired surrogate", field=field)
    return encoded


def _utf8(value: str) -> bool:
    """True when ``value`` can be sent as UTF-8 (no unpaired surrogate)."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


async def publish_event(
    conn: Any,
    *,
    tenant: str,
    event_type: str,
    payload: Mapping[str, Any] | None = None,
    event_id: uuid.UUID | str | None = None,
    timestamp: datetime | None = None,
    project_id: str | None = None,
    correlation_id: str = "",
    causation_id: str | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> uuid.UUID:
    """Publish a domain event in ``conn``'s transaction; its event_id.

    ``tenant`` is the tenant's name; the other arguments are PublishEvent's
    (docs/events.md). ``event_id`` is the idempotency key: None draws a
    fresh one (pass your own to make a retry of the whole transaction the
    same event); the same event again returns it and writes nothing, a
    different one with the same id raises
    :class:`~jobplane.errors.EventIdReused`. ``timestamp`` None means now;
    a given one must be timezone-aware. An empty ``correlation_id`` is the
    event's own id. ``traceparent``/``tracestate`` (W3C trace context) are
    carried as AMQP headers, and ignored when they are not valid ones.
    """
    if "\x00" in tenant or not _utf8(tenant):
        raise TenantNotFound("no tenant's name has a NUL character", field="tenant")
    event_id = new_id() if event_id is None else event_id
    texts = {
        "event_id": str(event_id),
        "event_type": event_type,
        "project_id": project_id,
        "correlation_id": correlation_id,
        "causation_id": causation_id,
    }
    for field, value in texts.items():
        if value is not None and ("\x00" in value or not _utf8(value)):
            raise InvalidArgument(f"{field} has a control character", field=field)
    if timestamp is not None and timestamp.utcoffset() is None:
        raise InvalidArgument("timestamp must be timezone-aware", field="timestamp")
    # Trace context that cannot even be sent is ignored, as an invalid one is.
    trace = [
        v if v is not None and "\x00" not in v and _utf8(v) else None
        for v in (traceparent, tracestate)
    ]
    # In the order of the function's arguments (asyncpg binds by position).
    named = {
        "tenant": tenant,
        "event_id": texts["event_id"],
        "event_type": event_type,
        "payload": _json(payload or {}, "payload"),
        "event_time": None if timestamp is None else timestamp.isoformat(),
        "project_id": project_id,
        "correlation_id": correlation_id,
        "causation_id": causation_id,
        "traceparent": trace[0],
        "tracestate": trace[1],
    }
    try:
        return uuid.UUID(str(await _call(conn, PUBLISH_EVENT, PUBLISH_EVENT_ASYNCPG, named)))
    except Exception as exc:
        refusal = refusal_of(exc)
        if refusal is None:
            raise
        raise refusal from exc


async def _call(conn: Any, statement: Any, asyncpg_sql: str, named: dict[str, Any]) -> Any:
    """``statement`` over SQLAlchemy, else ``asyncpg_sql`` (the same values by
    position, in ``named``'s order) over an asyncpg connection; its one value."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(conn, AsyncConnection | AsyncSession):
        return (await conn.execute(statement, named)).scalar_one()
    return await conn.fetchval(asyncpg_sql, *named.values())


async def _scalar(conn: Any, args: tuple[Any, ...]) -> Any:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(conn, AsyncConnection | AsyncSession):
        names = (
            "tenant",
            "type",
            "payload",
            "request_id",
            "correlation_id",
            "max_attempts",
            "labels",
            "timeout_seconds",
            "schedule_time",
            "schedule_delay",
            "concurrency_key",
            "concurrency_limit",
            "concurrency_mode",
            "deadline",
            "deadline_after",
            "after",
            "after_failure",
        )
        result = await conn.execute(SUBMIT_JOB, dict(zip(names, args, strict=True)))
        return result.scalar_one()
    return await conn.fetchval(SUBMIT_JOB_ASYNCPG, *args)


def refusal_of(exc: BaseException) -> JobplaneError | None:
    """The SDK exception for a refusal of jobplane's SQL API; None for any other error.

    Looks through SQLAlchemy's wrapping to the driver's error, which carries
    the SQLSTATE, the message (``REASON: what is wrong``), the field (as
    the error's column name) and details (``key=value`` words).
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if _blob_gone(error):
            return BlobReferenceNotFound(
                "the payload references a blob that does not exist", field="payload"
            )
        reason = SQLSTATE_REASONS.get(str(getattr(error, "sqlstate", "")))
        message = getattr(error, "message", None)
        if reason is not None and isinstance(message, str):
            field = getattr(error, "column_name", None)
            detail = getattr(error, "detail", None) or ""
            metadata = dict(word.split("=", 1) for word in detail.split() if "=" in word)
            text = message.split(": ", 1)[1] if message.startswith(f"{reason}: ") else message
            return _ERRORS[reason](text, field=field, metadata=metadata)
        pending.extend((getattr(error, "orig", None), error.__cause__))
    return None


def _blob_gone(error: BaseException) -> bool:
    """Whether ``error`` is the references' trigger finding no blob of a name the
    payload holds (a foreign key of job_blobs): the caller's blob, not the database."""
    return (
        str(getattr(error, "sqlstate", "")) == _FOREIGN_KEY_VIOLATION
        and getattr(error, "table_name", None) == "job_blobs"
    )
