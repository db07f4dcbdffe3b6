"""The relay side of the outbox: claim due rows, then mark what was confirmed."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.envelope import Envelope

# SKIP LOCKED lets any number of relays share the table: each takes rows no
# other relay holds, and a relay that dies releases its rows with its
# transaction.
_CLAIM_DUE = text(
    """
    SELECT id, tenant_id, job_id, routing_key, correlation_id
    FROM outbox
    WHERE published_at IS NULL AND available_at <= now()
    ORDER BY available_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
    """
)
_MARK_PUBLISHED = text(
    "UPDATE outbox SET published_at = now(), publish_attempts = publish_attempts + 1 "
    "WHERE id = ANY(CAST(:ids AS uuid[]))"
)
_MARK_FAILED = text(
    """
    UPDATE outbox SET publish_attempts = publish_attempts + 1, last_error = :error,
        available_at = now()
            + make_interval(secs => least(30, 0.5 * 2 ^ least(publish_attempts, 6)))
    WHERE id = ANY(CAST(:ids AS uuid[]))
    """
)
_NEXT_DUE = text(
    "SELECT extract(epoch FROM min(available_at) - now()) FROM outbox WHERE published_at IS NULL"
)


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One dispatch waiting to be published."""

    envelope: Envelope

    @property
    def id(self) -> uuid.UUID:
        """The outbox row id, which is also the message id."""
        return self.envelope.event_id


class OutboxBatch:
    """Rows claimed in an open transaction; marks are written before it commits."""

    def __init__(self, conn: AsyncConnection, rows: list[OutboxRow]) -> None:
        self._conn = conn
        self.rows = rows

    async def mark_published(self, ids: Sequence[uuid.UUID]) -> None:
        """Record a broker confirm for these rows."""
        if ids:
            await self._conn.execute(_MARK_PUBLISHED, {"ids": [str(i) for i in ids]})

    async def mark_failed(self, ids: Sequence[uuid.UUID], error: str) -> None:
        """Leave these rows unpublished, due again after a backoff."""
        if ids:
            await self._conn.execute(
                _MARK_FAILED, {"ids": [str(i) for i in ids], "error": error[:1000]}
            )


class OutboxStore:
    """Claims due outbox rows for publishing."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    @asynccontextmanager
    async def claim(self, limit: int) -> AsyncIterator[OutboxBatch]:
        """Lock up to ``limit`` due rows for the life of the block.

        The marks written inside the block commit with it; if the block
        raises, the rows stay unpublished and due.
        """
        async with self._engine.begin() as conn:
            result = await conn.execute(_CLAIM_DUE, {"limit": limit})
            rows = [
                OutboxRow(
                    Envelope(
                        event_id=uuid.UUID(str(r.id)),
                        job_id=uuid.UUID(str(r.job_id)),
                        tenant_id=uuid.UUID(str(r.tenant_id)),
                        job_type=r.routing_key,
                        correlation_id=r.correlation_id,
                    )
                )
                for r in result
            ]
            yield OutboxBatch(conn, rows)

    async def seconds_until_due(self) -> float | None:
        """Seconds until the earliest unpublished row is due (<= 0: now), or None."""
        async with self._engine.connect() as conn:
            value = (await conn.execute(_NEXT_DUE)).scalar_one_or_none()
        return None if value is None else float(value)
