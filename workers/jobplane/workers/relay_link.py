"""The relay's link to the broker: one connection, its confirming channels, and the
outbox loop that reopens it, backing off while the broker or the database is down.

The link is closed only when the broker is down or a channel is gone. A
database that is down is waited out with the link kept open: a reconnect
would re-run the whole topology check for nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import broker
from jobplane.logs import describe_error
from jobplane.store.deployment import this_deployment
from jobplane.store.down import database_transient
from jobplane.store.listen import Listener
from jobplane.topology import Ownership, TopologyMissing, ensure
from jobplane.workers.relay_credit import CreditBook
from jobplane.workers.relay_outbox import OutboxDispatch

log = structlog.get_logger("jobplane.relay")


@dataclass(slots=True)
class Link:
    """One connection to the broker and the relay's confirming channels on it."""

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


class BrokerLink(OutboxDispatch):
    """Opens the relay's link and runs the outbox loop on it, reopening it when it closes."""

    # Set up by the relay.
    _engine: AsyncEngine
    _amqp_url: str
    _wakeups: Listener
    _event_wakeups: Listener
    _link: Link | None
    ownership: Ownership | None
    connects: int
    database_errors: int
    credit: CreditBook | None

    async def _open(self) -> Link:
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
        if self.credit is not None:
            self.credit.attach(connection)
        log.info("relay.connected")
        return Link(connection, channel, exchange, events, feed_channel)

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
