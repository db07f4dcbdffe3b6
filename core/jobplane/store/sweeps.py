"""Repairs: expired leases, stuck outbox rows, lost dispatches, and re-dispatch by job id.

Every statement locks the rows it repairs with SKIP LOCKED and re-checks the
condition under the lock, so any number of sweepers may run at once.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.attempt_end import Decision, Retry
from jobplane.ids import new_id
from jobplane.store.concurrency import ended_keys, release_key
from jobplane.store.down import sqlstate
from jobplane.store.engine import autocommit
from jobplane.store.flow import ended_limits, limit_keys, release_limit
from jobplane.store.machine import MACHINE, Cause, StateMachine, Transition, state_is
from jobplane.store.machine.concurrency import held_keys
from jobplane.store.machine.dependencies import DECIDED, OPEN_EDGES, settle
from jobplane.store.machine.fanout import cancel_left_running
from jobplane.store.machine.flow import held_flow_keys
from jobplane.store.machine.table import NOT_WAITING_FOR_JOBS
from jobplane.store.outbox import RETURNS_RESET, OutboxKind
from jobplane.store.rows import OUTBOX_CHANNEL, job_from_row
from jobplane.types import Job, JobState

# The RUNNING jobs through jobs_running, their leases checked on the rows: no
# index names the lease, so a heartbeat is a HOT update (ADR-0051). As many
# rows as attempts run at once, whatever the table holds.
_EXPIRED = text(
    f"""
    SELECT id, attempt, retry_base, max_attempts, queue
    FROM jobs
    WHERE {state_is(JobState.RUNNING)}
        AND lease_expires_at < now() - make_interval(secs => :grace)
    ORDER BY lease_expires_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
    """
)
_STATE = text("SELECT state FROM jobs WHERE id = :id AND tenant_id = :tenant_id")
# A QUEUED job that waits for jobs (those it runs after, or its fan-out's
# children, ADR-0045/0047): their ends dispatch it, never an operator.
_WAITS_FOR_JOBS = text(
    f"SELECT {state_is(JobState.QUEUED)} AND NOT {NOT_WAITING_FOR_JOBS} FROM jobs "
    "WHERE id = :id AND tenant_id = :tenant_id"
)
# Events committed more than :older_than seconds ago that the relays' feed
# has not published yet (ADR-0016).
_EVENTS_BEHIND = text(
    """
    SELECT count(*) AS behind, extract(epoch FROM now() - min(e.create_time)) AS oldest
    FROM events e, event_relay r
    WHERE (e.txid, e.seq) > (r.txid, r.seq)
        AND e.create_time < now() - make_interval(secs => :older_than)
    """
)
_STUCK_OUTBOX = text(
    """
    SELECT count(*) FROM outbox
    WHERE published_at IS NULL AND failed_at IS NULL
        AND available_at < now() - make_interval(secs => :older_than)
    """
)
# A QUEUED job whose current dispatch was published long ago and never
# claimed: its message was lost (a purged queue, a dead letter not replayed).
# The same row is made due again, so the copy carries the same dispatch id and
# whichever copy arrives first claims; the other finds the claim taken. The
# wait doubles with each re-publish of the row: a deep backlog legitimately
# holds messages for long, and must not be flooded with copies. Both rows are
# locked (SKIP LOCKED): a job being claimed right now is left alone.
#
# Its cost is bounded whatever the backlog: it looks at the next :limit QUEUED
# jobs after :cursor in the order of jobs_queued_dispatch (no sort, no join of
# the whole backlog), and the caller moves the cursor on, starting again from
# the lowest id once a window comes back short. A backlog is covered over
# several passes instead of read whole on each. The first row carries the
# window's size and last id, also when nothing was due.
_REPUBLISH = text(
    f"""
    WITH scanned AS MATERIALIZED (
        SELECT dispatch_id
        FROM jobs
        WHERE {state_is(JobState.QUEUED)} AND dispatch_id > CAST(:cursor AS uuid)
        ORDER BY dispatch_id
        LIMIT :limit
    ), due AS (
        SELECT o.id
        FROM scanned s
        JOIN outbox o ON o.id = s.dispatch_id
        JOIN jobs j ON j.id = o.job_id
        WHERE {state_is(JobState.QUEUED, column="j.state")} AND j.dispatch_id = o.id
            AND o.published_at IS NOT NULL
            AND o.kind = '{OutboxKind.JOB_DISPATCH.value}'
            AND o.published_at < now()
                - make_interval(secs => :after * power(2, least(o.republish_count, 20)))
        FOR UPDATE OF j, o SKIP LOCKED
    ), r AS (
        UPDATE outbox o SET published_at = NULL, available_at = now(),
            republish_count = o.republish_count + 1, {RETURNS_RESET}
        FROM due WHERE o.id = due.id
        RETURNING o.id, o.job_id, o.republish_count, o.headers->>'traceparent' AS traceparent
    )
    SELECT w.scanned, w.last, r.id, r.job_id, r.republish_count, r.traceparent,
        CASE WHEN r.id IS NOT NULL THEN pg_notify('{OUTBOX_CHANNEL}', '') END AS notified
    FROM (
        SELECT (SELECT count(*) FROM scanned) AS scanned,
            (SELECT dispatch_id FROM scanned ORDER BY dispatch_id DESC LIMIT 1) AS last
    ) w LEFT JOIN r ON true
    """
)
# One re-publish pass at a time across all sweepers of a database: the pass
# is repair, and two at once would only read the same backlog twice. A
# transaction-level lock ends with the pass, or with its session.
_TRY_LOCK = text("SELECT pg_try_advisory_xact_lock(:key)")
REPUBLISH_LOCK_KEY = 0x6A70_7265_7075_6231  # "jprepub1"
# Early statistics (see SweepStore.analyze_grown): the tables the hot paths'
# prepared statements read, those whose changes since their last ANALYZE
# (automatic or not) outnumber the rows they had then, and at least
# :min_changes of them: a young table doubling, which autovacuum's launcher
# (one visit a database a minute) is too slow for; an established table
# never qualifies.
HOT_TABLES = ("jobs", "outbox", "events", "job_events", "job_stages")
_GROWN = text(
    """
    SELECT s.relname
    FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
    WHERE s.schemaname = current_schema() AND s.relname = ANY(CAST(:tables AS text[]))
      AND s.n_mod_since_analyze >= :min_changes
      AND s.n_mod_since_analyze > greatest(c.reltuples, 0)
      -- Postgres lets the table's owner analyze it (and a superuser, who holds
      -- every role); for another role ANALYZE only warns, every sweep.
      AND pg_has_role(c.relowner, 'USAGE')
    ORDER BY s.relname
    """
)
_ANALYZE_LOCK_KEY = 0x6A70_616E_616C_7931  # "jpanaly1"
# Behind autovacuum's own ANALYZE of the table, give up rather than wait.
_ANALYZE_LOCK_TIMEOUT = text("SET LOCAL lock_timeout = '1s'")
_LOCK_NOT_AVAILABLE = "55P03"
_START = uuid.UUID(int=0)
_ID = ("id",)
# An ended lease frees a slot of its job's key, if it has one.
_ENDED = ("id", "tenant_id", "concurrency_key", "flow_slots")


@dataclass(frozen=True, slots=True)
class Republished:
    """A dispatch made due again: its job, and how often that row was re-published."""

    job_id: uuid.UUID
    dispatch_id: uuid.UUID
    count: int
    #: The dispatch's stored trace context (its log line names the trace).
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class EventsBehind:
    """Committed events the relays have not published, older than asked."""

    count: int
    oldest_seconds: float | None


@dataclass(frozen=True, slots=True)
class RepublishPass:
    """What one pass over QUEUED jobs for lost dispatches did."""

    republished: list[Republished]
    scanned: int  # QUEUED jobs looked at
    lap_done: bool  # reached the last QUEUED job: the next pass starts from the first


@dataclass(frozen=True, slots=True)
class ExpiredLease:
    """A RUNNING attempt whose lease ran out, as the sweeper's decision needs it."""

    job_id: uuid.UUID
    attempt: int
    #: The attempt's number within its budget, from 1 (Attempt.budget_attempt).
    budget_attempt: int
    max_attempts: int
    queue: str


@dataclass(frozen=True, slots=True)
class LeaseRepair:
    """What one pass over expired leases did."""

    requeued: int = 0
    failed: int = 0


class SweepStore:
    """SQL of the sweeper and of operator re-dispatch."""

    def __init__(self, engine: AsyncEngine, *, machine: StateMachine = MACHINE) -> None:
        self._engine = engine
        self._auto = autocommit(engine)
        self._machine = machine
        self._cursor = _START

    async def analyze_grown(
        self, *, tables: Sequence[str] = HOT_TABLES, min_changes: int = 1000
    ) -> list[str]:
        """ANALYZE each of ``tables`` that outgrew its statistics; their names.

        Postgres drops the cached plans of a table it analyzes, so the hot
        paths' prepared statements are planned again for the table as it is:
        a plan made while a table was empty (a sequential scan where an index
        belongs) does not outlive the first thousands of rows. One sweeper
        at a time per database; nothing when another holds the lock, or when
        autovacuum is analyzing the table, or for a table whose owner this
        role is not (the least-privilege runtime role: autovacuum's pace).
        """
        binds = {"tables": list(tables), "min_changes": min_changes}
        # Most sweeps find nothing: one statement, no transaction or lock.
        async with self._auto.connect() as conn:
            if not (await conn.execute(_GROWN, binds)).first():
                return []
        try:
            async with self._engine.begin() as conn:
                if not (await conn.execute(_TRY_LOCK, {"key": _ANALYZE_LOCK_KEY})).scalar():
                    return []
                grown = [str(name) for name in (await conn.execute(_GROWN, binds)).scalars()]
                await conn.execute(_ANALYZE_LOCK_TIMEOUT)
                for name in grown:
                    # A name of a table that exists, as the catalog spells it.
                    await conn.execute(text(f'ANALYZE "{name}"'))
        except DBAPIError as exc:
            if sqlstate(exc) == _LOCK_NOT_AVAILABLE:
                return []
            raise
        return grown

    async def expire_leases(
        self, *, grace: float, limit: int, decide: Callable[[ExpiredLease], Decision]
    ) -> LeaseRepair:
        """Jobs whose worker stopped heartbeating: a new attempt, or FAILED when none is left.

        ``decide`` says which, for each lease, and this writes it. The lost
        attempt counts: a job that kills its worker every time ends FAILED
        after max_attempts instead of looping.
        """
        requeued = failed = 0
        keys: set[tuple[Any, str]] = set()
        limited: list[Any] = []
        async with self._engine.begin() as conn:
            rows = (await conn.execute(_EXPIRED, {"grace": grace, "limit": limit})).all()
            for row in rows:
                lease = ExpiredLease(
                    job_id=row.id,
                    attempt=int(row.attempt),
                    # The budget's attempt: a stage's (Attempt.budget_attempt).
                    budget_attempt=int(row.attempt - row.retry_base),
                    max_attempts=int(row.max_attempts),
                    queue=str(row.queue),
                )
                decision = decide(lease)
                params: dict[str, Any] = {"id": row.id, "attempt": row.attempt}
                error = {**decision.details, "code": decision.code}
                if isinstance(decision, Retry):
                    # The hooks write the new dispatch, due after the delay.
                    ended = await self._machine.apply(
                        conn,
                        Transition.EXPIRE_LEASE,
                        {
                            **params,
                            "message": decision.message,
                            "dispatch_id": new_id(),
                            "delay": decision.delay,
                        },
                        Cause(decision.message, {"error": {**error, "retryable": True}}),
                        returning=_ENDED,
                    )
                    requeued += len(ended)
                else:
                    ended = await self._machine.apply(
                        conn,
                        Transition.EXPIRE_LAST_LEASE,
                        {**params, "message": decision.message},
                        Cause(decision.message, {"error": {**error, "retryable": False}}),
                        returning=_ENDED,
                    )
                    failed += len(ended)
                keys |= ended_keys(ended)
                limited.extend(ended)
        # Their keys' slots are free: the oldest held jobs due again, after the commit.
        await self._release(keys)
        async with self._auto.connect() as conn:
            flow_keys = await limit_keys(conn, ended_limits(limited))
        await self._release_limits(flow_keys)
        return LeaseRepair(requeued=requeued, failed=failed)

    async def release_held(self, *, limit: int) -> int:
        """Release every key with held jobs, ``limit`` keys per statement, all of
        them in (tenant, key) order: the oldest due again, as many as the key has
        free slots (ADR-0040). Whoever ends a RUNNING job releases its key; this
        finds those a crash left held. How many jobs were made due."""
        released = 0
        after: tuple[Any, str] | None = None
        while True:
            async with self._auto.connect() as conn:
                binds = (
                    {"limit": limit}
                    if after is None
                    else {"limit": limit, "tenant_id": after[0], "key": after[1]}
                )
                keys = [
                    (row[0], str(row[1]))
                    for row in await conn.execute(held_keys(after=after is not None), binds)
                ]
            released += await self._release(keys)
            if len(keys) < limit:
                return released + await self._release_held_limits(limit)
            after = keys[-1]

    async def settle_dependencies(self, *, limit: int) -> int:
        """Settle what a bug or a crash could leave of dependencies (ADR-0045):
        the dependents of up to ``limit`` jobs that ended with their edges'
        outcomes unwritten, then up to ``limit`` waiting jobs their counts
        decide; then the children that the failure of a fan-out's job skipped
        (ADR-0047: another transaction held them then), of up to ``limit``
        such jobs. How many jobs were decided or cancelled (the next pass
        takes the rest)."""
        async with self._engine.begin() as conn:
            ended = [row[0] for row in await conn.execute(OPEN_EDGES, {"limit": limit})]
            decided = await settle(self._machine, conn, ended)
        async with self._engine.begin() as conn:
            ids = [row[0] for row in await conn.execute(DECIDED, {"limit": limit})]
            if ids:
                done = await self._machine.apply(
                    conn, Transition.DEPENDENCIES_MET, {"ids": ids}, returning=("id",)
                )
                decided += len(done)
        async with self._engine.begin() as conn:
            decided += await cancel_left_running(self._machine, conn, limit)
        return decided

    async def _release_held_limits(self, limit: int) -> int:
        """Release every flow limit with held jobs, ``limit`` per statement (ADR-0043)."""
        released = 0
        after = ""
        while True:
            async with self._auto.connect() as conn:
                keys = [
                    str(row[0])
                    for row in await conn.execute(
                        held_flow_keys(), {"limit": limit, "after": after}
                    )
                ]
            released += await self._release_limits(keys)
            if len(keys) < limit:
                return released
            after = keys[-1]

    async def _release_limits(self, keys: Iterable[str]) -> int:
        released = 0
        for key in keys:
            async with self._engine.begin() as conn:
                released += await release_limit(conn, self._machine, key)
        return released

    async def _release(self, keys: Iterable[tuple[Any, str]]) -> int:
        """RELEASE each key, each in a transaction of its own: how many jobs were made due."""
        released = 0
        for tenant_id, key in keys:
            async with self._engine.begin() as conn:
                released += await release_key(conn, self._machine, tenant_id, key)
        return released

    async def state_of(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> str | None:
        """The job's state, or None when there is no such job."""
        async with self._engine.connect() as conn:
            state = (
                await conn.execute(_STATE, {"id": job_id, "tenant_id": tenant_id})
            ).scalar_one_or_none()
        return None if state is None else str(state)

    async def waits_for_jobs(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> bool:
        """Whether the job is QUEUED waiting for other jobs to end (the jobs it
        runs after, its fan-out's children): theirs to dispatch, not a replay's."""
        async with self._engine.connect() as conn:
            waits = (
                await conn.execute(_WAITS_FOR_JOBS, {"id": job_id, "tenant_id": tenant_id})
            ).scalar_one_or_none()
        return bool(waits)

    async def stuck_outbox(self, *, older_than: float) -> int:
        """Outbox rows due for longer than ``older_than`` seconds and still unpublished."""
        async with self._engine.connect() as conn:
            count = (await conn.execute(_STUCK_OUTBOX, {"older_than": older_than})).scalar_one()
        return int(count)

    async def events_behind(self, *, older_than: float) -> EventsBehind:
        """Events committed over ``older_than`` seconds ago that no relay has published."""
        async with self._engine.connect() as conn:
            row = (await conn.execute(_EVENTS_BEHIND, {"older_than": older_than})).one()
        return EventsBehind(int(row.behind), None if row.oldest is None else float(row.oldest))

    async def republish_unclaimed(
        self, *, after: float, scan: int, window: int = 1000
    ) -> RepublishPass | None:
        """Make due again the dispatches of QUEUED jobs published long ago and never claimed.

        "Long ago" is ``after`` seconds for a row's first re-publish, doubling
        with each one after it. Looks at no more than ``scan`` QUEUED jobs (in
        statements of ``window``), continuing where the last pass of this store
        stopped. None when another sweeper's pass is running.
        """
        found: list[Republished] = []
        scanned = 0
        lap_done = False
        async with self._engine.begin() as conn:
            locked = await conn.execute(_TRY_LOCK, {"key": REPUBLISH_LOCK_KEY})
            if not locked.scalar_one():
                return None
            while scanned < scan and not lap_done:
                limit = min(window, scan - scanned)
                rows = (
                    await conn.execute(
                        _REPUBLISH, {"after": after, "limit": limit, "cursor": self._cursor}
                    )
                ).all()
                head = rows[0]
                scanned += int(head.scanned)
                found += [
                    Republished(
                        uuid.UUID(str(r.job_id)),
                        uuid.UUID(str(r.id)),
                        int(r.republish_count),
                        r.traceparent,
                    )
                    for r in rows
                    if r.id is not None
                ]
                lap_done = head.scanned < limit
                self._cursor = _START if lap_done else uuid.UUID(str(head.last))
        return RepublishPass(found, scanned, lap_done)

    async def redispatch(self, tenant_id: uuid.UUID, job_id: uuid.UUID, reason: str) -> Job | None:
        """A fresh dispatch of a QUEUED job (or a RUNNING one whose lease ran out).

        None when the job is unknown, finished, or held by a live attempt.
        """
        params = {"id": job_id, "tenant_id": tenant_id, "dispatch_id": new_id()}
        machine = self._machine
        async with machine.connect(self._engine, self._auto, Transition.REDISPATCH) as conn:
            # The hooks write the new dispatch.
            rows = await machine.apply(conn, Transition.REDISPATCH, params, Cause(reason))
        return job_from_row(rows[0]) if rows else None
