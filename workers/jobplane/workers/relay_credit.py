"""Credit per queue: how many more dispatches a topology queue may take now.

The relay keeps each queue's broker backlog (its ready messages) short, so
that the order of what waits is still the relay's to choose (fair across
tenants, high queues first: :mod:`jobplane.store.fair`); the rest waits in
Postgres. A queue's credit is its target backlog less what it holds:

    target = clamp(max(min_backlog, consumers * per_consumer, drain rate * horizon),
                   max=max_backlog)
    credit = target - ready messages - dispatches claimed and not in that count

``ready`` and ``consumers`` come from a passive ``queue.declare`` on a channel
of the credit's own, read at most every ``refresh_seconds`` and only when a
claim is about to run. Dispatches claimed and not yet in those counts (still
being published, or published after the read) are debited locally: a claim
may run while the batches before it are still in flight.

The drain rate is what the queue's consumers took between two reads (ready
before + published and confirmed between the reads - ready now, over the time
between), smoothed over about ``_RATE_SECONDS`` and kept over idle spells: a
fast fleet gets a backlog of ``horizon`` seconds of its work, a queue with no
consumer yet ``min_backlog``. Only confirmed publishes count as arrivals: a
dispatch claimed but not yet on the broker is not something its consumers
took, and counting it so would overstate the rate (and with it the backlog,
and how long another tenant's job waits behind it) for as long as batches are
in flight.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection

from jobplane.store.fair import FairSlot
from jobplane.topology import Topology
from jobplane.topology.parse import PRIORITIES
from jobplane.workers.fairness import FairSettings

log = structlog.get_logger("jobplane.relay")


#: The drain rate's smoothing: a reading counts in proportion to the time it
#: covers, up to this many seconds (an exponential moving average in time).
_RATE_SECONDS = 1.0


@dataclass(slots=True)
class QueueCredit:
    """One queue's counts, as last read, and what was claimed and published since."""

    name: str
    #: Its priority's place: 0 high, 1 normal, 2 low (claims give lower ranks first).
    rank: int
    target: int
    ready: int = 0
    consumers: int = 0
    #: Dispatches claimed for it, ever (less those whose batch was never published).
    claimed: int = 0
    #: Of those, how many were published (confirmed), ever.
    published: int = 0
    #: ``published`` when the counts were read: later ones are not in ``ready``.
    published_at_read: int = 0
    #: Messages its consumers take a second, smoothed.
    rate: float = 0.0
    read_at: float = -math.inf

    @property
    def outstanding(self) -> int:
        """Claimed dispatches not in the last read's ``ready``: in flight or published since."""
        return self.claimed - self.published_at_read

    @property
    def credit(self) -> int:
        return max(0, self.target - self.ready - self.outstanding)


class CreditBook:
    """The credit of every queue of a relay's topology."""

    def __init__(self, topology: Topology, settings: FairSettings) -> None:
        self.settings = settings
        self.queues = {
            q.name: QueueCredit(q.name, PRIORITIES.index(q.priority), settings.min_backlog)
            for q in topology.queues
        }
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._lock = asyncio.Lock()
        #: The last claim used up some queue's credit: more may be due there.
        self.starved = False

    def attach(self, connection: AbstractConnection) -> None:
        """Read the counts over ``connection`` (the relay's link) from now on."""
        self._connection = connection
        self._channel = None

    def credits(self) -> dict[str, tuple[int, int]]:
        """Each queue's (credit, priority rank), for the claim."""
        return {q.name: (q.credit, q.rank) for q in self.queues.values()}

    def debit(self, credits: dict[str, tuple[int, int]], slots: Iterable[FairSlot]) -> None:
        """Count the claimed dispatches against their queues' credit."""
        taken = _per_queue(slots)
        for name, count in taken.items():
            if name in self.queues:
                self.queues[name].claimed += count
        self.starved = any(taken.get(name, 0) >= credit for name, (credit, _) in credits.items())

    def landed(self, slots: Iterable[FairSlot], confirmed: Iterable[str] = ()) -> None:
        """The batch of ``slots`` is over; ``confirmed`` names the queue of each of
        its dispatches the broker confirmed. Those are on the broker now; the
        rest (nacked, returned, timed out, or never published: the batch
        failed or was cancelled) stay due, to be claimed, and debited, again."""
        on_broker = _per_queue_names(confirmed)
        for name, count in _per_queue(slots).items():
            queue = self.queues.get(name)
            if queue is None:
                continue
            arrived = min(count, on_broker.get(name, 0))
            queue.published += arrived
            queue.claimed -= count - arrived

    async def refresh(self) -> None:
        """Read the counts of the queues whose counts are older than ``refresh_seconds``."""
        async with self._lock:
            now = time.monotonic()
            stale = [
                q for q in self.queues.values() if now - q.read_at >= self.settings.refresh_seconds
            ]
            for queue in stale:
                await self._read(queue)

    async def _read(self, queue: QueueCredit) -> None:
        channel = await self._open()
        if channel is None:
            return
        try:
            declared = await channel.declare_queue(queue.name, passive=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Deleted under the relay (its channel is closed now): its
            # dispatches come back unroutable, and the relay says so there.
            log.warning("relay.credit.unread", queue=queue.name, error=repr(exc))
            self._channel = None
            queue.ready, queue.consumers = 0, 0
            queue.published_at_read = queue.published
            queue.target = self.settings.min_backlog
            queue.read_at = time.monotonic()
            return
        result = declared.declaration_result
        self._update(queue, int(result.message_count or 0), int(result.consumer_count or 0))

    def _update(self, queue: QueueCredit, ready: int, consumers: int) -> None:
        now = time.monotonic()
        elapsed = now - queue.read_at
        arrived = queue.published - queue.published_at_read
        if math.isfinite(elapsed) and elapsed > 0 and (arrived or queue.ready):
            # Only while there was work to take: an idle queue keeps its rate.
            # A reading may come out below zero (a publish confirmed after the
            # broker counted it): it evens out with the next, so it is not cut.
            measured = (queue.ready + arrived - ready) / elapsed
            if queue.rate == 0:
                queue.rate = max(0.0, measured)
            else:
                weight = min(1.0, elapsed / _RATE_SECONDS)
                queue.rate = max(0.0, queue.rate + (measured - queue.rate) * weight)
        settings = self.settings
        wanted = max(
            settings.min_backlog,
            consumers * settings.per_consumer,
            math.ceil(queue.rate * settings.horizon_seconds),
        )
        queue.target = min(wanted, settings.max_backlog)
        queue.ready, queue.consumers, queue.read_at = ready, consumers, now
        queue.published_at_read = queue.published

    async def _open(self) -> AbstractChannel | None:
        if self._channel is not None and not self._channel.is_closed:
            return self._channel
        connection = self._connection
        if connection is None or connection.is_closed:
            return None
        self._channel = await connection.channel(publisher_confirms=False)
        return self._channel


def _per_queue(slots: Iterable[FairSlot]) -> dict[str, int]:
    return _per_queue_names(slot.queue for slot in slots)


def _per_queue_names(names: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return counts
