"""Consume domain events from RabbitMQ into a service, each one applied once.

A :class:`Consumer` owns one durable quorum queue, bound to the events
exchange by event-type patterns, and runs an async handler per event. For
each delivery it opens a transaction on the service's database, inserts the
event into the inbox (:mod:`jobplane.events.inbox`), runs the handler with
that same connection, commits, and only then acks. A crash anywhere before
the commit leaves nothing written and the message unacked (redelivered); a
crash after the commit leaves the inbox row, so the redelivery is acked
without running the handler.

Messages that are not events are rejected to the queue's dead-letter queue;
a handler that raises has its delivery returned (after a growing delay) until
the queue's delivery limit dead-letters it — the same safety net as
jobplane's own queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import aio_pika
import aiormq
import asyncpg
import structlog
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractIncomingMessage,
    AbstractQueue,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane import broker
from jobplane.events import inbox
from jobplane.events.envelope import (
    EXCHANGE,
    MAX_EVENT_BYTES,
    Event,
    EventError,
    decode,
    validate_pattern,
)
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.logs import describe_error
from jobplane.store.down import database_unavailable
from jobplane.topology import TopologyMissing

log = structlog.get_logger("jobplane.events")

#: What a consumer runs per event: the event, and a connection whose
#: transaction commits together with the event's inbox row. The handler must
#: not commit or roll back itself; raising rolls everything back.
Handler = Callable[[Event, AsyncConnection], Awaitable[None]]

# Queue names as RabbitMQ takes them (a short string), leaving room for the
# dead-letter queue's suffix; the same alphabet as the topology file's names.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
DEAD_LETTER_SUFFIX = ".dead"

# Errors a database driver raises; only these can mean "the database is down"
# here. A handler's own OSError (an HTTP call that failed) is its failure,
# counted towards the delivery limit, not a reason to wait for the database.
_DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    DBAPIError,
    PoolTimeout,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)


@dataclass(slots=True)
class ConsumerCounts:
    """What a consumer did since it started (for tests, metrics and health checks)."""

    #: Events whose handler ran and committed.
    applied: int = 0
    #: Copies of events already applied, acked without running the handler.
    duplicates: int = 0
    #: Messages that were not events, rejected to the dead-letter queue.
    rejected: int = 0
    #: Handler runs that raised (each one's delivery was returned).
    failed: int = 0


class Consumer:
    """Applies the events of its queue to a service's database, once each.

    ``name`` identifies the consumer in the inbox (dedupe is per name, so two
    services never shadow each other's events) and is also its queue's name
    unless ``queue`` is given. Keep it stable: a new name sees every event as
    new.

    Use as ``async with Consumer(...) as consumer:`` (or :meth:`run`). Start
    checks the broker side and declares what is missing: the exchange (a
    durable topic exchange), the queue (a durable quorum queue with
    ``x-delivery-limit`` and the at-least-once dead-letter strategy) and its
    dead-letter queue ``<queue>.dead``; then binds every pattern. With
    ``passive=True`` it only checks that the exchange, queue and dead-letter
    queue exist and binds nothing — for accounts without RabbitMQ's
    *configure* permission, whose operator declares them (ADR-0006); a missing
    part raises :class:`~jobplane.topology.TopologyMissing`.

    ``concurrency`` handlers run at once (it is also the prefetch). With 1,
    events are applied in the order the queue delivers them; with more, in
    no particular order.

    A handler that raises is retried: its delivery is held for
    ``retry_delay * 2 ** (deliveries - 1)`` seconds (at most ``max_retry_delay``)
    and then returned to the queue; after ``delivery_limit`` returns the broker
    dead-letters it. While the database is unreachable, an event is retried in
    place without counting, so an outage does not dead-letter events.
    """

    def __init__(
        self,
        name: str,
        handler: Handler,
        *,
        engine: AsyncEngine,
        amqp_url: str,
        patterns: Sequence[str],
        queue: str | None = None,
        exchange: str = EXCHANGE,
        passive: bool = False,
        delivery_limit: int = 5,
        concurrency: int = 1,
        retry_delay: float = 1.0,
        max_retry_delay: float = 30.0,
        max_event_bytes: int = MAX_EVENT_BYTES,
        faults: FaultPoints = NO_FAULTS,
    ) -> None:
        if not name or len(name) > 200:
            raise ValueError("consumer name must be 1..200 characters")
        self.queue = queue or name
        for label, value in (("queue", self.queue), ("exchange", exchange)):
            if not _NAME.fullmatch(value):
                raise ValueError(
                    f"{label} {value!r} must be 1..200 letters, digits, '.', '_', ':' or '-'"
                )
        if not patterns and not passive:
            raise ValueError("a consumer needs at least one event type pattern to bind")
        for pattern in patterns:
            try:
                validate_pattern(pattern)
            except EventError as exc:
                raise ValueError(str(exc)) from None
        if concurrency < 1 or delivery_limit < 1:
            raise ValueError("concurrency and delivery_limit must be at least 1")
        if retry_delay < 0 or max_retry_delay < retry_delay:
            raise ValueError("need 0 <= retry_delay <= max_retry_delay")
        self.name = name
        self.dead_letter_queue = self.queue + DEAD_LETTER_SUFFIX
        self.exchange = exchange
        self.patterns = tuple(patterns)
        self.counts = ConsumerCounts()
        self._handler = handler
        self._engine = engine
        self._amqp_url = amqp_url
        self._passive = passive
        self._delivery_limit = delivery_limit
        self._concurrency = concurrency
        self._retry_delay = retry_delay
        self._max_retry_delay = max_retry_delay
        self._max_event_bytes = max_event_bytes
        self._faults = faults
        self._connection: AbstractConnection | None = None
        self._consumer: tuple[AbstractQueue, str] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def run(self) -> None:
        """Start, consume until cancelled, then stop."""
        async with self:
            await asyncio.Event().wait()

    async def start(self) -> None:
        """Check (and unless passive, declare and bind) the queue, then consume.

        Waits while the broker is down; raises :class:`TopologyMissing` when
        a part is missing and this account may not (or, passive, must not)
        declare it.
        """
        self._stopping.clear()
        await broker.until_up(self._prepare, log)
        try:
            self._connection = await broker.until_up(
                lambda: broker.connect(self._amqp_url, robust=True), log
            )
            channel = await self._connection.channel()
            await channel.set_qos(prefetch_count=self._concurrency)
            # Passive: the robust channel restores it passively after a
            # reconnect, which needs no configure permission.
            queue = await channel.get_queue(self.queue)
            tag = await queue.consume(self._on_message, no_ack=False)
            self._consumer = (queue, tag)
        except BaseException:
            if self._connection is not None:
                with contextlib.suppress(Exception):
                    await self._connection.close()
                self._connection = None
            raise
        log.info(
            "events.consumer.started",
            consumer=self.name,
            queue=self.queue,
            patterns=list(self.patterns),
            concurrency=self._concurrency,
        )

    async def stop(self, grace: float = 10.0) -> None:
        """Stop consuming; give running handlers ``grace`` seconds, then cancel them.

        A cancelled handler's transaction rolls back and its event is
        delivered again later.
        """
        self._stopping.set()
        if self._consumer is not None:
            queue, tag = self._consumer
            self._consumer = None
            with contextlib.suppress(Exception):
                await queue.cancel(tag)
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=10)
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
            self._connection = None
            log.info("events.consumer.stopped", consumer=self.name)

    async def _prepare(self) -> None:
        """The broker side, on a connection of its own (no robust restore of declares)."""
        connection = await broker.connect(self._amqp_url)
        async with connection:
            await self._ensure(connection, "exchange", self.exchange, self._declare_exchange)
            await self._ensure(
                connection, "queue", self.dead_letter_queue, self._declare_dead_letter_queue
            )
            await self._ensure(connection, "queue", self.queue, self._declare_queue)
            if self._passive:
                return
            try:
                async with _channel(connection) as channel:
                    queue = await channel.get_queue(self.queue, ensure=False)
                    for pattern in self.patterns:
                        await queue.bind(self.exchange, routing_key=pattern)
            except aiormq.exceptions.AMQPError as exc:
                if not broker.access_refused(exc):
                    raise
                raise TopologyMissing(
                    f"this account may not bind queue {self.queue!r} to exchange "
                    f"{self.exchange!r} (it needs write on the queue and read on the "
                    "exchange): bind it with an account that may, and use passive=True"
                ) from exc

    async def _ensure(
        self,
        connection: AbstractConnection,
        kind: str,
        name: str,
        declare: Callable[[AbstractChannel], Awaitable[Any]],
    ) -> None:
        """Check ``name`` passively; declare it when missing (unless passive)."""
        if await _exists(connection, kind, name):
            return
        if self._passive:
            raise TopologyMissing(
                f"{kind} {name!r} is missing; declare it with an account that may "
                "configure (or start this consumer once without passive=True)"
            )
        try:
            async with _channel(connection) as channel:
                await declare(channel)
        except aiormq.exceptions.AMQPError as exc:
            if not broker.access_refused(exc):
                raise
            raise TopologyMissing(
                f"{kind} {name!r} is missing and this account may not declare it: declare "
                "it with an account that may configure, and use passive=True"
            ) from exc
        log.info("events.consumer.declared", consumer=self.name, kind=kind, name=name)

    async def _declare_exchange(self, channel: AbstractChannel) -> None:
        await channel.declare_exchange(self.exchange, aio_pika.ExchangeType.TOPIC, durable=True)

    async def _declare_dead_letter_queue(self, channel: AbstractChannel) -> None:
        await channel.declare_queue(
            self.dead_letter_queue, durable=True, arguments={"x-queue-type": "quorum"}
        )

    async def _declare_queue(self, channel: AbstractChannel) -> None:
        # Dead letters go through the default exchange straight to this
        # consumer's own dead-letter queue: an operator sees whose events
        # failed, and no other queue's bindings can catch them. At-least-once
        # dead-lettering (which needs reject-publish) never drops one on the way.
        await channel.declare_queue(
            self.queue,
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-delivery-limit": self._delivery_limit,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": self.dead_letter_queue,
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
            },
        )

    async def _on_message(self, message: AbstractIncomingMessage) -> None:
        # Our own task, not aiormq's: a channel that closes must not cancel a
        # handler mid-transaction (its commit stands; only the ack is lost).
        task = asyncio.create_task(self._handle_settled(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle_settled(self, message: AbstractIncomingMessage) -> None:
        """:meth:`_handle`, and a returned delivery for anything it left unsettled.

        An unsettled delivery holds a prefetch slot for the life of the
        channel; with concurrency 1 the consumer would take nothing more.
        """
        try:
            await self._handle(message)
        except asyncio.CancelledError:
            if not message.processed:
                await _settle(message.nack(requeue=True))
            raise
        except Exception as exc:
            log.error(
                "event.message.crashed",
                consumer=self.name,
                message_id=message.message_id,
                error=describe_error(exc),
                exc_info=exc,
            )
        if not message.processed:
            await _settle(message.nack(requeue=True))

    async def _handle(self, message: AbstractIncomingMessage) -> None:
        try:
            event = decode(message.body, max_bytes=self._max_event_bytes)
        except EventError as exc:
            self.counts.rejected += 1
            log.error(
                "event.message.rejected",
                consumer=self.name,
                reason=str(exc),
                field=exc.field,
                message_id=message.message_id,
                routing_key=message.routing_key,
            )
            await _settle(message.reject(requeue=False))
            return
        bound = log.bind(
            consumer=self.name, event_id=str(event.event_id), event_type=event.event_type
        )
        try:
            applied = await self._apply(event, bound)
        except _Stopping:
            await _settle(message.nack(requeue=True))
            return
        except Exception as exc:
            self.counts.failed += 1
            await self._return_failed(message, exc, bound)
            return
        self._faults.hit("events.consumer.before_ack")
        await _settle(message.ack())
        if applied:
            self.counts.applied += 1
            bound.info("event.applied")
        else:
            self.counts.duplicates += 1
            bound.info("event.duplicate")

    async def _apply(self, event: Event, bound: Any) -> bool:
        """Inbox row and handler in one transaction; False for an event applied before.

        Repeated while the database is unreachable (not counted as a failure:
        nothing the event did is at fault).
        """
        delay = 0.2
        while True:
            try:
                return await self._apply_once(event)
            except Exception as exc:
                if not (isinstance(exc, _DATABASE_ERRORS) and database_unavailable(exc)):
                    raise
                if self._stopping.is_set():
                    raise _Stopping from exc
                bound.warning("events.consumer.db.retry", error=describe_error(exc), delay=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def _apply_once(self, event: Event) -> bool:
        async with self._engine.connect() as conn, conn.begin():
            if not await inbox.record(conn, self.name, event.event_id, event.event_type):
                return False
            await self._handler(event, conn)
            self._faults.hit("events.consumer.before_commit")
        # Committed: from here a crash costs a redelivery that the inbox absorbs.
        self._faults.hit("events.consumer.after_commit")
        return True

    async def _return_failed(
        self, message: AbstractIncomingMessage, exc: Exception, bound: Any
    ) -> None:
        """Hold a failed delivery for the backoff, then return it to the queue."""
        # Quorum queues count returns in x-delivery-count (absent on the first).
        returns = _int_header(message.headers.get("x-delivery-count"))
        deliveries = returns + 1
        last = returns >= self._delivery_limit
        (bound.error if last else bound.warning)(
            "event.handler.failed",
            error=describe_error(exc),
            delivery=deliveries,
            delivery_limit=self._delivery_limit,
            dead_letter=self.dead_letter_queue if last else None,
            exc_info=exc,
        )
        if not last:
            delay = min(self._retry_delay * 2 ** (deliveries - 1), self._max_retry_delay)
            # A stop cuts the wait short: the delivery goes back at once.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), timeout=delay)
        await _settle(message.nack(requeue=True))


class _Stopping(Exception):
    """The consumer is stopping while the database is unreachable."""


def _int_header(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


async def _settle(settle: Awaitable[Any]) -> None:
    """Ack, nack or reject; a closed channel means the broker redelivers anyway."""
    try:
        await settle
    except Exception as exc:
        log.warning("event.message.settle_failed", error=describe_error(exc))


async def _exists(connection: AbstractConnection, kind: str, name: str) -> bool:
    # A passive declare of a missing entity closes its channel: one each.
    try:
        async with _channel(connection) as channel:
            if kind == "exchange":
                await channel.get_exchange(name, ensure=True)
            else:
                await channel.get_queue(name, ensure=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    return True


@contextlib.asynccontextmanager
async def _channel(connection: AbstractConnection) -> AsyncIterator[AbstractChannel]:
    channel = await connection.channel()
    try:
        yield channel
    finally:
        if not channel.is_closed:
            with contextlib.suppress(aiormq.exceptions.AMQPError, OSError):
                await channel.close()
