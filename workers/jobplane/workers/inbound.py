"""A delivery as the worker holds it: aiormq's frames, read where they are used.

aio-pika turns each delivery into an ``IncomingMessage``: every property
copied into an attribute of its own (28 writes, a timestamp and an
expiration decoded), in a task of its own on top of aiormq's. The worker
reads a handful of them. :class:`Delivery` keeps aiormq's
``DeliveredMessage`` as it came (its method frame and properties) and reads
only the delivery tag and the redelivered flag up front;
everything else is read from the frames when asked for. It settles through
its aiormq channel, without waiting for the frame to be written: an ack
is at-least-once either way (a frame in the write queue of a connection
that dies is lost as surely as one in the socket's buffer, and the broker
redelivers both).

Every settling write of a channel (a group's acks, a single ack, a nack, a
reject) goes through the channel's :func:`settle_lock`, held from the
decision (is it still unsettled? which tags may a ``multiple`` ack cover?)
until its frame is in the connection's write queue. That queue is bounded
and an ``asyncio.Queue`` lets a new writer overtake one waiting for room:
without the lock, a ``multiple`` ack planned while a nack waited could
reach the broker first and settle the nacked delivery, or an ack could
reach it twice (and the broker close the channel).

:func:`write_acks` writes the acks of many deliveries of one channel as one
write: a ``multiple`` ack and single ones, encoded here (a method frame of
21 bytes each; a unit test holds them to pamqp's encoding).
"""

from __future__ import annotations

import asyncio
import struct
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import aiormq
from aiormq.abc import ChannelFrame, DeliveredMessage
from pamqp import commands, frame

# A basic.ack method frame: type 1, channel, size 13; class 60, method 80,
# the delivery tag, the multiple bit; the frame end.
_ACK = struct.Struct(">BHIHHQBB")
_METHOD, _ACK_SIZE, _BASIC, _BASIC_ACK, _FRAME_END = 1, 13, 60, 80, 0xCE


def ack_frame(channel: int, delivery_tag: int, *, multiple: bool = False) -> bytes:
    """The bytes of a ``basic.ack`` of ``delivery_tag`` on ``channel``."""
    return _ACK.pack(
        _METHOD, channel, _ACK_SIZE, _BASIC, _BASIC_ACK, delivery_tag, multiple, _FRAME_END
    )


_settle_locks: weakref.WeakKeyDictionary[aiormq.Channel, asyncio.Lock] = weakref.WeakKeyDictionary()


def settle_lock(channel: aiormq.Channel) -> asyncio.Lock:
    """The lock that orders the settling writes of ``channel`` (first come, first written)."""
    lock = _settle_locks.get(channel)
    if lock is None:
        lock = _settle_locks[channel] = asyncio.Lock()
    return lock


def closing(channel: aiormq.Channel) -> bool:
    """Whether ``channel`` is closed or closing: no settling frame may go on it.

    aiormq answers the broker's ``channel.close`` by queueing ``close-ok`` and
    setting a private event, several loop turns before ``is_closed`` turns
    true. A method queued after that ``close-ok`` is one on a closed channel,
    which the broker answers by closing the connection. aiormq's own
    ``basic_ack`` checks that event; aiormq 7.2 has no public way to read
    it, so it is read as aiormq names it (a unit test holds a real aiormq
    channel to it).
    """
    if channel.is_closed:
        return True
    event: asyncio.Event | None = getattr(channel, "_Channel__close_event", None)
    return event is not None and event.is_set()


#: How often a settling write waiting for room in a full write queue looks
#: again whether its channel closed (seconds).
ROOM_POLL = 0.002


async def put_frames(channel: aiormq.Channel, payload: bytes) -> None:
    """Queue ``payload`` (whole frames of ``channel``) on its connection's writer.

    Never waits across a loop turn without looking at the channel again: it
    queues only while the channel is open and there is room, checked and done
    with no await between, and otherwise waits for room a moment at a time.
    ``asyncio.Queue.put`` would wait for room however long it takes: on a
    connection whose writer has died it waits forever (holding the channel's
    settle lock, and with it every later settle), and a frame that finds room
    after the broker closed the channel would follow the ``close-ok``, possibly
    onto a channel reopened under the same number.

    Raises :class:`aiormq.exceptions.ChannelInvalidStateError` when the
    channel is closed or closing: nothing is queued.
    """
    queue = channel.write_queue
    while True:
        if closing(channel):
            raise aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} closed")
        if not queue.full():
            queue.put_nowait(ChannelFrame(payload=payload, should_close=False))
            return
        await asyncio.sleep(ROOM_POLL)


def _method_frame(channel: aiormq.Channel, method: Any) -> bytes:
    return frame.marshal(method, channel.number)


async def write_acks(channel: aiormq.Channel, upto: int | None, singles: Iterable[int]) -> int:
    """Ack on ``channel``: every outstanding delivery up to ``upto`` (``multiple``;
    None: none) and each of ``singles``, in one write. Returns the frames written.

    Raises :class:`aiormq.exceptions.ChannelInvalidStateError` when the
    channel is closed or closing: none of them is acked (the broker
    redelivers them). The caller holds the channel's :func:`settle_lock`.
    """
    frames = [] if upto is None else [ack_frame(channel.number, upto, multiple=True)]
    frames += [ack_frame(channel.number, tag) for tag in singles]
    if not frames:
        return 0
    await put_frames(channel, b"".join(frames))
    return len(frames)


class Delivery:
    """One delivery of a worker's consumer: what the worker reads of it, and its settling."""

    __slots__ = (
        "_message",
        "channel",
        "delivery_tag",
        "priority",
        "processed",
        "queue",
        "redelivered",
    )

    def __init__(self, message: DeliveredMessage, queue: str = "", priority: str = "") -> None:
        deliver: Any = message.delivery
        self._message = message
        #: The aiormq channel it came on (closed: it cannot be settled any more).
        self.channel: aiormq.Channel = message.channel  # type: ignore[assignment]
        self.delivery_tag: int = deliver.delivery_tag
        self.redelivered: bool = bool(deliver.redelivered)
        #: The queue its consumer consumes, and that queue's priority class.
        self.queue = queue
        self.priority = priority
        #: True once acked, nacked or rejected through it.
        self.processed = False

    @property
    def body(self) -> bytes:
        return self._message.body

    @property
    def properties(self) -> aiormq.spec.Basic.Properties:
        """The message's properties, as pamqp decoded them."""
        return self._message.header.properties

    @property
    def headers(self) -> Mapping[str, Any] | None:
        return self._message.header.properties.headers

    @property
    def message_id(self) -> str | None:
        return self._message.header.properties.message_id

    @property
    def correlation_id(self) -> str | None:
        return self._message.header.properties.correlation_id

    @property
    def exchange(self) -> str:
        return self._message.delivery.exchange or ""  # type: ignore[union-attr]

    @property
    def routing_key(self) -> str:
        return self._message.delivery.routing_key or ""  # type: ignore[union-attr]

    # Each settles it once: under the channel's settle lock, a delivery found
    # settled (by a group's ack, or a nack of its cancelled handler) is left
    # alone, and one found unsettled is marked processed before its frame is
    # queued (a handler cancelled in the write must not settle it again). A
    # write that fails leaves it on a closed channel, which nothing settles.

    async def ack(self) -> None:
        """Ack it alone."""
        async with settle_lock(self.channel):
            if not self.processed:
                self.processed = True
                await put_frames(self.channel, ack_frame(self.channel.number, self.delivery_tag))

    async def nack(self, *, requeue: bool = True) -> None:
        """Nack it (back to its queue with ``requeue``)."""
        async with settle_lock(self.channel):
            if not self.processed:
                self.processed = True
                await nack(self.channel, self.delivery_tag, requeue=requeue)

    async def reject(self, *, requeue: bool = False) -> None:
        """Reject it (to the dead-letter exchange without ``requeue``)."""
        async with settle_lock(self.channel):
            if not self.processed:
                self.processed = True
                method = commands.Basic.Reject(self.delivery_tag, requeue=requeue)
                await put_frames(self.channel, _method_frame(self.channel, method))


async def nack(channel: aiormq.Channel, delivery_tag: int, *, requeue: bool = True) -> None:
    """Nack ``delivery_tag`` on ``channel``; the caller holds its :func:`settle_lock`."""
    method = commands.Basic.Nack(delivery_tag, multiple=False, requeue=requeue)
    await put_frames(channel, _method_frame(channel, method))
