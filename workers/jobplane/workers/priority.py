"""A worker's handler slots, granted by the priority of the queue a delivery came from.

RabbitMQ 3.10's quorum queues have no message priorities, and a consumer's
prefetch is per consumer: left alone, a worker that consumes several queues
runs ``concurrency`` handlers *per queue* and never chooses between them.
:class:`Slots` makes ``concurrency`` the worker's bound and decides which
waiting delivery runs next (ADR-0019):

- **Reserved slots.** While the worker consumes a queue of a higher priority
  than others, the deliveries of the lower classes hold at most
  ``concurrency - reserve`` slots between them: a job of the top class never
  waits behind a full set of lower ones.
- **Weighted turns.** When a slot frees and several classes wait, the class
  with the lowest *pass* takes it (stride scheduling): each grant advances a
  class's pass by ``1 / weight``, so a class that keeps waiting gets
  ``weight / sum(weights)`` of the grants it competes for: high before
  normal before low, and none of them starves.
- **Prefetch by class.** A class's prefetch is what it may run at once (the
  top class ``concurrency``, the others ``concurrency - reserve``) plus its
  weighted share of the slots, ``ceil(concurrency * weight / sum(weights))``:
  the turns choose only between deliveries that wait in the worker, and a
  freed slot's next delivery is still on its way from the broker when the
  slot is granted. Without the share, a class that filled its slots had
  nothing waiting whenever one of them freed, the other class took the slot,
  and a backlog in a high and a low queue ran one for one instead of 4 : 1.
  The share is what the class gets of ``concurrency`` grants, so it lasts a
  whole round of them.

A worker whose queues all have one priority keeps plain slots: no reserve,
and a delivery starts at once whenever the prefetch let it in.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import Iterable

from jobplane.topology import PRIORITIES

#: Share of the grants a class gets while others wait too.
WEIGHTS = {"high": 4, "normal": 2, "low": 1}


class SlotsClosed(Exception):
    """The worker is stopping: a delivery that waited for a slot gets none."""


def default_reserve(concurrency: int) -> int:
    """Slots kept for the top class of a worker that consumes several priorities."""
    # A quarter, and at least one; never all of them: lower classes must be
    # able to run something.
    return min(max(1, concurrency // 4), concurrency - 1)


class Slots:
    """At most ``concurrency`` handlers at once, granted by priority class."""

    def __init__(
        self, concurrency: int, priorities: Iterable[str], *, reserve: int | None = None
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        present = sorted(set(priorities), key=PRIORITIES.index)
        if not present:
            present = ["normal"]
        self.concurrency = concurrency
        #: The worker's classes, highest first.
        self.classes = tuple(present)
        self.top = present[0]
        if len(present) == 1:
            reserve = 0
        elif reserve is None:
            reserve = default_reserve(concurrency)
        if not 0 <= reserve < concurrency:
            raise ValueError("reserve must be at least 0 and less than concurrency")
        self.reserve = reserve
        self._running = dict.fromkeys(present, 0)
        self._held = 0
        self._below_top = 0
        self._queued = 0
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {
            p: collections.deque() for p in present
        }
        self._pass = dict.fromkeys(present, 0.0)
        self._clock = 0.0
        self._closed = False

    @property
    def running(self) -> int:
        """Slots held now."""
        return self._held

    def prefetch(self, priority: str) -> int:
        """The prefetch for a queue of ``priority``: what its class may run at once,
        and (among several classes) its weighted share of the slots waiting."""
        cls = self.class_of(priority)
        may_run = self.concurrency if cls == self.top else self.concurrency - self.reserve
        if len(self.classes) == 1:
            return may_run
        total = sum(WEIGHTS[c] for c in self.classes)
        return may_run + math.ceil(self.concurrency * WEIGHTS[cls] / total)

    def class_of(self, priority: str) -> str:
        """``priority`` if the worker has such queues, else its lowest class."""
        return priority if priority in self._running else self.classes[-1]

    def turn(self, priority: str) -> _Turn:
        """``async with slots.turn(priority):`` holds a slot for the block; waits
        for one, by priority and turns.

        Raises :class:`SlotsClosed` when the worker stops before a slot is
        granted.
        """
        return _Turn(self, self.class_of(priority))

    def close(self) -> None:
        """Refuse every waiting and every later request (held slots stay held)."""
        self._closed = True
        self._queued = 0
        for waiting in self._waiting.values():
            while waiting:
                future = waiting.popleft()
                if not future.done():
                    future.set_exception(SlotsClosed())

    async def _acquire(self, cls: str) -> None:
        if self._closed:
            raise SlotsClosed()
        waiting = self._waiting[cls]
        if not waiting:
            # A class that had nothing waiting joins at the current pass: it
            # cannot bank turns while it was idle.
            self._pass[cls] = max(self._pass[cls], self._clock)
            if not self._queued and self._may_run(cls):
                self._grant(cls)
                return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting.append(future)
        self._queued += 1
        self._dispatch()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._release(cls)  # granted as we were cancelled: give it on
            else:
                with contextlib.suppress(ValueError):
                    waiting.remove(future)
                    self._queued -= 1
            raise

    def _may_run(self, cls: str) -> bool:
        if self._held >= self.concurrency:
            return False
        return cls == self.top or self._below_top < self.concurrency - self.reserve

    def _grant(self, cls: str) -> None:
        self._running[cls] += 1
        self._held += 1
        if cls != self.top:
            self._below_top += 1
        self._clock = self._pass[cls]
        self._pass[cls] += 1.0 / WEIGHTS[cls]

    def _release(self, cls: str) -> None:
        self._running[cls] -= 1
        self._held -= 1
        if cls != self.top:
            self._below_top -= 1
        if self._queued:
            self._dispatch()

    def _dispatch(self) -> None:
        """Grant free slots to waiting deliveries: lowest pass first, ties to the higher class."""
        while self._queued and self._held < self.concurrency:
            ready = [c for c in self.classes if self._waiting[c] and self._may_run(c)]
            if not ready:
                return
            cls = min(ready, key=lambda c: self._pass[c])  # min keeps the first of a tie
            future = self._waiting[cls].popleft()
            self._queued -= 1
            if future.done():  # cancelled while it waited
                continue
            self._grant(cls)
            future.set_result(None)


class _Turn:
    """One slot for an ``async with`` block (a class: the hot path pays no generator)."""

    __slots__ = ("_cls", "_slots")

    def __init__(self, slots: Slots, cls: str) -> None:
        self._slots = slots
        self._cls = cls

    async def __aenter__(self) -> None:
        await self._slots._acquire(self._cls)

    async def __aexit__(self, *exc: object) -> None:
        self._slots._release(self._cls)
