"""Group what concurrent callers ask of the database into one statement.

A :class:`Batcher` collects items for at most ``window`` seconds after the
first (or until ``max_size`` of them, or, with ``max_running``, while that
many groups are running), runs them as one group and hands each caller its
own result. With ``eager``, the window is only for items that find a group
running: an item that finds none goes out at once. The worker groups claims
and outcomes this way (ADR-0028, ADR-0053), the server concurrent submits
(ADR-0030).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    """Runs what callers :meth:`submit` within one window as one group.

    ``run`` takes the group's items and returns one result per item, in
    order; a result that is an exception is raised to its caller alone.
    When ``run`` raises, every caller of the group gets the exception, unless
    ``split`` says it belongs to one item (a value the database refuses):
    then each item runs alone, so one bad item fails only its own caller.
    Groups run concurrently: a group never waits for the one before it,
    unless ``max_running`` groups are running already: then the items wait
    for one of them to end and go out together (a group as large as the
    moment's load, at no cost to a lone item: with a ``window`` of 0, it
    goes out at the loop's next turn).

    With ``eager`` (ADR-0053), an item that finds no group running and
    none waiting goes out at the loop's next turn (with whatever joined it
    in that turn): an idle caller never waits out the window. Items that
    find a group running wait for the window, or for the running groups to
    end, whichever comes first: under load the groups are as large as
    before, and a burst meets a group in flight rather than a timer.
    """

    def __init__(
        self,
        run: Callable[[list[T]], Awaitable[Sequence[R | BaseException]]],
        *,
        window: float,
        max_size: int,
        split: Callable[[BaseException], bool] = lambda _exc: False,
        on_group: Callable[[int], None] = lambda _size: None,
        max_running: int | None = None,
        eager: bool = False,
    ) -> None:
        if max_size < 1:
            raise ValueError("a group holds at least one item")
        if max_running is not None and max_running < 1:
            raise ValueError("max_running is at least 1")
        self._max_running = max_running
        self._eager = eager
        self._run = run
        self._window = max(window, 0.0)
        self._max_size = max_size
        self._split = split
        self._on_group = on_group
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._timer: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: How many groups of each size ran (for metrics and tests).
        self.sizes: Counter[int] = Counter()

    async def submit(self, item: T) -> R:
        """Join the next group with ``item``; its result once the group ran."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, future))
        if len(self._pending) >= self._max_size:
            self._flush()
        elif self._timer is None:
            # Never later than the window after the first: a lone item waits
            # at most that long (eager: none, when no group runs).
            idle = self._eager and not self._tasks
            self._timer = (
                loop.call_later(self._window, self._flush)
                if self._window > 0 and not idle
                else loop.call_soon(self._flush)
            )
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending and (self._max_running is None or len(self._tasks) < self._max_running):
            group = self._pending[: self._max_size]
            del self._pending[: self._max_size]
            task = asyncio.create_task(self._settle(group))
            self._tasks.add(task)
            task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._pending and (self._timer is None or (self._eager and not self._tasks)):
            # Those that waited for a running group to end go out now (eager:
            # those that waited for the window too, once no group runs).
            self._flush()

    async def _settle(self, group: list[tuple[T, asyncio.Future[R]]]) -> None:
        items = [item for item, _ in group]
        try:
            # Inside: whatever fails here still answers every waiter.
            self.sizes[len(group)] += 1
            self._on_group(len(group))
            try:
                results = await self._run(items)
            except Exception as exc:
                if len(items) == 1 or not self._split(exc):
                    raise
                results = [await self._alone(item) for item in items]
        except BaseException as exc:
            for _, future in group:
                if not future.done():
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, future), result in zip(group, results, strict=True):
            if future.done():  # its caller was cancelled
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _alone(self, item: T) -> R | BaseException:
        try:
            [result] = await self._run([item])
        except Exception as exc:
            return exc
        return result

    async def stop(self, timeout: float | None = None) -> None:
        """Run what is pending now, and wait for every group to end; after
        ``timeout`` seconds (None: no limit), cancel those still running (their
        waiters get the cancellation, and their deliveries go back unacked)."""
        self._flush()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self._tasks:
            left = None if deadline is None else max(0.0, deadline - loop.time())
            _, late = await asyncio.wait(set(self._tasks), timeout=left)
            if late and left == 0.0:
                for task in late:
                    task.cancel()
                await asyncio.wait(late)
