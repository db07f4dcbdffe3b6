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

Here: the :class:`Relay`, what it is made of and its start and stop. Its
parts: the outbox loop (``relay_outbox``), the record of what the broker did
(``relay_record``), the broker link and its reconnects (``relay_link``), the
event feed (``relay_feed``) and the AMQP messages themselves (``relay_messages``).
Each part is a base class of :class:`Relay` holding its methods; the relay's
constructor sets up the state they share.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.lifecycle import Lifecycle
from jobplane.logs import describe_error
from jobplane.store.db import Database
from jobplane.store.deployment import Deployment
from jobplane.store.down import database_transient
from jobplane.store.event_feed import EventFeed
from jobplane.store.fair import FairRound
from jobplane.store.listen import Listener
from jobplane.store.outbox import OutboxStore
from jobplane.store.rows import DOMAIN_EVENTS_CHANNEL, OUTBOX_CHANNEL
from jobplane.tasks import cancel_and_wait
from jobplane.topology import Ownership, Topology
from jobplane.workers.fairness import FairSettings
from jobplane.workers.interceptors import RelayInterceptor, chain_relay
from jobplane.workers.relay_credit import CreditBook
from jobplane.workers.relay_feed import EventFeedPublishing, FeedPass
from jobplane.workers.relay_link import BrokerLink, Link
from jobplane.workers.relay_messages import (
    PublishFailed,
    Returned,
    Unpublishable,
    check_publishable,
    dispatch_properties,
    spec_properties,
)
from jobplane.workers.relay_record import DISPATCH_FAILED, JOB_TYPE_UNROUTABLE

__all__ = [
    "DISPATCH_FAILED",
    "JOB_TYPE_UNROUTABLE",
    "FairSettings",
    "FeedPass",
    "PublishFailed",
    "Relay",
    "Returned",
    "Unpublishable",
    "check_publishable",
    "dispatch_properties",
    "relay_in_flight",
    "relay_pool_size",
    "spec_properties",
]

log = structlog.get_logger("jobplane.relay")


def relay_pool_size(in_flight: int = 4) -> int:
    """Connections a relay's statements use at most: one for each batch in flight,
    the feed's, and one to spare."""
    return max(1, in_flight) + 2


def relay_in_flight(pool_size: int) -> int:
    """Batches a relay whose pool holds ``pool_size`` connections has them for: each
    holds one through its publish and confirm, beside the feed's and the spare."""
    return max(1, pool_size - 2)


class Relay(EventFeedPublishing, BrokerLink, Lifecycle):
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
        fair: FairSettings | None = None,
        listen_url: str | None = None,
    ) -> None:
        """``interceptors`` see the relay's publishes and what the broker did
        (the process hands tracing's and metrics'; none: nothing is observed).
        ``fair``: the flow control of job dispatches (default: on, with the
        defaults of :class:`FairSettings`; ``FairSettings(enabled=False)``: off).
        ``listen_url``: where its LISTEN connection goes (default: ``database_url``;
        past PgBouncer, ADR-0048)."""
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
        fair = fair or FairSettings()
        # Each queue's credit and round (ADR-0042); None: dispatches as they fall due.
        self.credit = CreditBook(topology, fair) if fair.enabled else None
        self._round = FairRound()
        # Batches claimed and not yet recorded, at most (see _pipeline).
        self._in_flight = max(1, in_flight)
        self._poll_seconds = poll_seconds
        self._publish_timeout = publish_timeout
        self._faults = faults
        self._wakeups = Listener(listen_url or database_url, OUTBOX_CHANNEL)
        self._feed = EventFeed(self._db)
        self._event_batch_size = event_batch_size
        self._event_wakeups = Listener(listen_url or database_url, DOMAIN_EVENTS_CHANNEL)
        self._task: asyncio.Task[None] | None = None
        self._feed_task: asyncio.Task[None] | None = None
        self._unroutable_after = unroutable_after
        self._unroutable_returns = unroutable_returns
        self._deployment: Deployment | None = None
        self._link: Link | None = None
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

    async def drain_once(self) -> int:
        """Connect, publish the rows due now and every settled event, disconnect.

        With fair dispatch on, a pass publishes each queue's dispatches up to
        its credit (ADR-0042): the rest wait for the next pass, or a running
        relay, as they would for a running relay's next claim.

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
