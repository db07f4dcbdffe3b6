"""The relay's event feed: publish the events table's settled events in commit order.

One relay at a time holds the feed (ADR-0016). It publishes the events after
its position on a confirming channel of the feed's own, and moves the
position past the confirmed ones in front of the first that was not: at
least once, and a job's events reach every queue in the order they happened.
An event the broker refuses again and again is parked in the outbox; one AMQP
can never carry is logged and passed over. Lifecycle events the topology does
not publish (``[events] publish_lifecycle``, ADR-0052) are never read here:
the position moves past them with the rest.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import aiormq
import structlog
from aio_pika.abc import AbstractChannel

from jobplane import broker
from jobplane.events.envelope import EventError, encode
from jobplane.faults import FaultPoints
from jobplane.logs import describe_error
from jobplane.store.down import database_transient
from jobplane.store.event_feed import EventFeed, FeedBatch, FeedEvent
from jobplane.store.listen import Listener
from jobplane.topology import Topology
from jobplane.workers.interceptors import RelayInterceptor
from jobplane.workers.relay_link import Link
from jobplane.workers.relay_messages import PublishFailed, Unpublishable, send_event, short_error

log = structlog.get_logger("jobplane.relay")

# How soon the event feed reads again when events wait for an older
# transaction to end (no notification says when it does).
_HELD_POLL_SECONDS = 0.05
_FEED_LINGER_SECONDS = 0.05
# An event the broker refuses this many times in a row (a nack: a full queue
# with reject-publish, say) is moved to the outbox, where it is retried on
# its own, and the feed goes on past it.
_PARK_AFTER = 5
_PARKED_RETRY_SECONDS = 5.0


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


class EventFeedPublishing:
    """Publishes the event feed while the relay runs, on the link the outbox loop keeps."""

    # Set up by the relay.
    _feed: EventFeed
    _event_batch_size: int
    _event_wakeups: Listener
    _topology: Topology
    _intercept: RelayInterceptor | None
    _faults: FaultPoints
    _publish_timeout: float
    _poll_seconds: float
    _link: Link | None
    #: The event at the head of the feed and how many passes in a row it failed.
    _head_failures: tuple[uuid.UUID, int] | None
    events_published: int
    events_parked: int
    failed: int
    database_errors: int

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
        limit = 1 if self._head_failures is not None else self._event_batch_size
        async with self._feed.claim(limit) as batch:
            if batch is None:
                return FeedPass(held_feed=False)
            if not batch.events:
                # Nothing to publish: past the lifecycle events left out, if any.
                if batch.end is not None:
                    await batch.advance(batch.end)
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
            done, parked, failure = await self._settle_results(batch, results)
            full = len(batch.events) >= limit
            if done == len(batch.events) and not full and batch.end is not None:
                # Every event to publish up to the end is: past the ones left out too.
                await batch.advance(max(batch.end, batch.events[-1].stored.position))
            elif done:
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
        return FeedPass(published=done, more=full, waiting=batch.held)

    async def _settle_results(
        self, batch: FeedBatch, results: list[BaseException | None]
    ) -> tuple[int, int, BaseException | None]:
        """What the broker did with each of ``batch``'s events, in order, up to the
        first it did not confirm: the events to move past, how many of them were
        parked in the outbox, and the failure that stopped the pass (None: none)."""
        done = parked = 0
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
                    return done, parked, result
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
        return done, parked, None

    async def _publish_feed_event(
        self, channel: aiormq.Channel, exchange: str, event: FeedEvent
    ) -> None:
        """Publish one event of the feed: its envelope, the properties docs/events.md lists."""
        stored = event.stored.event
        try:
            body = encode(stored)
        except EventError as exc:
            raise Unpublishable(f"its body is not an event: {short_error(exc)}") from exc
        await send_event(
            channel,
            exchange,
            stored.event_type,
            stored,
            body,
            traceparent=event.traceparent,
            tracestate=event.tracestate,
            faults=self._faults,
        )
