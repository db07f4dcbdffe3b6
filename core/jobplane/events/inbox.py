"""The inbox: which events a consumer has applied, in the consumer's own database.

RabbitMQ delivers each event at least once, so a consumer sees some twice (a
relay that published again after a lost confirm, a consumer that died after
its writes committed but before its ack). The inbox turns that into "applied
once": a row per (consumer, event_id) inserted in the same transaction as the
consumer's own writes. Either both commit or neither does; a copy that finds
the row was applied already and is acked without running the handler.

The table lives wherever the consumer's data lives — usually not jobplane's
database — so the service creates it itself with :func:`ensure_inbox` (or its
own migration, from the DDL in docs/events.md).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

INBOX_TABLE = "jobplane_inbox"

# A BRIN index keeps pruning by age cheap at almost no cost per insert: rows
# arrive in received_at order.
_DDL = (
    f"""
    CREATE TABLE IF NOT EXISTS {INBOX_TABLE} (
        consumer    text        NOT NULL,
        event_id    uuid        NOT NULL,
        event_type  text        NOT NULL,
        received_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (consumer, event_id)
    )
    """,
    f"CREATE INDEX IF NOT EXISTS {INBOX_TABLE}_received ON {INBOX_TABLE} USING brin (received_at)",
)
# Two services starting at once would race on CREATE TABLE IF NOT EXISTS (it
# is not atomic against a concurrent create); one lock key serialises them.
_DDL_LOCK = text("SELECT pg_advisory_xact_lock(hashtext('jobplane_inbox.ddl'))")

_RECORD = text(
    f"""
    INSERT INTO {INBOX_TABLE} (consumer, event_id, event_type)
    VALUES (:consumer, :event_id, :event_type)
    ON CONFLICT (consumer, event_id) DO NOTHING
    RETURNING 1
    """
)
_PRUNE = text(
    f"DELETE FROM {INBOX_TABLE} WHERE received_at < now() - make_interval(secs => :seconds)"
)


async def ensure_inbox(engine: AsyncEngine) -> None:
    """Create the inbox table and its index when they are missing (idempotent)."""
    async with engine.begin() as conn:
        await conn.execute(_DDL_LOCK)
        for statement in _DDL:
            await conn.execute(text(statement))


async def record(
    conn: AsyncConnection, consumer: str, event_id: uuid.UUID, event_type: str
) -> bool:
    """Insert the inbox row in ``conn``'s transaction; False when it was there already.

    A copy delivered while the first is still being applied waits here on the
    first one's row lock, and finds the row once that commits (or inserts it
    itself if that rolled back).
    """
    result = await conn.execute(
        _RECORD, {"consumer": consumer, "event_id": event_id, "event_type": event_type}
    )
    return result.first() is not None


async def prune_inbox(engine: AsyncEngine, *, older_than: timedelta) -> int:
    """Delete inbox rows received more than ``older_than`` ago; returns how many.

    Keep rows longer than any copy of an event can arrive late: a message
    waits in a queue while its consumer is down, so a week or more is usual.
    """
    async with engine.begin() as conn:
        result = await conn.execute(_PRUNE, {"seconds": older_than.total_seconds()})
        return int(result.rowcount or 0)
