"""What a process's metrics read at scrape time from the database and the
broker: the outbox's backlog, the jobs waiting by reason and how late the
recurring schedules run (:func:`watch_outbox`), the failed queue's depth and
each queue's messages and consumers (:class:`FailedQueueDepth`). Never per
job: once per scrape, each bounded by :data:`~jobplane.observe.metrics.REFRESH_TIMEOUT`.

Importable from :mod:`jobplane.observe.metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.observe.metrics import Metrics


# A row is due from its available_at (a scheduled retry's is in the future);
# the outbox_due index holds exactly the unpublished, unfailed rows by it.
_OUTBOX_BACKLOG = """
    SELECT count(*) FILTER (WHERE available_at <= now()) AS rows,
           count(*) FILTER (WHERE available_at > now()) AS scheduled,
           extract(epoch FROM now() - min(available_at)) AS oldest
    FROM outbox WHERE published_at IS NULL AND failed_at IS NULL
"""
# The due dispatches by queue: outbox_dispatch_fair holds exactly the
# unpublished, unfailed dispatches by (queue, tenant, due time).
_DISPATCH_WAITING = """
    SELECT queue, count(*) AS rows FROM outbox
    WHERE kind = 'job.dispatch' AND published_at IS NULL AND failed_at IS NULL
      AND available_at <= now()
    GROUP BY queue
"""
# Only a QUEUED job has a waiting code (every transition out of QUEUED clears
# it): the jobs_waiting index holds exactly them, a few rows.
_JOBS_WAITING = """
    SELECT waiting_code, count(*) AS jobs FROM jobs
    WHERE waiting_code IS NOT NULL GROUP BY waiting_code
"""

# Recurring schedules run late (no scheduler ticks, or it falls behind): the
# schedules_due index holds the unpaused ones by their next run.
_SCHEDULE_LAG = """
    SELECT extract(epoch FROM now() - min(next_run_time)) FROM schedules
    WHERE NOT paused AND next_run_time IS NOT NULL
"""


def watch_outbox(metrics: Metrics, engine: AsyncEngine) -> None:
    """Report the outbox's due rows, how long the longest-due one waits, the
    rows scheduled for later, the due dispatches by queue (those waiting for
    its credit), and the jobs waiting by reason, read at each scrape."""
    from sqlalchemy import text

    from jobplane.types import WaitingCode

    statement = text(_OUTBOX_BACKLOG)
    waiting = text(_JOBS_WAITING)
    schedule_lag = text(_SCHEDULE_LAG)
    by_queue = text(_DISPATCH_WAITING)
    queues_seen: set[str] = set()

    async def read() -> None:
        async with engine.connect() as conn:
            row = (await conn.execute(statement)).one()
            codes = {str(r.waiting_code): int(r.jobs) for r in await conn.execute(waiting)}
            lag = (await conn.execute(schedule_lag)).scalar()
            queued = {str(r.queue): int(r.rows) for r in await conn.execute(by_queue)}
        # A queue seen once keeps its series (0 once its dispatches are out).
        queues_seen.update(queued)
        for queue in queues_seen:
            metrics.dispatch_waiting.labels(queue).set(queued.get(queue, 0))
        # The known codes always have a series (0 when no job waits so); the
        # codes are the server's own, never a tenant's, so the labels stay few.
        # SCHEDULED is not stored (read from schedule_time, ADR-0039): the
        # dispatches it waits on are outbox_scheduled's.
        stored = [c for c in WaitingCode if c is not WaitingCode.SCHEDULED]
        for code in dict.fromkeys([*stored, *codes]):
            metrics.jobs_waiting.labels(str(code)).set(codes.get(code, 0))
        metrics.outbox_backlog.set(int(row.rows))
        metrics.outbox_scheduled.set(int(row.scheduled))
        # Negative when every row is scheduled for later: none is due.
        metrics.outbox_oldest.set(max(float(row.oldest or 0.0), 0.0))
        # Negative while every schedule's next run is ahead: none is late.
        metrics.schedule_lag.set(max(float(lag or 0.0), 0.0))

    metrics.on_scrape("outbox", read)


class FailedQueueDepth:
    """Reads the failed (dead-letter) queue's depth, and each of ``queues``' ready
    messages and consumers, at each scrape, on a broker connection of its own
    (opened at the first scrape, again after a loss, closed by :meth:`close`), so
    it never shares a channel a publish or a consumer needs.

    One read at a time (a lock): overlapping scrapes share the one connection
    rather than each opening one. A read is bounded by the scrape's
    :data:`~jobplane.observe.metrics.REFRESH_TIMEOUT`; cancelled while
    connecting, the connection is closed (:func:`jobplane.broker.connect`
    leaves nothing behind).
    """

    def __init__(
        self, metrics: Metrics, amqp_url: str, queue: str, queues: Sequence[str] = ()
    ) -> None:
        self._metrics = metrics
        self._amqp_url = amqp_url
        self._queue = queue
        self._queues = tuple(q for q in queues if q != queue)
        self._connection: Any = None
        self._lock = asyncio.Lock()
        metrics.on_scrape("failed_queue", self.read)

    async def read(self) -> None:
        """Declare each queue passively (its message and consumer counts)."""
        async with self._lock:
            await self._read()

    async def _read(self) -> None:
        import aiormq

        from jobplane import broker

        connection = self._connection
        if connection is None or connection.is_closed:
            self._connection = None
            connection = self._connection = await broker.connect(self._amqp_url)
        found: dict[str, tuple[int, int]] = {}
        missing: list[str] = []
        channel: Any = None
        try:
            try:
                for name in (self._queue, *self._queues):
                    if channel is None or channel.is_closed:
                        channel = await connection.channel()
                    try:
                        declared = await channel.declare_queue(name, passive=True)
                    except aiormq.exceptions.ChannelNotFoundEntity:
                        missing.append(name)  # not declared: the channel is closed
                        continue
                    result = declared.declaration_result
                    found[name] = (int(result.message_count or 0), int(result.consumer_count or 0))
            finally:
                if channel is not None and not channel.is_closed:
                    await channel.close()
        except Exception:
            if connection.is_closed or connection.transport is None:
                await self.close()  # reconnect next time; a channel error keeps it
            raise
        for name, (messages, consumers) in found.items():
            if name == self._queue:
                self._metrics.failed_queue.labels(name).set(messages)
            else:
                self._metrics.queue_messages.labels(name).set(messages)
                self._metrics.queue_consumers.labels(name).set(consumers)
        if missing:
            raise LookupError(f"queues not declared: {', '.join(missing)}")

    async def close(self) -> None:
        """Close its connection, if open."""
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()
