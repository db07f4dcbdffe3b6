"""Group commit in the worker (ADR-0028): what concurrent deliveries ask of the
database within a short window goes out as one statement, and their acks as
few frames as the broker allows.

A :class:`Batcher` collects requests for at most ``window`` seconds after the
first (or until ``max_size`` of them), runs them as one group and hands each
caller its own result. :func:`plan_acks` decides where one ``basic.ack`` with
``multiple`` may settle many deliveries; :class:`Acks` applies it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, Generic, TypeVar

import structlog
from aio_pika.abc import AbstractIncomingMessage

log = structlog.get_logger("jobplane.worker")

T = TypeVar("T")
R = TypeVar("R")

#: The default window of a group, seconds: short against a job's run (a no-op
#: job costs about 5 ms of CPU end to end), long enough for concurrent
#: deliveries to meet.
DEFAULT_GROUP_WINDOW = 0.002
#: The default largest group.
DEFAULT_GROUP_MAX = 64


class Batcher(Generic[T, R]):
    """Runs what callers :meth:`submit` within one window as one group.

    ``run`` takes the group's items and returns one result per item, in
    order; a result that is an exception is raised to its caller alone.
    When ``run`` raises, every caller of the group gets the exception, unless
    ``split`` says it belongs to one item (a value the database refuses):
    then each item runs alone, so one bad item fails only its own caller.
    Groups run concurrently: a group never waits for the one before it.
    """

    def __init__(
        self,
        run: Callable[[list[T]], Awaitable[Sequence[R | BaseException]]],
        *,
        window: float,
        max_size: int,
        split: Callable[[BaseException], bool] = lambda _exc: False,
        on_group: Callable[[int], None] = lambda _size: None,
    ) -> None:
        if max_size < 1:
            raise ValueError("a group holds at least one item")
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
            # at most that long.
            self._timer = (
                loop.call_later(self._window, self._flush)
                if self._window > 0
                else loop.call_soon(self._flush)
            )
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        group, self._pending = self._pending, []
        if not group:
            return
        task = asyncio.create_task(self._settle(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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


def plan_acks(unsettled: Collection[int], to_ack: Collection[int]) -> tuple[int | None, list[int]]:
    """How to ack the deliveries ``to_ack`` of one channel, of which ``unsettled``
    are outstanding (``to_ack`` among them).

    Returns the tag to ack with ``multiple=True`` (or None) and the tags to
    ack one by one. ``multiple`` acks every outstanding delivery up to its
    tag, so it is used only up to the first outstanding delivery that is not
    to be acked, and only where it saves a frame (two or more below it).
    """
    acks = sorted(set(to_ack))
    others = set(unsettled).difference(acks)
    first_other = min(others, default=None)
    below = [t for t in acks if first_other is None or t < first_other]
    above = acks[len(below) :]
    if len(below) >= 2:
        return below[-1], above
    return None, acks


class Acks:
    """Acks deliveries after their commit: those of one moment together, by channel.

    Every delivery is registered at its arrival (:meth:`delivered`, in the
    consumer callback, which aio-pika calls in delivery order), so the
    outstanding deliveries of a channel are known when a group is acked. A
    delivery a multiple ack settled is not marked processed by aio-pika:
    :meth:`settled` says it is.
    """

    def __init__(self) -> None:
        # channel -> delivery tag -> message, for deliveries not acked by us;
        # each message's channel as it was at its arrival; the channels, held
        # while they have deliveries here (so that no other takes their id).
        self._delivered: dict[int, dict[int, AbstractIncomingMessage]] = {}
        self._arrived_on: dict[int, int] = {}
        self._channels: dict[int, Any] = {}
        # Messages a multiple ack of another message settled.
        self._covered: set[int] = set()
        self._batcher: Batcher[AbstractIncomingMessage, None] = Batcher(
            self._ack_group, window=0.0, max_size=1_000_000
        )
        #: How many basic.ack frames were sent with multiple=True, and without.
        self.multiple = 0
        self.single = 0

    def delivered(self, message: AbstractIncomingMessage) -> None:
        """``message`` arrived: it is outstanding on its channel until settled."""
        try:
            channel: Any = message.channel
        except Exception:
            return  # closed already: it is redelivered, never acked
        if message.delivery_tag:
            key = id(channel)
            self._channels[key] = channel
            self._arrived_on[id(message)] = key
            self._delivered.setdefault(key, {})[message.delivery_tag] = message

    def settled(self, message: AbstractIncomingMessage) -> bool:
        """Whether ``message`` was acked, nacked or rejected (also by a multiple ack)."""
        return message.processed or id(message) in self._covered

    def forget(self, message: AbstractIncomingMessage) -> None:
        """``message``'s handling ended: no more to know of it."""
        self._covered.discard(id(message))
        key = self._arrived_on.pop(id(message), None)
        if key is None:
            return
        tags = self._delivered.get(key, {})
        if tags.get(message.delivery_tag or 0) is message:
            del tags[message.delivery_tag or 0]
        if not tags:
            self._delivered.pop(key, None)
            self._channels.pop(key, None)

    async def ack(self, message: AbstractIncomingMessage) -> None:
        """Ack ``message`` with the others acked at this moment."""
        await self._batcher.submit(message)

    async def _ack_group(self, messages: list[AbstractIncomingMessage]) -> list[None]:
        by_channel: dict[int | None, list[AbstractIncomingMessage]] = {}
        for message in messages:
            key = self._arrived_on.get(id(message))
            if key is not None and _channel_key(message) != key:
                key = None  # its channel closed since: it cannot be acked
            by_channel.setdefault(key, []).append(message)
        for channel, group in by_channel.items():
            known = self._delivered.get(channel) if channel is not None else None
            if known is None or len(group) < 2:
                for message in group:
                    await self._ack_one(message)
                continue
            for tag, message in list(known.items()):
                if self.settled(message):
                    del known[tag]
            # Only deliveries known outstanding on this channel take part in
            # the plan; any other is acked alone.
            to_ack: dict[int, AbstractIncomingMessage] = {}
            for message in group:
                tag = message.delivery_tag or 0
                if known.get(tag) is message and not self.settled(message):
                    to_ack[tag] = message
                else:
                    await self._ack_one(message)
            upto, singles = plan_acks(known.keys(), to_ack.keys())
            if upto is not None:
                carrier = to_ack[upto]
                try:
                    await carrier.ack(multiple=True)
                except Exception as exc:
                    log.warning("job.message.settle_failed", error=str(exc))
                else:
                    self.multiple += 1
                    for tag, message in to_ack.items():
                        if tag <= upto:
                            known.pop(tag, None)
                            if message is not carrier:
                                self._covered.add(id(message))
            for tag in singles:
                await self._ack_one(to_ack[tag])
        return [None] * len(messages)

    async def _ack_one(self, message: AbstractIncomingMessage) -> None:
        if self.settled(message):
            return
        try:
            await message.ack()
        except Exception as exc:
            # A closed channel: the broker redelivers, the claim acks the copy.
            log.warning("job.message.settle_failed", error=str(exc))
        else:
            self.single += 1

    async def stop(self, timeout: float | None = None) -> None:
        """Ack what is waiting now (see :meth:`Batcher.stop`)."""
        await self._batcher.stop(timeout)


def _channel_key(message: AbstractIncomingMessage) -> int | None:
    """The identity of the channel ``message`` came on (None: it is closed)."""
    try:
        channel: Any = message.channel
    except Exception:
        return None
    return id(channel)
