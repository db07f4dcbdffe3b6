"""The relay: publish committed messages and events, confirmed, then record it.

Two feeds, each on a confirming channel of its own on one connection:

- **the outbox** (job dispatches, and messages of other kinds). Rows are
claimed with FOR UPDATE SKIP LOCKED, published persistent on a
confirming channel, and marked by what the broker did with each, in the
claim's transaction. A job dispatch goes to the jobs exchange, mandatory,
its envelope built from the row; a domain event goes to the events exchange
with the row's body as it is and the properties of docs/events.md, *not*
mandatory: an event no queue is bound to is a fact nobody listens to yet, so
the broker drops it and confirms, and the row is published (the event stays
in the events table). What the broker did:

- an ack: published;
- a nack, a timeout or a lost connection: due again after a backoff
  (transient; the relay reconnects only when its channel is gone);
- a return (no queue bound for a dispatch's job type): due again after a backoff,
  until the row has come back ``unroutable_returns`` times in a row over at
  least ``unroutable_after`` seconds — then the job FAILS with
  ``JOB_TYPE_UNROUTABLE``. The server refuses types its topology file does
  not route, so a return means the broker's bindings differ from the file
  (not applied yet, being re-applied, a queue deleted): worth minutes of
  patience, not a job QUEUED for ever. Meanwhile the job says why it waits
  (``waiting_code`` UNROUTABLE, the fix in ``waiting_reason``), cleared
  when its dispatch is published (a job locked elsewhere at that moment is
  skipped, never waited for: its claim clears the reason);
- a message the broker can never take (a correlation id or routing key
  longer than AMQP's 255-byte short strings, a body over the envelope limit,
  an event row whose body is not an event): the row is failed and a
  dispatch's job FAILS with ``DISPATCH_FAILED``, at once.

One row's fate never holds up the others of its batch — not even when the
database refuses to record it: the batch is then recorded again row by row,
each in a transaction of its own. A row refused for its values (a constraint,
a trigger) is failed (its job too, ``DISPATCH_FAILED``, naming the refusal)
or, if the database refuses even that, held back from this relay's claims for
a while and reported for an operator. A statement refused for what it is (an
undefined column, a missing privilege) would refuse every row alike: nothing
is failed over it; the rows stay due and the relay says so loudly.

A crash after the confirm and before the mark publishes the row again later:
workers treat that duplicate as harmless.

- **the events table** (domain events: lifecycle, emitted, published; ADR-0016).
  One relay at a time holds the feed, reads the settled events after its
  position in commit order, publishes them in that order (persistent, not
  mandatory, the body and properties of docs/events.md), and moves the
  position past the confirmed ones in front of the first that was not. A
  crash, a nack or a timeout publishes from there again: at least once, and
  a job's events reach every queue in the order they happened (a repeat can
  follow a later event only after a nack or a crash). An event AMQP can never
  carry is logged (``relay.event.failed``), passed over and left in the table
  for subscribers.

The broker link is closed only when the broker is down or the channel is
gone. A database that is down is waited out with the link kept open: a
reconnect would re-run the whole topology check for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aio_pika
import aiormq
import pamqp.exceptions
import pamqp.frame
import pamqp.header
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.amqp import Properties
from jobplane.envelope import AMQP_TYPE, DEPLOYMENT_HEADER, MAX_ENVELOPE_BYTES, Envelope
from jobplane.events.envelope import (
    MAX_EVENT_BYTES,
    TRACEPARENT_HEADER,
    TRACESTATE_HEADER,
    Event,
    EventError,
    amqp_properties,
    decode,
    encode,
)
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.lifecycle import Lifecycle
from jobplane.logs import describe_error, fingerprint
from jobplane.names import job_name
from jobplane.store.db import Database
from jobplane.store.deployment import Deployment, this_deployment
from jobplane.store.down import database_transient
from jobplane.store.events import EventFeed, FeedEvent
from jobplane.store.listen import Listener, Subscription
from jobplane.store.outbox import GiveUp, OutboxBatch, OutboxKind, OutboxRow, OutboxStore
from jobplane.store.rows import DOMAIN_EVENTS_CHANNEL, OUTBOX_CHANNEL
from jobplane.tasks import cancel_and_wait
from jobplane.topology import Ownership, Topology, TopologyMissing, ensure
from jobplane.types import WaitingCode
from jobplane.workers.interceptors import NO_HEADERS, RelayInterceptor, chain_relay

log = structlog.get_logger("jobplane.relay")

DISPATCH_FAILED = "DISPATCH_FAILED"
JOB_TYPE_UNROUTABLE = "JOB_TYPE_UNROUTABLE"
_SHORT_STRING = 255  # bytes of an AMQP short string
# AMQP's smallest frame: a header frame this size fits any broker's frame_max.
_MIN_FRAME_MAX = 4096
# How long a row the database refuses to change is left out of this relay's
# claims before it is tried again (an operator may have fixed the cause).
_HOLD_SECONDS = 300.0
# SQLSTATE classes of a refusal about the values of a row, not the statement:
# data exceptions (22), integrity constraints (23), a trigger's RAISE (P0),
# WITH CHECK OPTION (44). Anything else non-transient (an undefined column, a
# missing privilege, a bug) refuses the statement for every row alike: failing
# rows over it would fail every job in the system, so it is left to an
# operator instead, loudly.
_ROW_REFUSALS = frozenset({"22", "23", "P0", "44"})
# How soon the event feed reads again when events wait for an older
# transaction to end (no notification says when it does).
_HELD_POLL_SECONDS = 0.05
_FEED_LINGER_SECONDS = 0.05
# An event the broker refuses this many times in a row (a nack: a full queue
# with reject-publish, say) is moved to the outbox, where it is retried on
# its own, and the feed goes on past it.
_PARK_AFTER = 5
_PARKED_RETRY_SECONDS = 5.0


class PublishFailed(Exception):
    """The broker did not confirm a message (a nack, or no answer in time)."""


class Returned(PublishFailed):
    """The broker returned the message: no queue is bound for its routing key."""


class Unpublishable(Exception):
    """The broker can never accept this message as it is; retrying cannot help."""


@dataclass(slots=True)
class _Link:
    connection: AbstractConnection
    channel: AbstractChannel
    exchange: AbstractExchange
    events: AbstractExchange
    #: The event feed's own confirming channel (its events exchange is the topology's).
    feed_channel: AbstractChannel

    @property
    def closed(self) -> bool:
        return self.connection.is_closed or self.channel.is_closed or self.feed_channel.is_closed

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.connection.close()


class _Fate(enum.Enum):
    """What the broker did with one row's publish."""

    CONFIRMED = "confirmed"
    FAILED = "failed"  # nack, timeout, lost connection: transient
    RETURNED = "returned"
    UNPUBLISHABLE = "unpublishable"


@dataclass(frozen=True, slots=True)
class _Outcome:
    row: OutboxRow
    fate: _Fate
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class FeedPass:
    """What one pass of the event feed did."""

    #: Events published (or passed over as unpublishable) and behind the position now.
    published: int = 0
    #: False when another relay holds the feed.
    held_feed: bool = True
    #: A whole batch was read: read on at once.
    more: bool = False
    #: Events wait for an older transaction to end: read again soon.
    waiting: bool = False


@dataclass(slots=True)
class _Recorded:
    """What recording a batch did, reported once it committed."""

    published: int = 0
    failed: list[tuple[OutboxRow, str, str, bool]] = field(default_factory=list)
    confirmed: list[OutboxRow] = field(default_factory=list)
    #: Dispatches whose job says now that it waits for a route.
    unroutable: list[OutboxRow] = field(default_factory=list)

    def add(self, other: _Recorded) -> None:
        self.published += other.published
        self.failed += other.failed
        self.confirmed += other.confirmed
        self.unroutable += other.unroutable


def relay_pool_size(in_flight: int = 4) -> int:
    """Connections a relay's statements use at most: one for each batch in flight,
    the feed's, and one to spare."""
    return max(1, in_flight) + 2


def relay_in_flight(pool_size: int) -> int:
    """Batches a relay whose pool holds ``pool_size`` connections has them for: each
    holds one through its publish and confirm, beside the feed's and the spare."""
    return max(1, pool_size - 2)


class Relay(Lifecycle):
    """Moves due outbox rows to RabbitMQ; any number may run at once.

    ``async with Relay(...) as relay:`` (or ``await start()``, then ``await
    stop()``); :meth:`run` is a whole process's life. The sweeper is a part of
    its own (:class:`~jobplane.workers.sweeper.Sweeper`): a process that runs
    both starts each.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        database_url: str,
        amqp_url: str,
        topology: Topology,
        *,
        batch_size: int = 100,
        event_batch_size: int = 500,
        poll_seconds: float = 1.0,
        publish_timeout: float = 10.0,
        faults: FaultPoints = NO_FAULTS,
        unroutable_after: float = 300.0,
        unroutable_returns: int = 5,
        interceptors: Sequence[RelayInterceptor] = (),
        db: Database | None = None,
        in_flight: int = 4,
    ) -> None:
        """``interceptors`` see the relay's publishes and what the broker did
        (the process hands tracing's and metrics'; none: nothing is observed)."""
        self._intercept = chain_relay(interceptors)
        self._engine = engine
        # The outbox's and the feed's statements run on asyncpg (ADR-0030):
        # the caller's pool, or one of the relay's own, opened and closed with it.
        self._owns_db = db is None
        self._db = db or Database(database_url, size=relay_pool_size(in_flight))
        self._store = OutboxStore(self._db)
        self._amqp_url = amqp_url
        self._topology = topology
        self._batch_size = batch_size
        # Batches claimed and not yet recorded, at most (see _pipeline).
        self._in_flight = max(1, in_flight)
        self._poll_seconds = poll_seconds
        self._publish_timeout = publish_timeout
        self._faults = faults
        self._wakeups = Listener(database_url, OUTBOX_CHANNEL)
        self._feed = EventFeed(self._db)
        self._event_batch_size = event_batch_size
        self._event_wakeups = Listener(database_url, DOMAIN_EVENTS_CHANNEL)
        self._task: asyncio.Task[None] | None = None
        self._feed_task: asyncio.Task[None] | None = None
        self._unroutable_after = unroutable_after
        self._unroutable_returns = unroutable_returns
        self._deployment: Deployment | None = None
        self._link: _Link | None = None
        self.ownership: Ownership | None = None
        self._held: dict[uuid.UUID, float] = {}  # row id -> monotonic time it is tried again
        self.published = 0
        self.events_published = 0
        self.events_parked = 0
        # The event at the head of the feed and how many passes in a row it
        # failed; while it fails, passes publish it alone (no batch behind it
        # is published again each time).
        self._head_failures: tuple[uuid.UUID, int] | None = None
        self.failed = 0
        self.connects = 0
        self.database_errors = 0

    @property
    def connected(self) -> bool:
        """True while the relay holds an open channel to the broker."""
        return self._link is not None and not self._link.closed

    async def start(self) -> None:
        """Check the topology, then relay in the background.

        Raises :class:`TopologyMissing` (or the broker's refusal) when this
        account cannot work with the broker as it is; a broker or database
        that is down is waited for in the background instead.
        """
        await self._db.open()
        await self._wakeups.start()
        try:
            await self._event_wakeups.start()
            self._link = await self._open()
        except Exception as exc:
            if broker.broker_down(exc):
                log.warning("broker.unavailable", error=repr(exc), retry="in the background")
            elif database_transient(exc):
                log.warning("relay.db.error", error=describe_error(exc), retry="in the background")
            else:
                await self._event_wakeups.stop()
                await self._wakeups.stop()
                await self._close_db()
                raise
        self._task = asyncio.create_task(self._run(), name="jobplane-relay")
        self._feed_task = asyncio.create_task(self._run_feed(), name="jobplane-relay-events")

    async def stop(self) -> None:
        """Stop; a batch in flight is rolled back and stays due."""
        try:
            await cancel_and_wait(self._feed_task)
            await cancel_and_wait(self._task)
        finally:
            self._task = self._feed_task = None
            if self._link is not None:
                await self._link.close()
                self._link = None
            await self._event_wakeups.stop()
            await self._wakeups.stop()
            await self._close_db()

    async def _close_db(self) -> None:
        if self._owns_db:
            await self._db.close()

    async def _open(self) -> _Link:
        """Connect, check the topology and open a confirming channel."""
        if self._deployment is None:
            self._deployment = await this_deployment(self._engine)
        connection = await broker.connect(self._amqp_url)
        try:
            self.ownership = await ensure(connection, self._topology, self._deployment)
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(self._topology.exchange, ensure=False)
            events = await channel.get_exchange(self._topology.events_exchange, ensure=False)
            # The feed's own channel: its events go out in order, and its
            # batches do not wait behind the outbox's (nor these behind them).
            feed_channel = await connection.channel(publisher_confirms=True)
            # A link that closes wakes both loops: the outbox loop reopens it
            # at once, not when its wait for due rows ends.
            for closing in (connection, channel, feed_channel):
                closing.close_callbacks.add(self._link_closed)
        except BaseException:
            with contextlib.suppress(Exception):
                await connection.close()
            raise
        self.connects += 1
        log.info("relay.connected")
        return _Link(connection, channel, exchange, events, feed_channel)

    def _link_closed(self, *_: object) -> None:
        self._wakeups.wake_all()
        self._event_wakeups.wake_all()

    async def _run(self) -> None:
        delay = 0.5
        with self._wakeups.subscribe() as wakeup:
            while True:
                try:
                    if self._link is None:
                        self._link = await self._open()
                    await self._pipeline(self._link, wakeup)
                    delay = 0.5
                    log.warning("broker.unavailable", error="the channel closed", retry_in=delay)
                except asyncio.CancelledError:
                    raise
                except TopologyMissing as exc:
                    # Removed under a running relay; an operator may apply it again.
                    log.error("relay.topology.missing", error=str(exc), retry_in=delay)
                except Exception as exc:
                    if broker.broker_down(exc):
                        log.warning("broker.unavailable", error=repr(exc), retry_in=delay)
                        await self._drop_link()
                    elif database_transient(exc):
                        # The broker is fine: keep the link, wait for the database.
                        self.database_errors += 1
                        log.warning("relay.db.error", error=describe_error(exc), retry_in=delay)
                    else:
                        # A relay that stops relaying is worse than one that
                        # keeps trying: say it loudly and try again.
                        log.error(
                            "relay.error", error=describe_error(exc), retry_in=delay, exc_info=exc
                        )
                if self._link is not None and self._link.closed:
                    await self._drop_link()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _drop_link(self) -> None:
        if self._link is not None:
            await self._link.close()
            self._link = None

    async def drain_once(self) -> int:
        """Connect, publish every row due now and every settled event, disconnect.

        Returns the outbox rows taken and the events published.
        """
        link = await self._open()
        try:
            total = 0
            while (moved := await self.relay_once(link.exchange, link.events)) > 0:
                total += moved
                if moved < self._batch_size:
                    break
            while True:
                feed = await self.publish_events_once(link.feed_channel)
                total += feed.published
                if not feed.more:
                    return total
        finally:
            await link.close()

    async def _run_feed(self) -> None:
        """Publish the events table's new events while the relay runs.

        The link is the outbox loop's: it opens and reopens it; this loop
        waits while there is none.
        """
        delay = 0.5
        with self._event_wakeups.subscribe() as wakeup:
            while True:
                try:
                    link = self._link
                    if link is None or link.closed:
                        await wakeup.wait(self._poll_seconds)
                        continue
                    feed = await self.publish_events_once(link.feed_channel)
                    delay = 0.5
                    if feed.more:
                        continue
                    if feed.waiting:
                        await wakeup.wait(_HELD_POLL_SECONDS)
                    elif not feed.held_feed:
                        # Another relay publishes; take over if it goes away.
                        await wakeup.wait(self._poll_seconds)
                    else:
                        await wakeup.wait(self._poll_seconds * 5)
                    # Let a few more commits gather: one pass for many events.
                    await asyncio.sleep(_FEED_LINGER_SECONDS)
                    continue
                except asyncio.CancelledError:
                    raise
                except PublishFailed as exc:
                    log.warning("broker.publish.failed", feed="events", error=repr(exc))
                except Exception as exc:
                    if broker.broker_down(exc):
                        # The outbox loop reconnects; this one waits for it.
                        log.warning("broker.unavailable", feed="events", error=repr(exc))
                    elif database_transient(exc):
                        self.database_errors += 1
                        log.warning("relay.db.error", feed="events", error=describe_error(exc))
                    else:
                        log.error(
                            "relay.error", feed="events", error=describe_error(exc), exc_info=exc
                        )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def publish_events_once(self, channel: AbstractChannel) -> FeedPass:
        """Publish the next settled events of the feed in commit order, if this relay holds it.

        ``channel``: a confirming channel of the feed's alone. Raises
        :class:`PublishFailed` when the broker did not confirm one of them,
        after moving the position past the confirmed ones in front of it;
        the caller waits a little and calls again.
        """
        raw = await channel.get_underlay_channel()
        if not isinstance(raw, aiormq.Channel):  # for basic_publish(wait=False)
            raise TypeError(f"an aiormq channel was expected, not {type(raw).__name__}")
        exchange = self._topology.events_exchange
        failure: BaseException | None = None
        parked = 0
        limit = 1 if self._head_failures is not None else self._event_batch_size
        async with self._feed.claim(limit) as batch:
            if batch is None:
                return FeedPass(held_feed=False)
            if not batch.events:
                return FeedPass(waiting=batch.held)
            # In order on one channel: the broker keeps a channel's order in
            # every queue. One deadline for the batch: a batch that misses
            # it is published again whole.
            try:
                async with asyncio.timeout(self._publish_timeout):
                    results = await asyncio.gather(
                        *(self._publish_feed_event(raw, exchange, e) for e in batch.events),
                        return_exceptions=True,
                    )
            except TimeoutError as exc:
                raise PublishFailed(
                    f"event feed: not confirmed within {self._publish_timeout:g}s"
                ) from exc
            done = 0
            for event, result in zip(batch.events, results, strict=True):
                if isinstance(result, Unpublishable):
                    self.failed += 1
                    log.error(
                        "relay.event.failed",
                        event_id=str(event.stored.event.event_id),
                        event_type=event.stored.event.event_type,
                        error=str(result),
                        hint="AMQP cannot carry it; it stays in the events table",
                    )
                elif result is not None:
                    if not isinstance(result, Exception):
                        raise result  # cancelled: the position stays
                    event_id = event.stored.event.event_id
                    before = self._head_failures
                    failures = before[1] + 1 if before and before[0] == event_id else 1
                    if failures < _PARK_AFTER:
                        self._head_failures = (event_id, failures)
                        failure = result
                        break
                    await batch.park(
                        event,
                        encode(event.stored.event),
                        f"the broker refused it {failures} times in a row: {result!r}",
                        delay=_PARKED_RETRY_SECONDS,
                    )
                    parked += 1
                    log.warning(
                        "relay.event.parked",
                        event_id=str(event_id),
                        event_type=event.stored.event.event_type,
                        failures=failures,
                        error=repr(result),
                        hint="moved to the outbox, retried there on its own",
                    )
                done += 1
            if done:
                await batch.advance(batch.events[done - 1].stored.position)
        if failure is None:
            self._head_failures = None
        self.events_published += done - parked
        intercept = self._intercept
        if intercept is not None:
            intercept.relayed("event_feed", "confirmed", done - parked)
        self.events_parked += parked
        if failure is not None:
            raise PublishFailed(f"event feed: {failure!r}") from failure
        return FeedPass(
            published=done,
            more=len(batch.events) >= limit,
            waiting=batch.held,
        )

    async def _publish_feed_event(
        self, channel: aiormq.Channel, exchange: str, event: FeedEvent
    ) -> None:
        """Publish one event of the feed: its envelope, the properties docs/events.md lists."""
        stored = event.stored.event
        try:
            body = encode(stored)
        except EventError as exc:
            raise Unpublishable(f"its body is not an event: {_short(exc)}") from exc
        await self._send_event(
            channel,
            exchange,
            stored.event_type,
            stored,
            body,
            traceparent=event.traceparent,
            tracestate=event.tracestate,
        )

    async def _send_event(
        self,
        channel: aiormq.Channel,
        exchange: str,
        routing_key: str,
        event: Event,
        body: bytes,
        *,
        traceparent: str | None,
        tracestate: str | None,
    ) -> None:
        """Publish ``body`` (``event``'s envelope) with ``routing_key``; wait for the confirm.

        Straight through aiormq, not waiting for the frames to be written:
        events are many small messages, and aio-pika's message and exchange
        layers cost a fifth of each. Not mandatory: with no queue bound the
        broker drops the event and confirms it, and that is a publish.
        """
        properties = spec_properties(
            amqp_properties(event, traceparent=traceparent, tracestate=tracestate)
        )
        if not _surely_publishable(event, routing_key, body, traceparent, tracestate):
            check_publishable(
                body, properties, exchange, routing_key, mandatory=False, max_body=MAX_EVENT_BYTES
            )
        try:
            confirmation = await channel.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=False,
                wait=False,
            )
        except (TypeError, ValueError, pamqp.exceptions.PAMQPException) as exc:
            raise Unpublishable(str(exc)) from exc
        if isinstance(confirmation, aiormq.spec.Basic.Ack):
            # Mid-batch: some events of the batch confirmed, others in
            # flight, none recorded yet.
            self._faults.hit("relay.event.confirmed")
            return
        raise PublishFailed(f"not confirmed: {type(confirmation).__name__}")

    async def _idle_seconds(self) -> float:
        if self._held:
            # A held row is due for ever: it would make every wait end at once.
            # New rows still wake the relay by notification.
            return self._poll_seconds
        due = await self._store.seconds_until_due()
        if due is None:
            return self._poll_seconds * 5
        return max(0.01, min(due, self._poll_seconds))

    async def _pipeline(self, link: _Link, wakeup: Subscription) -> None:
        """Relay batches while the link is open, up to ``in_flight`` of them at once.

        A batch is claimed while the ones before it are still being published
        and confirmed (their rows are locked, so the claim skips them): at
        once when the batch before came back full (more rows are due), else
        as soon as new rows are committed (a notification) or the next row
        falls due. A batch that failed ends the pipeline with its error.
        """
        running: set[asyncio.Task[int]] = set()

        def reap() -> None:
            for task in [t for t in running if t.done()]:
                running.discard(task)
                task.result()

        try:
            while not link.closed:
                reap()
                if len(running) >= self._in_flight:
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    continue
                # Before the claim's snapshot: a row committed after it wakes the next.
                wakeup.clear()
                claimed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
                task = asyncio.create_task(self._relay_batch(link.exchange, link.events, claimed))
                running.add(task)
                # Until its rows are claimed (or it ended: no rows, or an error).
                await asyncio.wait({task, claimed}, return_when=asyncio.FIRST_COMPLETED)
                if claimed.done() and claimed.result() >= self._batch_size:
                    continue
                if claimed.done() and claimed.result() == 0:
                    # Nothing was due: let this empty batch end, so that only
                    # batches with rows in flight wake the wait below.
                    await asyncio.wait({task})
                reap()
                if not running:
                    await wakeup.wait(await self._idle_seconds())
                    continue
                # Rows in flight count as due: wait for new ones, or for a batch to end.
                woken = asyncio.ensure_future(wakeup.wait(self._poll_seconds))
                try:
                    await asyncio.wait({woken, *running}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.wait(running)

    async def relay_once(self, exchange: AbstractExchange, events: AbstractExchange) -> int:
        """Publish one batch of due rows; returns how many rows it took.

        Job dispatches go to ``exchange``, events to ``events`` (or to the
        exchange their row names).
        """
        return await self._relay_batch(exchange, events, None)

    async def _relay_batch(
        self,
        exchange: AbstractExchange,
        events: AbstractExchange,
        claimed: asyncio.Future[int] | None,
    ) -> int:
        """:meth:`relay_once`; ``claimed`` learns how many rows it took as soon as it knows."""
        outcomes: list[_Outcome] | None = None
        began = time.monotonic()
        try:
            async with self._store.claim(self._batch_size, skip=self._holding()) as batch:
                if claimed is not None and not claimed.done():
                    claimed.set_result(len(batch.rows))
                if not batch.rows:
                    return 0
                started = time.monotonic()
                outcomes = await self._publish_all(exchange, events, batch.rows)
                if self._intercept is not None:
                    self._intercept.confirmed(time.monotonic() - started)
                self._faults.hit("relay.after_confirm")
                recorded = await self._record(batch, outcomes)
        except DBAPIError as exc:
            if outcomes is None or database_transient(exc):
                raise
            # Refused for what a statement is, not for the database's state:
            # claimed again, the same rows would be refused again for ever.
            log.error("relay.batch.refused", error=describe_error(exc), rows=len(outcomes))
            recorded = await self._record_each(outcomes)
        else:
            # Counted once the record committed: a batch rolled back is
            # published again, and counted then.
            self._count(outcomes)
            self._report(recorded)
        if self._intercept is not None:
            self._intercept.batched(time.monotonic() - began)
        log.debug(
            "relay.batch",
            published=recorded.published,
            failed=len(recorded.failed),
            rows=len(outcomes),
        )
        return len(outcomes)

    async def _publish_all(
        self, exchange: AbstractExchange, events: AbstractExchange, rows: list[OutboxRow]
    ) -> list[_Outcome]:
        results = await asyncio.gather(
            *(self._publish_row(exchange, events, row) for row in rows),
            return_exceptions=True,
        )
        outcomes: list[_Outcome] = []
        for row, result in zip(rows, results, strict=True):
            if result is None:
                outcomes.append(_Outcome(row, _Fate.CONFIRMED))
                continue
            if not isinstance(result, Exception):
                raise result  # cancelled: the batch rolls back and stays due
            if isinstance(result, Unpublishable):
                fate = _Fate.UNPUBLISHABLE
            else:
                fate = _Fate.RETURNED if isinstance(result, Returned) else _Fate.FAILED
                log.warning("broker.publish.failed", event_id=str(row.id), error=repr(result))
            outcomes.append(_Outcome(row, fate, result))
        return outcomes

    def _count(self, outcomes: list[_Outcome]) -> None:
        intercept = self._intercept
        if intercept is None:
            return
        for outcome in outcomes:
            intercept.relayed(outcome.row.kind.value, outcome.fate.value, 1)

    async def _record(self, batch: OutboxBatch, outcomes: list[_Outcome]) -> _Recorded:
        """Write what the broker did with each row, in ``batch``'s transaction."""
        by_fate: dict[_Fate, list[_Outcome]] = {fate: [] for fate in _Fate}
        for outcome in outcomes:
            by_fate[outcome.fate].append(outcome)
        confirmed = by_fate[_Fate.CONFIRMED]
        await batch.mark_published([o.row.id for o in confirmed])
        if retry := by_fate[_Fate.FAILED]:
            await batch.mark_retry([o.row.id for o in retry], repr(retry[0].error))
        give_up = [
            (o.row, DISPATCH_FAILED, f"the broker cannot accept it: {o.error}")
            for o in by_fate[_Fate.UNPUBLISHABLE]
        ]
        noted: list[OutboxRow] = []
        if returned := by_fate[_Fate.RETURNED]:
            unroutable = await batch.mark_returned(
                [o.row.id for o in returned],
                repr(returned[0].error),
                give_up_after=self._unroutable_after,
                give_up_returns=self._unroutable_returns,
            )
            give_up += [
                (o.row, JOB_TYPE_UNROUTABLE, self._unroutable_message(o.row))
                for o in returned
                if o.row.id in unroutable
            ]
            # Until then the job says why it waits (GetJob, the CLI, the
            # dashboard), not only this relay's log.
            noted = await batch.note_waiting(
                [
                    (o.row, WaitingCode.UNROUTABLE, self._waiting_message(o.row))
                    for o in returned
                    if o.row.id not in unroutable
                ]
            )
        # Published at last (the topology applied): the reason is gone. Only
        # a row that failed before can have left one.
        await batch.note_waiting(
            [(o.row, "", "") for o in confirmed if o.row.retried],
            clears=WaitingCode.UNROUTABLE,
        )
        recorded = _Recorded(
            published=len(confirmed), confirmed=[o.row for o in confirmed], unroutable=noted
        )
        for row, code, message in give_up:
            result = await batch.fail(row, code, message)
            if result is GiveUp.BUSY:
                # Its job is being changed right now (a cancel, most likely):
                # the row stays due and the next pass decides.
                await batch.defer([row.id], message)
            else:
                recorded.failed.append((row, code, message, result is GiveUp.JOB_FAILED))
        return recorded

    async def _record_each(self, outcomes: list[_Outcome]) -> _Recorded:
        """Record each row on its own, and settle the ones the database refuses.

        Each row's record is reported as soon as it commits, so what was done
        is counted even when the database goes away half-way.
        """
        total = _Recorded()
        unsettled: DBAPIError | None = None
        for outcome in outcomes:
            try:
                async with self._store.claim_one(outcome.row.id) as batch:
                    # An empty batch: taken or settled by another relay meanwhile.
                    recorded = await self._record(batch, [outcome]) if batch.rows else _Recorded()
            except DBAPIError as exc:
                if database_transient(exc):
                    raise
                if not _refuses_the_row(exc):
                    # The row stays due; the others still move. Raised below.
                    unsettled = unsettled or exc
                    continue
                recorded = await self._settle_refused(outcome.row, exc)
            self._count([outcome])
            self._report(recorded)
            total.add(recorded)
        if unsettled is not None:
            raise unsettled
        return total

    async def _settle_refused(self, row: OutboxRow, refusal: DBAPIError) -> _Recorded:
        """A row whose outcome the database refuses: fail it (and its job if it can).

        Held back from this relay's claims when the database refuses even that.
        """
        message = f"the database refused to record its dispatch: {describe_error(refusal)}"
        try:
            async with self._store.claim_one(row.id) as batch:
                if not batch.rows:
                    return _Recorded()
                result = await batch.fail(row, DISPATCH_FAILED, message)
                if result is GiveUp.BUSY:
                    return _Recorded()  # still due; the next pass tries again
                return _Recorded(
                    failed=[(row, DISPATCH_FAILED, message, result is GiveUp.JOB_FAILED)]
                )
        except DBAPIError as exc:
            if database_transient(exc):
                raise
            job_refusal = exc
        try:
            async with self._store.claim_one(row.id) as batch:
                if not batch.rows:
                    return _Recorded()
                await batch.mark_failed(row, message)
        except DBAPIError as exc:
            if database_transient(exc):
                raise
            self._held[row.id] = time.monotonic() + _HOLD_SECONDS
            log.error(
                "relay.dispatch.held",
                **_subject(row, self._intercept),
                error=describe_error(exc),
                retry_in=_HOLD_SECONDS,
                hint="the database refuses every change to this outbox row; an operator must look",
            )
            return _Recorded()
        log.error(
            _failed_event(row),
            **_subject(row, self._intercept),
            code=DISPATCH_FAILED,
            error=message,
            job_failed=False,
            job_error=describe_error(job_refusal),
            hint="the job could not be failed and stays QUEUED; an operator must look",
        )
        self.failed += 1
        return _Recorded()

    def _holding(self) -> list[uuid.UUID]:
        now = time.monotonic()
        for row_id in [i for i, until in self._held.items() if until <= now]:
            del self._held[row_id]
        return list(self._held)

    def _report(self, recorded: _Recorded) -> None:
        self.published += recorded.published
        if recorded.confirmed and log.is_enabled_for(logging.INFO):
            for row in recorded.confirmed:
                if row.job_id is not None:
                    log.info("job.dispatched", **_dispatched(row, self._topology, self._intercept))
        for row in recorded.unroutable:
            log.warning(
                "job.waiting",
                **_subject(row, self._intercept),
                code=WaitingCode.UNROUTABLE.value,
                type=row.routing_key,
                exchange=row.exchange or self._topology.exchange,
            )
        for row, code, message, job_failed in recorded.failed:
            self.failed += 1
            log.error(
                _failed_event(row),
                **_subject(row, self._intercept),
                code=code,
                error=message,
                job_failed=job_failed,
            )

    def _unroutable_message(self, row: OutboxRow) -> str:
        return (
            f"no queue on the broker takes job type {row.routing_key!r}: the dispatch "
            f"came back unroutable {self._unroutable_returns} times in a row over at least "
            f"{self._unroutable_after:g}s (the broker's bindings differ from the topology; "
            "run `jobplane topology apply`)"
        )

    def _waiting_message(self, row: OutboxRow) -> str:
        exchange = row.exchange or self._topology.exchange
        return (
            f"the broker returned its dispatch: no queue is bound for routing key "
            f"{row.routing_key!r} (its job type) on exchange {exchange!r}: apply a topology "
            "that routes it (`jobplane topology apply`). Retried until then; the job fails "
            f"with {JOB_TYPE_UNROUTABLE} if it still comes back after "
            f"{self._unroutable_returns} returns over {self._unroutable_after:g}s"
        )

    async def _publish(self, exchange: AbstractExchange, row: OutboxRow) -> None:
        intercept = self._intercept
        if intercept is None:
            return await self._publish_dispatch(exchange, row, NO_HEADERS)
        with intercept.publish(
            row.headers,
            exchange=exchange.name,
            routing_key=row.routing_key,
            message_id=row.id,
            job_id=row.job_id,
            tenant_id=row.tenant_id,
        ) as trace_headers:
            return await self._publish_dispatch(exchange, row, trace_headers)

    async def _publish_dispatch(
        self, exchange: AbstractExchange, row: OutboxRow, trace_headers: Mapping[str, str]
    ) -> None:
        deployment = self._deployment.id if self._deployment is not None else None
        envelope = replace(row.envelope, deployment=deployment)
        body = envelope.encode()
        properties = dispatch_properties(envelope, trace_headers)
        if not _fits_at_once(envelope.job_type, body, properties, max_body=MAX_ENVELOPE_BYTES):
            check_publishable(body, properties, exchange.name, envelope.job_type, mandatory=True)
        # Straight through aiormq, as the events are: aio-pika's message and
        # exchange layers cost a seventh of a dispatch, for nothing it adds here.
        channel = await _underlay(exchange)
        try:
            async with asyncio.timeout(self._publish_timeout):
                confirmation = await channel.basic_publish(
                    body,
                    exchange=exchange.name,
                    routing_key=envelope.job_type,
                    properties=properties,
                    mandatory=True,
                    wait=False,
                )
        except aiormq.exceptions.PublishError as exc:  # a return, on a raising channel
            raise Returned("not confirmed: returned unroutable") from exc
        except (TypeError, ValueError, pamqp.exceptions.PAMQPException) as exc:
            # Encoding refused it after all (check_publishable missed a case).
            raise Unpublishable(str(exc)) from exc
        # A returned (unroutable) message resolves the confirm too, carrying the
        # message instead of a Basic.Ack: that is not a publish.
        if isinstance(confirmation, aiormq.spec.Basic.Ack):
            return
        if isinstance(confirmation, aiormq.abc.DeliveredMessage):
            raise Returned("not confirmed: returned unroutable")
        raise PublishFailed(f"not confirmed: {type(confirmation).__name__}")

    async def _publish_row(
        self, jobs: AbstractExchange, events: AbstractExchange, row: OutboxRow
    ) -> None:
        default = events if row.kind is OutboxKind.EVENT else jobs
        if row.exchange is None or row.exchange == default.name:
            target = default
        elif row.exchange in (jobs.name, events.name):
            target = jobs if row.exchange == jobs.name else events
        else:
            # Only exchanges checked at start: a publish to a missing one
            # would close the channel the whole batch shares, again and again.
            raise Unpublishable(f"its exchange {row.exchange!r} is not one of the topology's")
        if row.kind is OutboxKind.EVENT:
            await self._publish_event(target, row)
        else:
            await self._publish(target, row)

    async def _publish_event(self, events: AbstractExchange, row: OutboxRow) -> None:
        """Publish a domain event row: its body as it is, the properties docs/events.md lists.

        The properties come from the body (the truth) through the same
        function consumers' tests use, so the two never drift apart.
        """
        if row.body is None:
            raise Unpublishable("an event row without a body")
        try:
            event = decode(row.body)
        except EventError as exc:
            raise Unpublishable(f"its body is not an event: {_short(exc)}") from exc
        channel = await _underlay(events)
        async with asyncio.timeout(self._publish_timeout):
            await self._send_event(
                channel,
                events.name,
                row.routing_key,
                event,
                row.body,
                traceparent=row.headers.get(TRACEPARENT_HEADER),
                tracestate=row.headers.get(TRACESTATE_HEADER),
            )


async def _underlay(exchange: AbstractExchange) -> aiormq.Channel:
    """The aiormq channel under ``exchange``'s aio-pika channel (for basic_publish(wait=False))."""
    if not isinstance(exchange, aio_pika.Exchange):
        raise TypeError(f"an aio-pika exchange was expected, not {type(exchange).__name__}")
    channel = await exchange.channel.get_underlay_channel()
    if not isinstance(channel, aiormq.Channel):
        raise TypeError(f"an aiormq channel was expected, not {type(channel).__name__}")
    return channel


def dispatch_properties(envelope: Envelope, trace_headers: Mapping[str, str]) -> Properties:
    """A job dispatch's AMQP properties (docs/workers.md): byte for byte what
    ``aio_pika.Message`` made of them when the relay published through it (a
    unit test compares them)."""
    return Properties(
        content_type="application/json",
        headers={
            "job_id": str(envelope.job_id),
            **({DEPLOYMENT_HEADER: envelope.deployment} if envelope.deployment else {}),
            **trace_headers,
        },
        delivery_mode=int(aio_pika.DeliveryMode.PERSISTENT),
        priority=0,
        correlation_id=envelope.correlation_id or None,
        message_id=str(envelope.event_id),
        message_type=AMQP_TYPE,
    )


def _fits_at_once(
    routing_key: str, body: bytes, properties: aiormq.spec.Basic.Properties, *, max_body: int
) -> bool:
    """True when a message is far within every AMQP limit, without encoding a frame:
    short strings of at most 63 characters (252 bytes of UTF-8 at most), and all
    its strings at four bytes a character beside the fixed properties fit the
    smallest frame. Anything else takes :func:`check_publishable`."""
    headers: dict[str, str] = {}
    for key, value in (properties.headers or {}).items():
        if not isinstance(value, str):
            return False
        headers[key] = value
    shorts = (routing_key, properties.correlation_id or "", properties.message_id or "")
    strings = sum(map(len, shorts)) + sum(len(k) + len(v) for k, v in headers.items())
    return (
        max(map(len, shorts)) <= 63
        and 4 * strings + 512 <= _MIN_FRAME_MAX
        and len(body) <= max_body
    )


def spec_properties(properties: dict[str, Any]) -> aiormq.spec.Basic.Properties:
    """``aio_pika.Message(body, **properties).properties``, built directly.

    ``properties`` as :func:`jobplane.events.envelope.amqp_properties` makes
    them; the result is what aio-pika would send (a unit test compares them).
    """
    return Properties(
        app_id=properties["app_id"],
        content_type=properties["content_type"],
        correlation_id=properties["correlation_id"],
        delivery_mode=int(properties["delivery_mode"]),
        headers=properties["headers"],
        message_id=properties["message_id"],
        message_type=properties["type"],
        priority=0,
        timestamp=properties["timestamp"],
    )


def _surely_publishable(
    event: Event,
    routing_key: str,
    body: bytes,
    traceparent: str | None,
    tracestate: str | None,
) -> bool:
    """True when ``event`` is far within every AMQP limit, without encoding a frame.

    Short strings of at most 63 characters are at most 252 bytes of UTF-8, and
    all the strings at four bytes a character plus the fixed properties fit
    the smallest frame. Anything else takes :func:`check_publishable`.
    """
    short = max(
        len(routing_key), len(event.event_type), len(event.correlation_id), len(str(event.event_id))
    )
    strings = (
        len(routing_key)
        + len(event.event_type)
        + len(event.correlation_id)
        + len(event.causation_id or "")
        + len(traceparent or "")
        + len(tracestate or "")
    )
    return short <= 63 and 4 * strings + 512 <= _MIN_FRAME_MAX and len(body) <= MAX_EVENT_BYTES


def _dispatched(
    row: OutboxRow, topology: Topology, intercept: RelayInterceptor | None
) -> dict[str, str]:
    """The fields of a ``job.dispatched`` line."""
    queue = topology.route(row.routing_key)
    fields = {
        "job": job_name(row.job_id) if row.job_id is not None else "",
        "event_id": str(row.id),
        "tenant_id": str(row.tenant_id),
        "correlation_id": fingerprint(row.correlation_id),
        "type": row.routing_key,
        "queue": queue.name if queue is not None else "",
        "exchange": row.exchange or topology.exchange,
    }
    return _with_trace(fields, row, intercept)


def _with_trace(
    fields: dict[str, str], row: OutboxRow, intercept: RelayInterceptor | None
) -> dict[str, str]:
    """``fields`` and, with tracing handed over, the ``trace_id`` of the row's
    context: the line is logged after the publish span ended (or with none, for
    a trace not sampled), so the log's own processor finds no span to name."""
    if intercept is not None:
        trace_id = intercept.trace_id(row.headers)
        if trace_id is not None:
            fields["trace_id"] = trace_id
    return fields


def _failed_event(row: OutboxRow) -> str:
    """The log event of giving up on ``row``."""
    return "relay.event.failed" if row.kind is OutboxKind.EVENT else "relay.dispatch.failed"


def _subject(row: OutboxRow, intercept: RelayInterceptor | None) -> dict[str, str]:
    """What a log line about ``row`` names: its job, or its event type."""
    if row.job_id is not None:
        fields = {"job": job_name(row.job_id), "event_id": str(row.id)}
        return _with_trace(fields, row, intercept)
    return {"outbox_id": str(row.id), "kind": row.kind.value, "event_type": row.routing_key}


def check_publishable(
    body: bytes,
    properties: aiormq.spec.Basic.Properties,
    exchange: str,
    routing_key: str,
    *,
    mandatory: bool = True,
    max_body: int = MAX_ENVELOPE_BYTES,
) -> None:
    """Raise :class:`Unpublishable` unless AMQP can carry ``body`` with ``properties``.

    Encodes the method and header frames the way the client will, without
    sending them: a string over 255 bytes (correlation id, routing key), a
    header that cannot be encoded, a header frame over the smallest frame
    size, a body over ``max_body``. Checked before the publish, so one bad
    row never reaches (or closes) the channel its batch shares.
    """
    if len(body) > max_body:
        raise Unpublishable(f"body of {len(body)} bytes exceeds {max_body}")
    for name, value in (
        ("routing key (job type)", routing_key),
        ("correlation id", properties.correlation_id),
    ):
        size = len((value or "").encode("utf-8", "surrogatepass"))
        if size > _SHORT_STRING:
            raise Unpublishable(f"its {name} is {size} bytes; AMQP carries at most {_SHORT_STRING}")
    try:
        pamqp.frame.marshal(
            aiormq.spec.Basic.Publish(
                exchange=exchange, routing_key=routing_key, mandatory=mandatory
            ),
            1,
        )
        header = pamqp.frame.marshal(pamqp.header.ContentHeader(0, len(body), properties), 1)
    except (TypeError, ValueError, pamqp.exceptions.PAMQPException) as exc:
        raise Unpublishable(_short(exc)) from exc
    if len(header) > _MIN_FRAME_MAX:
        raise Unpublishable(f"message properties of {len(header)} bytes exceed one frame")


def _refuses_the_row(exc: DBAPIError) -> bool:
    """True when Postgres refused ``exc``'s statement for the values of its row."""
    current: BaseException | None = exc.orig
    while current is not None:
        state = getattr(current, "sqlstate", None) or getattr(current, "pgcode", None)
        if isinstance(state, str) and state:
            return state[:2] in _ROW_REFUSALS
        current = current.__cause__
    return False


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
