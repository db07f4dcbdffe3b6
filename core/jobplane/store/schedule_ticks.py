"""Ticking schedules: exactly one job per tick, however many tickers run (ADR-0041).

A due schedule is claimed with ``FOR UPDATE SKIP LOCKED``; its runs' jobs are
submitted in that same transaction (:mod:`jobplane.store.schedule_runs`), and the
schedule is advanced past now in it too: the jobs exist if and only if the
advance commits. A ticker that dies before the commit leaves the schedule
due and no job; the next ticker to claim it submits the same ticks again.
Each run's request_id is made of the schedule's uid and its tick, so even a
tick claimed twice (which the lock prevents) returns the first job: the
idempotency key of SubmitJob (AIP-155) is the second fence.

A run that SubmitJob refuses (its type no longer routes, the tenant's limit,
a blob its payload names is gone) is rolled back to a savepoint, said in
``last_error``, and the tick passes. Any other error of a schedule (a time
zone this host lacks, a serialization failure, a permission) rolls back that
schedule's transaction only: in a new one its ``last_error`` says it and its
next run waits :data:`FAILURE_BACKOFF`, so it neither stops the pass nor
stays first in line; the other schedules, every tenant's, tick on.

Fault points (:mod:`jobplane.faults`): ``schedule.before_commit`` is hit with
a schedule claimed and its runs written, before the commit;
``schedule.after_commit`` right after it, before the pass goes on.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import structlog
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.errors import FailedPrecondition, JobplaneError, ScheduleNotFound
from jobplane.faults import NO_FAULTS, FaultPoints, InjectedFault
from jobplane.logs import describe_error
from jobplane.schedule_spec import Overlap, due_ticks
from jobplane.schedule_types import Schedule
from jobplane.store.machine import MACHINE, Cause, Transition
from jobplane.store.schedule_runs import submit_template
from jobplane.store.schedules import COLUMN_NAMES, schedule_from_row, timing
from jobplane.topology import Topology
from jobplane.types import JobState

__all__ = ["FAILURE_BACKOFF", "TickReport", "tick_once", "trigger"]

log = structlog.get_logger("jobplane.scheduler")

_COLUMNS = ", ".join(f"s.{c}" for c in COLUMN_NAMES) + ", s.tenant_id, t.name AS tenant_name"
_CLAIM_DUE = text(
    f"""
    SELECT {_COLUMNS} FROM schedules s JOIN tenants t ON t.id = s.tenant_id
    WHERE NOT s.paused AND s.next_run_time <= :now
    ORDER BY s.next_run_time
    LIMIT 1
    FOR UPDATE OF s SKIP LOCKED
    """
)
_FIND_BUFFERED = text(
    """
    SELECT tenant_id, id FROM schedules
    WHERE buffered_tick IS NOT NULL AND NOT paused
    ORDER BY buffered_tick
    LIMIT :limit
    """
)
_CLAIM_BUFFERED = text(
    f"""
    SELECT {_COLUMNS} FROM schedules s JOIN tenants t ON t.id = s.tenant_id
    WHERE s.tenant_id = :tenant_id AND s.id = :id
      AND s.buffered_tick IS NOT NULL AND NOT s.paused
    FOR UPDATE OF s SKIP LOCKED
    """
)
_LOCK_ONE = text(
    f"""
    SELECT {_COLUMNS} FROM schedules s JOIN tenants t ON t.id = s.tenant_id
    WHERE s.tenant_id = :tenant_id AND s.id = :id
    FOR UPDATE OF s
    """
)
# The runs still going: QUEUED or RUNNING (bound, so the states' spelling
# stays the machine's), among the newest runs.
_ACTIVE = text(
    "SELECT id FROM jobs WHERE tenant_id = :tenant_id AND id = ANY(CAST(:ids AS uuid[])) "
    "AND state = ANY(CAST(:active AS text[])) ORDER BY create_time"
)
_BY_REQUEST = text("SELECT id FROM jobs WHERE tenant_id = :tenant_id AND request_id = :request_id")
_ACTIVE_STATES = [JobState.QUEUED.value, JobState.RUNNING.value]
_ADVANCE = text(
    """
    UPDATE schedules SET
        next_tick = :next_tick, next_run_time = :next_run_time, buffered_tick = :buffered_tick,
        recent_runs = (CAST(:started AS uuid[]) || recent_runs)[1:10],
        runs = runs + cardinality(CAST(:started AS uuid[])), skipped = skipped + :skipped,
        last_run_time = CASE WHEN cardinality(CAST(:started AS uuid[])) > 0
                             THEN CAST(:now AS timestamptz)
                             ELSE last_run_time END,
        last_error = :last_error
    WHERE tenant_id = :tenant_id AND id = :id
    """
)
# A failed schedule's error, and its next run put off, unless another ticker
# moved it meanwhile (its next run time is the one the failed pass saw).
_FAILED = text(
    """
    UPDATE schedules SET last_error = :last_error,
        next_run_time = CASE WHEN :backoff THEN CAST(:retry AS timestamptz)
                             ELSE next_run_time END,
        buffered_tick = CASE WHEN :backoff THEN buffered_tick ELSE NULL END,
        skipped = skipped + CASE WHEN :backoff THEN 0 ELSE 1 END
    WHERE tenant_id = :tenant_id AND id = :id
      AND next_run_time IS NOT DISTINCT FROM :seen_run_time
      AND buffered_tick IS NOT DISTINCT FROM :seen_buffered
    """
)
#: How long a schedule whose tick failed (not a refusal) waits before it is tried again.
FAILURE_BACKOFF = timedelta(seconds=60)
#: How many runs the newest-runs list keeps (what the overlap policy looks at).
RECENT_RUNS = 10


@dataclass(frozen=True, slots=True)
class TickReport:
    """What one pass did: runs started, ticks skipped, runs refused, schedules that
    failed, the largest lag."""

    runs: int = 0
    skipped: int = 0
    refused: int = 0
    #: Schedules whose pass failed (rolled back, their error in ``last_error``).
    failed: int = 0
    #: Seconds between a started run's due time and its submit, the largest of the pass.
    lag_seconds: float = 0.0


@dataclass(slots=True)
class _Outcome:
    started: list[uuid.UUID]
    skipped: int = 0
    refused: int = 0
    error: str = ""
    buffered: datetime | None = None


async def tick_once(
    engine: AsyncEngine,
    *,
    now: datetime | None = None,
    limit: int = 1000,
    faults: FaultPoints = NO_FAULTS,
    topology: Topology | None = None,
) -> TickReport:
    """Run every schedule due at ``now`` (at most ``limit``), one transaction each;
    then the ticks BUFFER_ONE held back whose run has ended.

    A schedule of a pipeline ``topology`` declares submits pipeline jobs
    (:mod:`jobplane.store.schedule_runs`). A schedule that fails is rolled
    back alone and put off (:func:`_failed`).
    """
    runs = skipped = refused = failed = 0
    lag = 0.0
    for _ in range(limit):
        moment = now or datetime.now(UTC)
        row: Mapping[Any, Any] | None = None
        try:
            async with engine.begin() as conn:
                row = (await conn.execute(_CLAIM_DUE, {"now": moment})).mappings().first()
                if row is None:
                    break
                done = await _run_due(conn, row, moment, topology)
                faults.hit("schedule.before_commit")
        except InjectedFault:
            raise
        except Exception as exc:
            if row is None:  # the claim itself failed: the database, not a schedule
                raise
            await _failed(engine, row, exc, backoff=moment + FAILURE_BACKOFF)
            failed += 1
            continue
        faults.hit("schedule.after_commit")
        runs += len(done.started)
        skipped += done.skipped
        refused += done.refused
        if done.started and row["next_run_time"] is not None:
            lag = max(lag, (datetime.now(UTC) - row["next_run_time"]).total_seconds())
    buffered, failed_buffered = await _run_buffered(engine, limit, now, faults, topology)
    return TickReport(
        runs=runs + buffered,
        skipped=skipped,
        refused=refused,
        failed=failed + failed_buffered,
        lag_seconds=lag,
    )


async def _failed(
    engine: AsyncEngine, row: Mapping[Any, Any], exc: Exception, *, backoff: datetime | None
) -> None:
    """Say why ``row``'s pass failed, in its own transaction; put its next run off to
    ``backoff`` (a due tick) or drop its held-back tick (``backoff`` None)."""
    error = describe_error(exc)
    log.warning("scheduler.schedule.failed", schedule=f"schedules/{row['id']}", error=error)
    async with engine.begin() as conn:
        await conn.execute(
            _FAILED,
            {
                "tenant_id": row["tenant_id"],
                "id": row["id"],
                "last_error": f"INTERNAL: {error}"[:1000],
                "backoff": backoff is not None,
                "retry": backoff,
                "seen_run_time": row["next_run_time"],
                "seen_buffered": row["buffered_tick"],
            },
        )


async def _run_due(
    conn: AsyncConnection, row: Mapping[Any, Any], now: datetime, topology: Topology | None
) -> _Outcome:
    """The due ticks of the claimed schedule ``row``, and its advance past ``now``."""
    schedule = schedule_from_row(row)
    ticks = due_ticks(
        schedule.spec,
        row["anchor_time"],
        row["next_tick"],
        now,
        schedule.catch_up,
        schedule.catch_up_limit,
        uid=str(row["uid"]),
    )
    done = _Outcome(started=[], buffered=row["buffered_tick"], skipped=0 if ticks else 1)
    active = await _active(conn, row)
    if done.buffered is not None and not active:
        # The tick held back is older than any due now: it runs first, they after it.
        held, done.buffered = done.buffered, None
        job_id = await _submit_run(conn, row, schedule, _tick_key(row, held), done, topology)
        if job_id is not None:
            done.started.append(job_id)
            active = [job_id]
    for tick in ticks:
        if active and schedule.overlap is Overlap.SKIP:
            done.skipped += 1
            continue
        if active and schedule.overlap is Overlap.BUFFER_ONE:
            if done.buffered is None:
                done.buffered = tick
            else:
                done.skipped += 1
            continue
        cancel = active if schedule.overlap is Overlap.CANCEL_OTHER else []
        job_id = await _submit_run(
            conn, row, schedule, _tick_key(row, tick), done, topology, cancel=cancel
        )
        if job_id is not None:
            done.started.append(job_id)
            active = [job_id]
    next_tick, next_run = timing(str(row["uid"]), schedule.spec, row["anchor_time"], now)
    await _advance(conn, row, done, now, next_tick=next_tick, next_run_time=next_run)
    return done


async def _run_buffered(
    engine: AsyncEngine,
    limit: int,
    now: datetime | None,
    faults: FaultPoints,
    topology: Topology | None,
) -> tuple[int, int]:
    """Start the held-back tick of each BUFFER_ONE schedule whose runs have all ended,
    one transaction each; how many started and how many failed."""
    async with engine.connect() as conn:
        keys = (await conn.execute(_FIND_BUFFERED, {"limit": limit})).all()
    started = failed = 0
    for tenant_id, schedule_id in keys:
        row: Mapping[Any, Any] | None = None
        try:
            async with engine.begin() as conn:
                binds = {"tenant_id": tenant_id, "id": schedule_id}
                row = (await conn.execute(_CLAIM_BUFFERED, binds)).mappings().first()
                if row is None or await _active(conn, row):
                    continue
                started += await _run_one_buffered(conn, row, now or datetime.now(UTC), topology)
                faults.hit("schedule.before_commit")
        except InjectedFault:
            raise
        except Exception as exc:
            if row is None:
                raise
            await _failed(engine, row, exc, backoff=None)
            failed += 1
        else:
            faults.hit("schedule.after_commit")
    return started, failed


async def _run_one_buffered(
    conn: AsyncConnection, row: Mapping[Any, Any], now: datetime, topology: Topology | None
) -> int:
    """The claimed schedule's held-back tick: its run, the tick released; runs started."""
    schedule = schedule_from_row(row)
    done = _Outcome(started=[])
    key = _tick_key(row, row["buffered_tick"])
    job_id = await _submit_run(conn, row, schedule, key, done, topology)
    done.started = [] if job_id is None else [job_id]
    await _advance(
        conn, row, done, now, next_tick=row["next_tick"], next_run_time=row["next_run_time"]
    )
    return len(done.started)


async def trigger(
    engine: AsyncEngine,
    tenant_id: uuid.UUID,
    schedule_id: str,
    request_id: str,
    overlap: Overlap | None = None,
    topology: Topology | None = None,
) -> uuid.UUID:
    """Run the schedule once now, whatever its spec and pause say; the job's id.

    ``overlap`` is what the run does while an earlier one is QUEUED or RUNNING:
    None or ALLOW_ALL runs anyway, SKIP refuses (:class:`FailedPrecondition`
    naming the running job, nothing written), CANCEL_OTHER cancels the earlier
    runs in the same transaction. ``request_id`` makes a retried trigger the
    same run (empty: a new one): its replay returns that run, whatever runs.
    """
    key = request_id or str(uuid.uuid4())
    async with engine.begin() as conn:
        row = (
            (await conn.execute(_LOCK_ONE, {"tenant_id": tenant_id, "id": schedule_id}))
            .mappings()
            .first()
        )
        if row is None:
            raise ScheduleNotFound(f"schedules/{schedule_id} not found")
        schedule = schedule_from_row(row)
        run_key = f"schedules/{row['uid']}/trigger/{key}"
        replay = (
            await conn.execute(_BY_REQUEST, {"tenant_id": tenant_id, "request_id": run_key})
        ).scalar()
        active = [] if replay is not None else await _active(conn, row)
        if active and overlap is Overlap.SKIP:
            running = ", ".join(f"jobs/{job_id}" for job_id in active)
            raise FailedPrecondition(
                f"{schedule.name} has a run going ({running}): overlap_policy SKIP starts none",
                metadata={"jobs": running},
            )
        if active and overlap is Overlap.CANCEL_OTHER:
            await _cancel(conn, row, active)
        job_id = await submit_template(conn, row, schedule, run_key, topology)
        # A replayed request_id returns the run it started then: counted once.
        again = replay is not None or job_id in row["recent_runs"]
        done = _Outcome(
            started=[] if again else [job_id],
            buffered=row["buffered_tick"],
            error=row["last_error"],
        )
        await _advance(
            conn,
            row,
            done,
            datetime.now(UTC),
            next_tick=row["next_tick"],
            next_run_time=row["next_run_time"],
        )
    return job_id


def _tick_key(row: Mapping[Any, Any], tick: datetime) -> str:
    """A tick's request_id: the schedule's uid (new for every schedule ever made) and the tick."""
    return f"schedules/{row['uid']}/{tick.astimezone(UTC).isoformat()}"


async def _active(conn: AsyncConnection, row: Mapping[Any, Any]) -> list[uuid.UUID]:
    """The schedule's newest runs still QUEUED or RUNNING, oldest first."""
    if not row["recent_runs"]:
        return []
    found = await conn.execute(
        _ACTIVE,
        {"tenant_id": row["tenant_id"], "ids": list(row["recent_runs"]), "active": _ACTIVE_STATES},
    )
    return [job_id for (job_id,) in found]


async def _cancel(conn: AsyncConnection, row: Mapping[Any, Any], jobs: Sequence[uuid.UUID]) -> None:
    """CANCEL_OTHER: cancel the queued runs, ask the running ones to stop (the machine's
    transitions, each fenced by its job's state)."""
    reason = f"cancelled by schedules/{row['id']}: a newer run started (CANCEL_OTHER)"
    for job_id in jobs:
        params = {"id": job_id, "tenant_id": row["tenant_id"], "reason": reason}
        if not await MACHINE.apply(conn, Transition.CANCEL, params, Cause(reason)):
            await MACHINE.apply(conn, Transition.REQUEST_CANCEL, params, Cause(reason))


async def _submit_run(
    conn: AsyncConnection,
    row: Mapping[Any, Any],
    schedule: Schedule,
    request_id: str,
    done: _Outcome,
    topology: Topology | None,
    *,
    cancel: Sequence[uuid.UUID] = (),
) -> uuid.UUID | None:
    """One run's job, in a savepoint: a refusal rolls it back and is noted in ``done``.

    The runs in ``cancel`` (CANCEL_OTHER's) are cancelled in the same savepoint,
    so a refused run cancels nothing.
    """
    try:
        async with conn.begin_nested():
            await _cancel(conn, row, cancel)
            job_id = await submit_template(conn, row, schedule, request_id, topology)
    except JobplaneError as exc:
        done.refused += 1
        done.error = f"{exc.reason}: {exc.message}"
        return None
    done.error = ""
    return job_id


async def _advance(
    conn: AsyncConnection,
    row: Mapping[Any, Any],
    done: _Outcome,
    now: datetime,
    *,
    next_tick: datetime | None,
    next_run_time: datetime | None,
) -> None:
    await conn.execute(
        _ADVANCE,
        {
            "tenant_id": row["tenant_id"],
            "id": row["id"],
            "next_tick": next_tick,
            "next_run_time": next_run_time,
            "buffered_tick": done.buffered,
            # Newest first.
            "started": list(reversed(done.started)),
            "skipped": done.skipped,
            "now": now,
            "last_error": done.error,
        },
    )
