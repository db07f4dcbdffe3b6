"""The relay side of the outbox: claim due rows, then mark what the broker did.

The outbox holds messages of several kinds (:class:`OutboxKind`): a job
dispatch, whose envelope the relay builds from the row, and a domain event,
whose body and headers the row carries as they are published (ADR-0011).

A row ends in one of three ways: published (a broker ack), due again after a
backoff (a transient failure: the connection, a nack, a return), or failed
(``failed_at``: the broker can never take it, it came back unroutable for too
long, or the database refuses to record what happened to it) — in which case
a dispatch's job is failed in the same transaction, fenced on the job's
current dispatch, with a FAILED event.

Unroutable returns count only while they come back to back: every other
outcome (a publish, a nack, a timeout, a re-publish by the sweeper) starts the
count again. One return long ago plus a few during a later topology re-apply
is not "no queue takes this type".
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import TextClause, text

from jobplane.envelope import Envelope
from jobplane.store.db import Conn, Database
from jobplane.store.fair import FAIR_CTES, FAIR_ORDER, FairClaim, FairSlot
from jobplane.store.machine import MACHINE, Cause, Transition, where_sources

# An event row of a job (order_key: the job) waits while a row in front of
# it (a lower order_seq) is neither published nor failed: the broker gets a
# job's events one after the other, whichever relays publish them, and a
# row due again after a nack holds back those behind it.
IN_TURN = """(order_key IS NULL OR NOT EXISTS (
        SELECT 1 FROM outbox ahead
        WHERE ahead.order_key = outbox.order_key AND ahead.order_seq < outbox.order_seq
          AND ahead.published_at IS NULL AND ahead.failed_at IS NULL))"""
# SKIP LOCKED lets any number of relays share the table: each takes rows no
# other relay holds, and a relay that dies releases its rows with its
# transaction.
_CLAIM_SQL = """
    SELECT id, tenant_id, kind, job_id, routing_key, correlation_id, exchange, body, headers,
           last_error IS NOT NULL AS retried
    FROM outbox
    WHERE published_at IS NULL AND failed_at IS NULL AND {where}
    ORDER BY available_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
"""
# Job dispatches and the other kinds are claimed apart, up to the limit each:
# a backlog of events never delays a job's dispatch behind it.
_DISPATCHES = "kind = 'job.dispatch'"
_OTHERS = f"kind <> 'job.dispatch' AND {IN_TURN}"
# The relay's claim is one statement (ADR-0053): both kinds' claims, each up
# to the limit, dispatches first, in one round trip; ``part`` says which a row
# came from. Each part is a common table expression of its own (``dispatches``
# or the fair claim's, and ``others``): the plans' checks read each part's plan
# there. Rows the database refuses to change are held back by the relay
# that found them (``skip``, for a while): without this they would head every
# batch, and every batch would fail on them.
_DUE_PART = """
    SELECT id, tenant_id, kind, job_id, routing_key, correlation_id, exchange, body, headers,
           last_error IS NOT NULL AS retried, available_at
    FROM outbox
    WHERE published_at IS NULL AND failed_at IS NULL AND available_at <= now()
      AND NOT (id = ANY(CAST(:skip AS uuid[]))) AND {kind}
    ORDER BY available_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
"""
_OTHERS_DUE = _DUE_PART.format(kind=_OTHERS)
_CLAIM_BOTH = text(
    f"""
    WITH dispatches AS ({_DUE_PART.format(kind=_DISPATCHES)}), others AS ({_OTHERS_DUE})
    SELECT *, 0 AS part FROM dispatches
    UNION ALL SELECT *, 1 FROM others
    ORDER BY part, available_at
    """
)
# With fair dispatch on: the fair claim's dispatches (jobplane.store.fair),
# in their order, then the other rows.
_FAIR_CLAIM_BOTH = text(
    f"""{FAIR_CTES}, others AS ({_OTHERS_DUE})
    SELECT id, tenant_id, kind, job_id, routing_key, correlation_id, exchange, body, headers,
           retried, available_at, 0 AS part, queue, rank, start_tag, after_cursor, weight
    FROM claimed
    UNION ALL
    SELECT *, 1, NULL, NULL, NULL, NULL, NULL FROM others
    ORDER BY part, {FAIR_ORDER}, available_at
    """
)
# One row again, in a transaction of its own, once its batch was refused.
_CLAIM_ONE = text(_CLAIM_SQL.format(where="id = :id"))
# Any outcome but a return ends a run of returns (see the module docstring);
# the sweeper's re-publish too.
RETURNS_RESET = "returns = 0, first_returned_at = NULL"
# The time of the mark itself, after the broker's confirm: now() would be the
# start of the batch's transaction, before the rows were even published.
_MARK_PUBLISHED = text(
    "UPDATE outbox SET published_at = clock_timestamp(), "
    f"publish_attempts = publish_attempts + 1, {RETURNS_RESET} "
    "WHERE id = ANY(CAST(:ids AS uuid[]))"
)
_BACKOFF = "now() + make_interval(secs => least(30, 0.5 * 2 ^ least(publish_attempts, 6)))"
_MARK_RETRY = text(
    f"""
    UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = :error,
        available_at = {_BACKOFF}, {RETURNS_RESET}
    WHERE id = ANY(CAST(:ids AS uuid[]))
    """
)
# The relay decided to give up on the row but its job is locked: try again
# later, keeping the run of returns that led here.
_DEFER = text(
    f"""
    UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = :error,
        available_at = {_BACKOFF}
    WHERE id = ANY(CAST(:ids AS uuid[]))
    """
)
# A return counts towards giving up only with both enough returns in a row and
# enough time since the first of them: a topology being re-applied returns a
# few publishes within seconds, and must not fail jobs.
_MARK_RETURNED = text(
    f"""
    UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = :error,
        returns = returns + 1, first_returned_at = coalesce(first_returned_at, now()),
        available_at = {_BACKOFF}
    WHERE id = ANY(CAST(:ids AS uuid[]))
    RETURNING id, returns >= :min_returns
        AND now() - first_returned_at >= make_interval(secs => :after) AS give_up
    """
)
_MARK_FAILED = text(
    "UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = :error, "
    "failed_at = now() WHERE id = :id"
)
# The batch already holds its outbox rows; a cancel locks the job and then
# its pending outbox rows. Waiting for the job here could deadlock with it,
# so the job is taken only if free (no row: locked; the row is tried again).
# Fenced on the dispatch: a job that moved on (cancelled, re-dispatched,
# claimed from an earlier copy, parked with no dispatch at all) is not this
# row's to fail — coalesce, since a parked job's NULL dispatch_id makes the
# comparison NULL, which must read "moved on", not "locked".
_LOCK_JOB = text(
    "SELECT coalesce(dispatch_id = :dispatch_id "
    f"AND {where_sources(Transition.RELAY_FAIL)}, false) AS current "
    "FROM jobs WHERE id = :job_id FOR UPDATE SKIP LOCKED"
)
# The jobs of the batch's dispatches whose waiting reason the relay may note
# or clear. The batch holds its outbox rows, and a cancel locks the job before
# them: a job locked elsewhere is skipped, never waited for (its reason is
# noted at the next return, or the transition under way settles it).
_LOCK_WAITING = text(
    "SELECT id, waiting_code FROM jobs WHERE id = ANY(CAST(:ids AS uuid[])) "
    f"AND {where_sources(Transition.WAIT)} ORDER BY id FOR UPDATE SKIP LOCKED"
)
# A row waiting for its turn is not due: the row in front of it is (or is
# being published, and its relay takes the next one).
_NEXT_DUE = text(
    "SELECT extract(epoch FROM min(available_at) - now()) FROM outbox "
    f"WHERE published_at IS NULL AND failed_at IS NULL AND {IN_TURN}"
)


class OutboxKind(enum.StrEnum):
    """What an outbox row stands for: the one place its kinds are named.

    The database knows them too: ``outbox.kind`` defaults to
    :attr:`JOB_DISPATCH` and a CHECK holds each kind to its columns
    (migration 0006).
    """

    #: A job's dispatch: the relay builds its envelope from the row.
    JOB_DISPATCH = "job.dispatch"
    #: A domain event: the row holds its body and headers as published.
    EVENT = "event"


class GiveUp(enum.Enum):
    """What giving up on an outbox row did."""

    JOB_FAILED = "job_failed"  # the row is failed, and its job with it
    MOVED_ON = "moved_on"  # the row is failed; its job had another dispatch or state
    NO_JOB = "no_job"  # the row is failed; not a dispatch, so no job goes with it
    BUSY = "busy"  # nothing: the job row was locked; try again later


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One message waiting to be published."""

    id: uuid.UUID
    kind: OutboxKind
    tenant_id: uuid.UUID
    routing_key: str
    correlation_id: str = ""
    #: None: the kind's exchange in the topology.
    exchange: str | None = None
    #: The body as published; None for a job dispatch.
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    #: Set for a job dispatch only.
    job_id: uuid.UUID | None = None
    #: A publish of it failed before (a return, a nack): its job may carry a
    #: waiting reason the relay clears once it is published.
    retried: bool = False
    #: A dispatch's queue (its job's); '' for other kinds and dispatches written
    #: before it was recorded.
    queue: str = ""

    @property
    def envelope(self) -> Envelope:
        """A job dispatch's envelope; the row id is its event id."""
        if self.kind is not OutboxKind.JOB_DISPATCH or self.job_id is None:
            raise ValueError(f"outbox row {self.id} is not a job dispatch")
        return Envelope(
            event_id=self.id,
            job_id=self.job_id,
            tenant_id=self.tenant_id,
            job_type=self.routing_key,
            correlation_id=self.correlation_id,
        )


class OutboxBatch:
    """Rows claimed in an open transaction; marks are written before it commits."""

    def __init__(self, conn: Conn, rows: list[OutboxRow], slots: list[FairSlot] | None = None):
        self._conn = conn
        self.rows = rows
        #: The dispatches' places in their queues' rounds (a fair claim's only).
        self.slots = slots or []

    async def mark_published(self, ids: Sequence[uuid.UUID]) -> None:
        """Record a broker confirm for these rows."""
        if ids:
            await self._conn.execute(_MARK_PUBLISHED, {"ids": [str(i) for i in ids]})

    async def mark_retry(self, ids: Sequence[uuid.UUID], error: str) -> None:
        """Leave these rows unpublished, due again after a backoff."""
        if ids:
            await self._conn.execute(
                _MARK_RETRY, {"ids": [str(i) for i in ids], "error": error[:1000]}
            )

    async def defer(self, ids: Sequence[uuid.UUID], error: str) -> None:
        """Leave these rows due again after a backoff, their run of returns kept."""
        if ids:
            await self._conn.execute(_DEFER, {"ids": [str(i) for i in ids], "error": error[:1000]})

    async def mark_failed(self, row: OutboxRow, error: str) -> None:
        """No longer due, its job left as it is (for when the job cannot be failed)."""
        await self._conn.execute(_MARK_FAILED, {"id": row.id, "error": error[:1000]})

    async def mark_returned(
        self, ids: Sequence[uuid.UUID], error: str, *, give_up_after: float, give_up_returns: int
    ) -> list[uuid.UUID]:
        """Rows the broker returned as unroutable: due again after a backoff.

        Returns the ids of those returned at least ``give_up_returns`` times
        over at least ``give_up_after`` seconds: the caller fails them.
        """
        if not ids:
            return []
        result = await self._conn.fetch(
            _MARK_RETURNED,
            {
                "ids": [str(i) for i in ids],
                "error": error[:1000],
                "min_returns": give_up_returns,
                "after": give_up_after,
            },
        )
        return [uuid.UUID(str(r["id"])) for r in result if r["give_up"]]

    async def note_waiting(
        self, reasons: Sequence[tuple[OutboxRow, str, str]], *, clears: str = ""
    ) -> list[OutboxRow]:
        """Say on each dispatch's job why it waits: ``(row, code, message)``, the
        :data:`~jobplane.store.machine.Transition.WAIT` of jobs still waiting for
        that very dispatch. An empty code clears the job's reason, and only when
        its code is ``clears`` (a reason someone else gave stays).

        Returns the rows whose job's reason changed; a job locked elsewhere
        is left as it is.
        """
        by_job = {row.job_id: (row, code, message) for row, code, message in reasons if row.job_id}
        if not by_job:
            return []
        locked = await self._conn.fetch(_LOCK_WAITING, {"ids": [str(i) for i in by_job]})
        wanted = [
            by_job[r["id"]] for r in locked if by_job[r["id"]][1] or r["waiting_code"] == clears
        ]
        if not wanted:
            return []
        changed = await MACHINE.apply_many(
            self._conn,
            Transition.WAIT,
            [
                MACHINE.prepare(
                    Transition.WAIT,
                    {
                        "id": row.job_id,
                        "dispatch_id": row.id,
                        "waiting_code": code or None,
                        "waiting_reason": message[:1000] if code else None,
                    },
                )
                for row, code, message in wanted
            ],
            returning=("id",),
        )
        return [row for (row, _, _), done in zip(wanted, changed, strict=True) if done is not None]

    async def fail(self, row: OutboxRow, code: str, message: str) -> GiveUp:
        """Give up on ``row``: no longer due, and a dispatch's job FAILED with ``code``.

        :attr:`GiveUp.BUSY` (nothing written): the job row is locked by
        another transaction; the caller leaves the row due and tries later.
        :attr:`GiveUp.MOVED_ON`: the job no longer waits for this row (another
        dispatch, parked, or no longer QUEUED): the row is failed, the job
        left alone. :attr:`GiveUp.NO_JOB`: the row is not a dispatch; it
        is failed alone.
        """
        message = message[:1000]
        if row.job_id is None:
            # Not a dispatch: there is no job to fail with it.
            await self._conn.execute(_MARK_FAILED, {"id": row.id, "error": message})
            return GiveUp.NO_JOB
        ids = {"job_id": row.job_id, "dispatch_id": row.id}
        job = await self._conn.fetchrow(_LOCK_JOB, ids)
        if job is None:
            return GiveUp.BUSY
        await self._conn.execute(_MARK_FAILED, {"id": row.id, "error": message})
        if not job["current"]:
            return GiveUp.MOVED_ON
        await MACHINE.apply(
            self._conn,
            Transition.RELAY_FAIL,
            {**ids, "code": code, "message": message},
            Cause(message, {"error": {"code": code, "retryable": False}}),
            returning=("id",),
        )
        return GiveUp.JOB_FAILED


def claim_statement(
    limit: int, *, skip: Collection[uuid.UUID] = (), fair: FairClaim | None = None
) -> tuple[TextClause, dict[str, Any]]:
    """The statement and binds of :meth:`OutboxStore.claim`: what the relay runs,
    and what the plans' checks EXPLAIN."""
    skipped = [str(i) for i in skip]
    if fair is None:
        return _CLAIM_BOTH, {"limit": limit, "skip": skipped}
    binds = fair.round.binds(fair.credits, limit=limit)
    binds["skip"] = skipped
    return _FAIR_CLAIM_BOTH, binds


class OutboxStore:
    """Claims due outbox rows for publishing."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @asynccontextmanager
    async def claim(
        self, limit: int, *, skip: Collection[uuid.UUID] = (), fair: FairClaim | None = None
    ) -> AsyncIterator[OutboxBatch]:
        """Lock up to ``limit`` due dispatches and ``limit`` other due rows (none of
        ``skip``) for the life of the block, in one statement.

        With ``fair``, the dispatches are those its queues' credits and rounds
        choose (:mod:`jobplane.store.fair`), in that order; without, the
        longest due first. The other rows follow the dispatches.

        The marks written inside the block commit with it; if the block
        raises, the rows stay unpublished and due.
        """
        statement, binds = claim_statement(limit, skip=skip, fair=fair)
        async with self._db.begin() as conn:
            yield await self._batch(conn, statement, binds, fair=fair is not None)

    @asynccontextmanager
    async def claim_one(self, row_id: uuid.UUID) -> AsyncIterator[OutboxBatch]:
        """Lock one row, due or not, in a transaction of its own.

        The batch is empty when the row is locked elsewhere, published or
        failed meanwhile.
        """
        async with self._db.begin() as conn:
            yield await self._batch(conn, _CLAIM_ONE, {"limit": 1, "id": row_id})

    @staticmethod
    async def _batch(
        conn: Conn, statement: TextClause, params: dict[str, Any], *, fair: bool = False
    ) -> OutboxBatch:
        result = await conn.fetch(statement, params)
        rows = [
            OutboxRow(
                id=r["id"],
                kind=OutboxKind(r["kind"]),
                tenant_id=r["tenant_id"],
                routing_key=r["routing_key"],
                correlation_id=r["correlation_id"],
                exchange=r["exchange"],
                body=None if r["body"] is None else bytes(r["body"]),
                headers=_headers(r["headers"]),
                job_id=r["job_id"],
                retried=bool(r["retried"]),
                queue=str(r["queue"]) if fair and r["queue"] is not None else "",
            )
            for r in result
        ]
        if not fair:
            return OutboxBatch(conn, rows)
        # The dispatches' places; the claim's other rows (part 1) have none.
        slots = [
            FairSlot(str(r["queue"]), r["tenant_id"], float(r["start_tag"]), float(r["weight"]))
            for r in result
            if r["part"] == 0
        ]
        return OutboxBatch(conn, rows, slots)

    async def seconds_until_due(self) -> float | None:
        """Seconds until the earliest unpublished row is due (<= 0: now), or None."""
        async with self._db.connect() as conn:
            value = await conn.fetchval(_NEXT_DUE)
        return None if value is None else float(value)


def _headers(value: Any) -> dict[str, str]:
    # asyncpg hands jsonb back as text unless a codec is set; accept both.
    data = json.loads(value) if isinstance(value, str) else value
    if not isinstance(data, dict):
        return {}
    return {str(k): str(v) for k, v in data.items() if v is not None}
