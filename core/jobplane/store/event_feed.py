"""The relays' feed: the events table's settled events, published in commit order (ADR-0016).

One relay at a time holds the feed, by a transaction-level advisory lock:
no row lock, so the feed's transaction takes no transaction id until it
moves the position, and never holds back the horizon it reads by. Its
position is ``event_relay``'s one row. Lifecycle events the topology does not
publish (``lifecycle_publish``, ADR-0052) are passed over in SQL: the relay
never reads them, and the position moves past them with the rest.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy import text

from jobplane.store.db import Conn, Database
from jobplane.store.events import EVENT_COLUMNS, Position, StoredEvent, stored_event

FEED_LOCK_KEY = 0x6A70_6576_6665_6564  # "jpevfeed"
_FEED_LOCK = text("SELECT pg_try_advisory_xact_lock(:key)")
_FEED_POSITION = text("SELECT CAST(txid AS text) AS txid, seq FROM event_relay")
# One pass's read, in one snapshot (one horizon): the settled events to
# publish after the position (up to :limit, in order), the last settled
# event after the position whatever its kind (``end``: with no more to
# publish before it, the position moves there), and whether any committed
# event waits for an older transaction (``held``). A lifecycle event is to
# publish only when lifecycle_publish takes its type (ADR-0052); the others
# are passed over in SQL, never sent here. Settled rows come first in
# (txid, seq) order (txid < horizon), so what is settled up to ``end`` was
# all looked at. Always one row at least: ``end`` and ``held`` with no event
# when there is nothing to publish.
_FEED_READ = text(
    f"""
    WITH h AS MATERIALIZED (
        SELECT pg_snapshot_xmin(pg_current_snapshot()) AS horizon,
               coalesce((SELECT event_types FROM lifecycle_publish), '{{}}') AS published
    ),
    publish AS (
        SELECT tenant_id, {EVENT_COLUMNS}, traceparent, tracestate,
               txid AS at_txid, seq AS at_seq
        FROM events
        WHERE (txid, seq) > (CAST(CAST(:txid AS text) AS xid8), :seq)
            AND txid < (SELECT horizon FROM h)
            AND (NOT lifecycle OR event_type = ANY (CAST((SELECT published FROM h) AS text[])))
        -- Qualified: a bare txid would be the text column above, in text order.
        ORDER BY events.txid, events.seq
        LIMIT :limit
    ),
    stop AS (
        SELECT
            (SELECT CAST(txid AS text) || ':' || seq FROM events
             WHERE (txid, seq) > (CAST(CAST(:txid AS text) AS xid8), :seq)
                 AND txid < (SELECT horizon FROM h)
             ORDER BY txid DESC, seq DESC LIMIT 1) AS end_at,
            EXISTS (SELECT 1 FROM events WHERE txid >= (SELECT horizon FROM h)) AS held
    )
    SELECT p.tenant_id, p.event_id, p.event_type, p.event_time, p.project_id, p.correlation_id,
           p.causation_id, p.payload, p.job_id, p.txid, p.seq, p.traceparent, p.tracestate,
           s.end_at, s.held
    FROM stop s LEFT JOIN publish p ON true
    ORDER BY p.at_txid, p.at_seq
    """
)
# An event the broker keeps refusing, moved to the outbox: it is retried
# there on its own, with backoff, for ever, and holds up no event behind it.
_FEED_PARK = text(
    """
    INSERT INTO outbox (id, tenant_id, kind, routing_key, correlation_id, body, headers,
                        last_error, available_at)
    VALUES (gen_random_uuid(), :tenant_id, 'event', :event_type, :correlation_id, :body,
            jsonb_strip_nulls(jsonb_build_object(
                'correlation_id', CAST(:correlation_id AS text),
                'causation_id', CAST(:causation_id AS text),
                'traceparent', CAST(:traceparent AS text),
                'tracestate', CAST(:tracestate AS text))),
            :error, now() + make_interval(secs => :delay))
    """
)
_FEED_MOVE = text(
    "UPDATE event_relay SET txid = CAST(CAST(:txid AS text) AS xid8), seq = :seq, moved_at = now()"
)


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """An event to publish, with the trace context it was written with."""

    stored: StoredEvent
    traceparent: str | None = None
    tracestate: str | None = None


class FeedBatch:
    """Settled events to publish after the feed's position, read holding the feed.

    ``held``: events were committed after the settled ones but wait for an
    older transaction to end (read again soon: no notification will say
    when). ``end``: the last settled event after the position, published or
    not (None: there is none); when every one of ``events`` is published and
    the read was not cut at its limit, nothing between them and ``end`` is
    to publish (lifecycle events the topology leaves out), and the position
    moves there. :meth:`advance` moves the position; it commits with the block.
    """

    def __init__(
        self,
        conn: Conn,
        events: list[FeedEvent],
        *,
        held: bool,
        end: Position | None = None,
    ) -> None:
        self._conn = conn
        self.events = events
        self.held = held
        self.end = end

    async def park(self, event: FeedEvent, body: bytes, error: str, *, delay: float) -> None:
        """Hand ``event`` to the outbox (as a row of kind ``event``, due after
        ``delay`` seconds), so that the position can move past it."""
        stored = event.stored.event
        await self._conn.execute(
            _FEED_PARK,
            {
                "tenant_id": stored.tenant_id,
                "event_type": stored.event_type,
                "correlation_id": stored.correlation_id,
                "causation_id": stored.causation_id,
                "traceparent": event.traceparent,
                "tracestate": event.tracestate,
                "body": body,
                "error": error[:1000],
                "delay": delay,
            },
        )

    async def advance(self, position: Position) -> None:
        """Record that every event up to ``position`` is published."""
        await self._conn.execute(_FEED_MOVE, {"txid": str(position.txid), "seq": position.seq})


class EventFeed:
    """The relays' cursor over ``events``: each event published at least once, in commit order."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[FeedBatch | None]:
        """Hold the feed for the block and read up to ``limit`` events to publish
        after its position.

        None when another relay holds it. Lifecycle events the topology does
        not publish are not read (the batch's ``end`` passes them). Moves
        made in the block commit with it; if the block raises, the position
        stays where it was.
        """
        async with self._db.begin() as conn:
            if not await conn.fetchval(_FEED_LOCK, {"key": FEED_LOCK_KEY}):
                yield None
                return
            at = await conn.fetchrow(_FEED_POSITION)
            assert at is not None  # the table has its one row (migration 0010)
            rows = await conn.fetch(
                _FEED_READ, {"txid": at["txid"], "seq": int(at["seq"]), "limit": limit}
            )
            events = [
                FeedEvent(
                    stored_event(uuid.UUID(str(row["tenant_id"])), row),
                    row["traceparent"],
                    row["tracestate"],
                )
                for row in rows
                if row["event_id"] is not None
            ]
            end_at = rows[0]["end_at"]
            end = None if end_at is None else Position(*map(int, end_at.split(":")))
            yield FeedBatch(conn, events, held=bool(rows[0]["held"]), end=end)


__all__ = ["FEED_LOCK_KEY", "EventFeed", "FeedBatch", "FeedEvent"]
