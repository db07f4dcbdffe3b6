"""The relay's credit book (ADR-0042): the drain rate it reads, and the credit it grants.

The broker is simulated here as counts (what a passive ``queue.declare``
answers), the clock by hand: these tests check the book's arithmetic, the
integration tests (tests/integration/test_fair_dispatch.py) the relay against
a real RabbitMQ.
"""

from __future__ import annotations

import random
import statistics
import uuid
from dataclasses import dataclass, field

import pytest

from jobplane.store.fair import FairSlot
from jobplane.topology import parse_topology
from jobplane.workers import relay_credit
from jobplane.workers.fairness import FairSettings
from jobplane.workers.relay_credit import CreditBook

_TOPOLOGY = parse_topology({"queues": [{"name": "work"}]})
_TENANT = uuid.uuid4()


def _slots(count: int) -> list[FairSlot]:
    return [FairSlot("work", _TENANT, 0.0, 1.0) for _ in range(count)]


@dataclass
class _Run:
    """A relay claiming into one queue whose consumers take ``rate`` messages a second."""

    book: CreditBook
    rate: float
    now: float = 100.0
    ready: int = 0
    #: Batches claimed and not yet published: they land one tick later.
    in_flight: list[list[FairSlot]] = field(default_factory=list)
    taken: float = 0.0
    #: After each cycle: how long the broker's backlog and the batch in flight take to drain.
    backlog_seconds: list[float] = field(default_factory=list)
    #: After each cycle: the rate the book read.
    rates: list[float] = field(default_factory=list)

    def tick(self, seconds: float) -> None:
        """One claim cycle: read the counts, claim the credit, land last cycle's batch."""
        queue = self.book.queues["work"]
        self.book._update(queue, self.ready, consumers=1)
        credits = self.book.credits()
        slots = _slots(credits["work"][0])
        self.book.debit(credits, slots)
        # The batch claimed the cycle before lands now, after the read: the
        # relay claims the next batch while the one before is being confirmed.
        for batch in self.in_flight:
            self.ready += len(batch)
            self.book.landed(batch, [slot.queue for slot in batch])
        self.in_flight = [slots]
        self.now += seconds
        self.taken += self.rate * seconds
        took = min(self.ready, int(self.taken))
        self.ready -= took
        self.taken -= took


class _Clock:
    """Stands in for the module's ``time``: its ``monotonic`` reads ``now[0]``."""

    def __init__(self, now: list[float]) -> None:
        self._now = now

    def monotonic(self) -> float:
        return self._now[0]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(relay_credit, "time", _Clock(now))
    return now


def _run(clock: list[float], rate: float, seconds: float, tick: float) -> _Run:
    """``seconds`` of claim cycles of about ``tick`` seconds each (0.5 to 1.5 times, seeded)."""
    book = CreditBook(_TOPOLOGY, FairSettings())
    run = _Run(book, rate)
    jitter = random.Random(1)
    while run.now < 100.0 + seconds:
        clock[0] = run.now
        run.tick(tick * jitter.uniform(0.5, 1.5))
        run.backlog_seconds.append((run.ready + len(run.in_flight[0])) / rate)
        run.rates.append(book.queues["work"].rate)
    return run


@pytest.mark.parametrize("tick", [0.1, 0.25])
def test_the_drain_rate_is_what_the_consumers_take_with_batches_in_flight(
    clock: list[float], tick: float
) -> None:
    run = _run(clock, rate=640.0, seconds=30.0, tick=tick)
    # Claimed dispatches not yet on the broker are not taken by anyone: were
    # they counted as taken, or a reading below zero cut to zero, the rate
    # would come out well above this, and with it the backlog kept and the
    # wait of another tenant's job behind it (an estimator that did both
    # kept up to 5.4 s of work here).
    half = len(run.rates) // 2
    assert statistics.fmean(run.rates[half:]) == pytest.approx(640.0, rel=0.2)
    horizon = FairSettings().horizon_seconds
    assert max(run.backlog_seconds[half:]) <= horizon * 2


def test_a_batch_that_was_never_published_gives_its_credit_back(clock: list[float]) -> None:
    book = CreditBook(_TOPOLOGY, FairSettings(min_backlog=10))
    queue = book.queues["work"]
    book._update(queue, 0, consumers=0)
    credits = book.credits()
    assert credits["work"][0] == 10
    slots = _slots(6)
    book.debit(credits, slots)
    assert book.credits()["work"][0] == 4
    assert not book.starved
    book.landed(slots)
    assert book.credits()["work"][0] == 10
    # Published: on the broker now, and counted there at the next read.
    book.debit(book.credits(), slots)
    book.landed(slots, ["work"] * 6)
    assert book.credits()["work"][0] == 4
    clock[0] += 1.0
    book._update(queue, 6, consumers=0)
    assert book.credits()["work"][0] == 4
    assert queue.rate == 0.0  # nothing was taken


def test_a_claim_that_takes_all_the_credit_starves_the_queue(clock: list[float]) -> None:
    book = CreditBook(_TOPOLOGY, FairSettings(min_backlog=4))
    book._update(book.queues["work"], 0, consumers=0)
    credits = book.credits()
    book.debit(credits, _slots(4))
    assert book.starved
    assert book.credits()["work"][0] == 0


def test_an_idle_queue_keeps_its_rate(clock: list[float]) -> None:
    run = _run(clock, rate=300.0, seconds=5.0, tick=0.1)
    queue = run.book.queues["work"]
    assert queue.rate > 0
    # Nothing left, nothing published: readings over an idle spell change nothing.
    for batch in run.in_flight:
        run.book.landed(batch)
    clock[0] += 0.1
    run.book._update(queue, 0, consumers=1)
    rate = queue.rate
    for _ in range(5):
        clock[0] += 1.0
        run.book._update(queue, 0, consumers=1)
    assert queue.rate == rate


def test_only_confirmed_dispatches_arrive(clock: list[float]) -> None:
    """Nacked or returned dispatches are not on the broker: no consumer took them."""
    book = CreditBook(_TOPOLOGY, FairSettings(min_backlog=10))
    queue = book.queues["work"]
    book._update(queue, 0, consumers=1)
    slots = _slots(10)
    book.debit(book.credits(), slots)
    book.landed(slots, ["work"] * 4)  # six nacked: they stay due
    assert book.credits()["work"][0] == 6
    clock[0] += 1.0
    book._update(queue, 4, consumers=1)
    assert queue.rate == 0.0  # the four are still ready: none was taken
    assert book.credits()["work"][0] == 6
