"""The relay's outbox loop: claim due rows in batches, publish them confirmed, record.

Up to ``in_flight`` batches at once: a batch is claimed while the ones
before it are still being published and confirmed. What the broker did
with each row is recorded by :class:`~jobplane.workers.relay_record.OutboxRecording`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

import aiormq
import structlog
from aio_pika.abc import AbstractExchange
from sqlalchemy.exc import DBAPIError

from jobplane.events.envelope import TRACEPARENT_HEADER, TRACESTATE_HEADER, EventError, decode
from jobplane.faults import FaultPoints
from jobplane.logs import describe_error
from jobplane.store.deployment import Deployment
from jobplane.store.down import database_transient
from jobplane.store.fair import FairClaim, FairRound, FairSlot
from jobplane.store.listen import Subscription
from jobplane.store.outbox import OutboxKind, OutboxRow
from jobplane.workers.interceptors import NO_HEADERS
from jobplane.workers.relay_credit import CreditBook
from jobplane.workers.relay_messages import (
    Returned,
    Unpublishable,
    publish_dispatch,
    send_event,
    short_error,
    underlay,
)
from jobplane.workers.relay_record import Fate, OutboxRecording, RowOutcome

if TYPE_CHECKING:
    from jobplane.workers.relay_link import Link

log = structlog.get_logger("jobplane.relay")

#: Batches in a row whose every publish the broker nacked before the link is
#: renewed (``OutboxDispatch._renew``).
RENEW_AFTER_NACKED_BATCHES = 3


class OutboxDispatch(OutboxRecording):
    """Moves due outbox rows to the broker, batch by batch, and records what it did."""

    #: Batches in a row whose every publish was nacked (reset by any other batch).
    nacked_batches: int = 0

    # Set up by the relay.
    _batch_size: int
    #: Batches claimed and not yet recorded, at most (see _pipeline).
    _in_flight: int
    _poll_seconds: float
    _publish_timeout: float
    _faults: FaultPoints
    _deployment: Deployment | None
    credit: CreditBook | None
    _round: FairRound

    async def _idle_seconds(self) -> float:
        if self._held:
            # A held row is due for ever: it would make every wait end at once.
            # New rows still wake the relay by notification.
            return self._poll_seconds
        due = await self._store.seconds_until_due()
        if due is None:
            return self._poll_seconds * 5
        wait = max(0.01, min(due, self._poll_seconds))
        if self.credit is not None and self.credit.starved:
            # Due dispatches wait for their queue's credit: it comes back as
            # the consumers take messages, which no notification says.
            wait = max(wait, self.credit.settings.refresh_seconds)
        return wait

    async def _fair_claim(self) -> FairClaim | None:
        """The credits and rounds of the next claim (None: fair dispatch is off)."""
        if self.credit is None:
            return None
        await self.credit.refresh()
        return FairClaim(self._round, self.credit.credits())

    async def _pipeline(self, link: Link, wakeup: Subscription) -> None:
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
            while not link.closed and self.nacked_batches < RENEW_AFTER_NACKED_BATCHES:
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
                    # Rows committed since the claim's snapshot are claimed at
                    # once: no statement to learn when the next falls due.
                    if not wakeup.woken:
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
        if self.nacked_batches >= RENEW_AFTER_NACKED_BATCHES:
            await self._renew(link)

    async def _renew(self, link: Link) -> None:
        """Close ``link`` after batches the broker nacked whole; the relay opens a new one.

        RabbitMQ 3.10 nacks every later publish of a channel to a quorum queue
        when the channel first published to it while the queue had no leader
        (just after its leader's node was lost); a new channel is not stuck
        (ADR-0049). A queue that refuses for another reason (full, with
        reject-publish) costs a reconnect every few batches, nothing more.
        """
        log.warning("relay.link.renewed", nacked_batches=self.nacked_batches)
        self.nacked_batches = 0
        await link.close()

    def _note_nacks(self, outcomes: list[RowOutcome]) -> None:
        """Count batches whose every publish the broker nacked, in a row."""
        nacked = bool(outcomes) and all(
            o.fate is Fate.FAILED and isinstance(o.error, aiormq.exceptions.DeliveryError)
            for o in outcomes
        )
        self.nacked_batches = self.nacked_batches + 1 if nacked else 0

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
        outcomes: list[RowOutcome] | None = None
        began = time.monotonic()
        debited: list[FairSlot] = []
        try:
            fair = await self._fair_claim()
            async with self._store.claim(
                self._batch_size, skip=self._holding(), fair=fair
            ) as batch:
                if fair is not None and self.credit is not None:
                    # Before the next batch's claim (the claimed future lets it start).
                    self._round.served(batch.slots)
                    self.credit.debit(fair.credits, batch.slots)
                    debited = batch.slots
                if claimed is not None and not claimed.done():
                    claimed.set_result(len(batch.rows))
                if not batch.rows:
                    return 0
                started = time.monotonic()
                try:
                    outcomes = await self._publish_all(exchange, events, batch.rows)
                finally:
                    if debited and self.credit is not None:
                        self.credit.landed(debited, _confirmed_queues(outcomes))
                        debited = []
                self._note_nacks(outcomes)
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
    ) -> list[RowOutcome]:
        results = await asyncio.gather(
            *(self._publish_row(exchange, events, row) for row in rows),
            return_exceptions=True,
        )
        outcomes: list[RowOutcome] = []
        for row, result in zip(rows, results, strict=True):
            if result is None:
                outcomes.append(RowOutcome(row, Fate.CONFIRMED))
                continue
            if not isinstance(result, Exception):
                raise result  # cancelled: the batch rolls back and stays due
            if isinstance(result, Unpublishable):
                fate = Fate.UNPUBLISHABLE
            else:
                fate = Fate.RETURNED if isinstance(result, Returned) else Fate.FAILED
                log.warning("broker.publish.failed", event_id=str(row.id), error=repr(result))
            outcomes.append(RowOutcome(row, fate, result))
        return outcomes

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
        await publish_dispatch(exchange, envelope, trace_headers, timeout=self._publish_timeout)

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
            raise Unpublishable(f"its body is not an event: {short_error(exc)}") from exc
        channel = await underlay(events)
        async with asyncio.timeout(self._publish_timeout):
            await send_event(
                channel,
                events.name,
                row.routing_key,
                event,
                row.body,
                traceparent=row.headers.get(TRACEPARENT_HEADER),
                tracestate=row.headers.get(TRACESTATE_HEADER),
                faults=self._faults,
            )


def _confirmed_queues(outcomes: list[RowOutcome] | None) -> list[str]:
    """The queue of each fair dispatch of ``outcomes`` the broker confirmed."""
    if outcomes is None:
        return []
    return [o.row.queue for o in outcomes if o.fate is Fate.CONFIRMED and o.row.queue]
