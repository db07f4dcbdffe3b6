"""The outbox relay: publish committed dispatch intents, confirmed, then mark them.

Rows are claimed with FOR UPDATE SKIP LOCKED, published persistent and
mandatory on a confirming channel, and marked published only for the ones the
broker acked. A nack, a return (unroutable) or a lost connection leaves the
row unpublished and due again after a backoff. A crash after the confirm and
before the mark publishes the row again later: workers treat that duplicate
as harmless.
"""

from __future__ import annotations

import asyncio
import contextlib

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractConnection, AbstractExchange
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.store.listen import Listener
from jobplane.store.outbox import OutboxRow, OutboxStore
from jobplane.store.rows import OUTBOX_CHANNEL
from jobplane.tasks import cancel_and_wait
from jobplane.topology import Topology, declare
from jobplane.workers.sweeper import Sweeper

log = structlog.get_logger("jobplane.relay")


class PublishFailed(Exception):
    """The broker did not confirm a message."""


class Relay:
    """Moves due outbox rows to RabbitMQ; any number may run at once."""

    def __init__(
        self,
        engine: AsyncEngine,
        database_url: str,
        amqp_url: str,
        topology: Topology,
        *,
        batch_size: int = 100,
        poll_seconds: float = 1.0,
        publish_timeout: float = 10.0,
        faults: FaultPoints = NO_FAULTS,
        sweeper: Sweeper | None = None,
        sweep_interval: float = 5.0,
    ) -> None:
        self._store = OutboxStore(engine)
        self._amqp_url = amqp_url
        self._topology = topology
        self._batch_size = batch_size
        self._poll_seconds = poll_seconds
        self._publish_timeout = publish_timeout
        self._faults = faults
        self._wakeups = Listener(database_url, OUTBOX_CHANNEL)
        self._task: asyncio.Task[None] | None = None
        self._sweeper = sweeper
        self._sweep_interval = sweep_interval
        self.published = 0

    async def start(self) -> None:
        """Start relaying in the background."""
        await self._wakeups.start()
        self._task = asyncio.create_task(self._run(), name="jobplane-relay")
        if self._sweeper is not None:
            self._sweeper.start(self._sweep_interval)

    async def stop(self) -> None:
        """Stop; a batch in flight is rolled back and stays due."""
        if self._sweeper is not None:
            await self._sweeper.stop()
        await cancel_and_wait(self._task)
        self._task = None
        await self._wakeups.stop()

    async def _run(self) -> None:
        delay = 0.5
        with self._wakeups.subscribe() as wakeup:
            while True:
                connection: AbstractConnection | None = None
                try:
                    connection = await broker.connect(self._amqp_url)
                    channel = await connection.channel(publisher_confirms=True)
                    exchange = await declare(channel, self._topology)
                    log.info("relay.connected")
                    delay = 0.5
                    while not connection.is_closed:
                        moved = await self.relay_once(exchange)
                        if moved < self._batch_size:
                            await wakeup.wait(await self._idle_seconds())
                except asyncio.CancelledError:
                    raise
                except (OSError, aiormq.exceptions.AMQPError, TimeoutError, PublishFailed) as exc:
                    log.warning("broker.unavailable", error=repr(exc), retry_in=delay)
                except DBAPIError as exc:
                    log.warning("relay.db.error", error=str(exc).splitlines()[0], retry_in=delay)
                finally:
                    if connection is not None:
                        with contextlib.suppress(Exception):
                            await connection.close()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def drain_once(self) -> int:
        """Connect, publish every row due now, disconnect; returns rows taken."""
        connection = await broker.connect(self._amqp_url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await declare(channel, self._topology)
            total = 0
            while (moved := await self.relay_once(exchange)) > 0:
                total += moved
                if moved < self._batch_size:
                    break
            return total

    async def _idle_seconds(self) -> float:
        due = await self._store.seconds_until_due()
        if due is None:
            return self._poll_seconds * 5
        return max(0.01, min(due, self._poll_seconds))

    async def relay_once(self, exchange: AbstractExchange) -> int:
        """Publish one batch of due rows; returns how many rows it took."""
        async with self._store.claim(self._batch_size) as batch:
            if not batch.rows:
                return 0
            results = await asyncio.gather(
                *(self._publish(exchange, row) for row in batch.rows), return_exceptions=True
            )
            confirmed = [row.id for row, r in zip(batch.rows, results, strict=True) if r is None]
            failed = [(row, r) for row, r in zip(batch.rows, results, strict=True) if r is not None]
            self._faults.hit("relay.after_confirm")
            await batch.mark_published(confirmed)
            if failed:
                await batch.mark_failed([row.id for row, _ in failed], repr(failed[0][1]))
                for row, error in failed:
                    log.warning("broker.publish.failed", event_id=str(row.id), error=repr(error))
            self.published += len(confirmed)
            log.debug("relay.batch", published=len(confirmed), failed=len(failed))
        if failed and not confirmed:
            # Nothing got through: most likely the connection; reconnect.
            raise PublishFailed(repr(failed[0][1]))
        return len(batch.rows)

    async def _publish(self, exchange: AbstractExchange, row: OutboxRow) -> None:
        envelope = row.envelope
        message = aio_pika.Message(
            envelope.encode(),
            content_type="application/json",
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            message_id=str(envelope.event_id),
            correlation_id=envelope.correlation_id or None,
            type="jobplane.job.dispatch.v1",
            headers={"job_id": str(envelope.job_id)},
        )
        confirmation = await exchange.publish(
            message, routing_key=envelope.job_type, mandatory=True, timeout=self._publish_timeout
        )
        # A returned (unroutable) message resolves the confirm too, carrying the
        # message instead of a Basic.Ack: that is not a publish.
        if not isinstance(confirmation, aiormq.spec.Basic.Ack):
            raise PublishFailed(f"not confirmed: {type(confirmation).__name__}")
