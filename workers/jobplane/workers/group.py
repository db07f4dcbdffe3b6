"""Group commit in the worker (ADR-0028): what concurrent deliveries ask of the
database within a short window goes out as one statement, and their acks as
few frames as the broker allows.

A :class:`~jobplane.batcher.Batcher` collects requests for at most ``window``
seconds after the first (or until ``max_size`` of them), runs them as one
group and hands each caller its own result. :func:`plan_acks` decides where one ``basic.ack`` with
``multiple`` may settle many deliveries; :class:`Acks` applies it, and writes
a channel's acks of one moment (the multiple one and the single ones) to the
connection as one write.
"""

from __future__ import annotations

from collections.abc import Collection

import structlog

from jobplane.batcher import Batcher
from jobplane.workers.inbound import Delivery, settle_lock, write_acks

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
    consumer callback, which runs in delivery order), so the outstanding
    deliveries of a channel are known when a group is acked: a ``multiple``
    ack never reaches below a delivery that is not in the group. A delivery
    a multiple ack settled is marked processed like one acked alone.
    """

    def __init__(self) -> None:
        # id(channel) -> delivery tag -> delivery, for deliveries not settled;
        # each delivery holds its channel, so no other channel takes its id
        # while it has deliveries here.
        self._delivered: dict[int, dict[int, Delivery]] = {}
        self._batcher: Batcher[Delivery, None] = Batcher(
            self._ack_group, window=0.0, max_size=1_000_000
        )
        #: How many basic.ack frames were sent with multiple=True, and without.
        self.multiple = 0
        self.single = 0

    def delivered(self, delivery: Delivery) -> None:
        """``delivery`` arrived: it is outstanding on its channel until settled."""
        if delivery.delivery_tag:
            self._delivered.setdefault(id(delivery.channel), {})[delivery.delivery_tag] = delivery

    def forget(self, delivery: Delivery) -> None:
        """``delivery``'s handling ended: no more to know of it."""
        key = id(delivery.channel)
        tags = self._delivered.get(key)
        if tags is None:
            return
        if tags.get(delivery.delivery_tag) is delivery:
            del tags[delivery.delivery_tag]
        if not tags:
            del self._delivered[key]

    async def ack(self, delivery: Delivery) -> None:
        """Ack ``delivery`` with the others acked at this moment."""
        await self._batcher.submit(delivery)

    async def _ack_group(self, deliveries: list[Delivery]) -> list[None]:
        by_channel: dict[int, list[Delivery]] = {}
        for delivery in deliveries:
            if not delivery.processed:
                by_channel.setdefault(id(delivery.channel), []).append(delivery)
        for key, group in by_channel.items():
            async with settle_lock(group[0].channel):
                await self._ack_channel(self._delivered.get(key, {}), group)
        return [None] * len(deliveries)

    async def _ack_channel(self, known: dict[int, Delivery], group: list[Delivery]) -> None:
        """Ack ``group``, deliveries of one channel of which ``known`` are outstanding.

        The caller holds the channel's settle lock: what is processed now had
        its frame queued before, what is not cannot be settled meanwhile.
        """
        for tag, delivery in list(known.items()):
            if delivery.processed:
                del known[tag]
        # Settled since the group formed (a nack of a cancelled handler): not again.
        to_ack = {d.delivery_tag: d for d in group if not d.processed}
        if not to_ack:
            return
        # Only deliveries known outstanding take part in a multiple ack; any
        # other is acked alone. An outstanding delivery whose nack or single
        # ack waits for the lock is not in the group: the multiple ack stops
        # below it.
        planned = [tag for tag, d in to_ack.items() if known.get(tag) is d]
        upto, singles = plan_acks(known.keys(), planned) if len(planned) > 1 else (None, planned)
        singles += [tag for tag in to_ack if known.get(tag) is not to_ack[tag]]
        # Settled from here on, before the write (as Delivery.ack does): a
        # handler cancelled in the write must not settle them again.
        for tag, delivery in to_ack.items():
            delivery.processed = True
            if known.get(tag) is delivery:
                del known[tag]
        try:
            await write_acks(group[0].channel, upto, singles)
        except Exception as exc:
            # A closed channel: the broker redelivers, the claim acks the copy.
            log.warning("job.message.settle_failed", error=str(exc))
            return
        if upto is not None:
            self.multiple += 1
        self.single += len(singles)

    async def stop(self, timeout: float | None = None) -> None:
        """Ack what is waiting now (see :meth:`Batcher.stop`)."""
        await self._batcher.stop(timeout)
