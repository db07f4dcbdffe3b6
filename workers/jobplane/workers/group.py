"""Group commit in the worker (ADR-0028): what concurrent deliveries ask of the
database within a short window goes out as one statement, and their acks as
few frames as the broker allows.

A :class:`~jobplane.batcher.Batcher` collects requests for at most ``window``
seconds after the first (or until ``max_size`` of them), runs them as one
group and hands each caller its own result. :func:`plan_acks` decides where one ``basic.ack`` with
``multiple`` may settle many deliveries; :class:`Acks` applies it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import structlog
from aio_pika.abc import AbstractIncomingMessage

from jobplane.batcher import Batcher

log = structlog.get_logger("jobplane.worker")

#: The default window of a group, seconds: short against a job's run (a no-op
#: job costs about 5 ms of CPU end to end), long enough for concurrent
#: deliveries to meet.
DEFAULT_GROUP_WINDOW = 0.002
#: The default largest group.
DEFAULT_GROUP_MAX = 64


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
