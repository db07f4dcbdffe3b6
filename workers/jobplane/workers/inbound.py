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

:func:`write_acks` writes the acks of many deliveries of one channel as one
write: a ``multiple`` ack and single ones, encoded here (a method frame of
21 bytes each; a unit test holds them to pamqp's encoding).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

import aiormq
from aiormq.abc import ChannelFrame, DeliveredMessage

# A basic.ack method frame: type 1, channel, size 13; class 60, method 80,
# the delivery tag, the multiple bit; the frame end.
_ACK = struct.Struct(">BHIHHQBB")
_METHOD, _ACK_SIZE, _BASIC, _BASIC_ACK, _FRAME_END = 1, 13, 60, 80, 0xCE


def ack_frame(channel: int, delivery_tag: int, *, multiple: bool = False) -> bytes:
    """The bytes of a ``basic.ack`` of ``delivery_tag`` on ``channel``."""
    return _ACK.pack(
        _METHOD, channel, _ACK_SIZE, _BASIC, _BASIC_ACK, delivery_tag, multiple, _FRAME_END
    )


async def write_acks(channel: aiormq.Channel, upto: int | None, singles: Iterable[int]) -> int:
    """Ack on ``channel``: every outstanding delivery up to ``upto`` (``multiple``;
    None: none) and each of ``singles``, in one write. Returns the frames written.

    Raises :class:`aiormq.exceptions.ChannelInvalidStateError` when the
    channel is closed: none of them is acked (the broker redelivers them).
    """
    frames = [] if upto is None else [ack_frame(channel.number, upto, multiple=True)]
    frames += [ack_frame(channel.number, tag) for tag in singles]
    if not frames:
        return 0
    if channel.is_closed:
        raise aiormq.exceptions.ChannelInvalidStateError(f"{channel!r} closed")
    await channel.write_queue.put(ChannelFrame(payload=b"".join(frames), should_close=False))
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
    def exchange(self) -> str:
        return self._message.delivery.exchange or ""  # type: ignore[union-attr]

    @property
    def routing_key(self) -> str:
        return self._message.delivery.routing_key or ""  # type: ignore[union-attr]

    # Each marks it processed before it writes: a handler cancelled meanwhile
    # must not settle it a second time (the broker would close the channel).
    # A write that fails leaves it on a closed channel, which nothing settles.

    async def ack(self) -> None:
        """Ack it alone."""
        self.processed = True
        await self.channel.basic_ack(self.delivery_tag, wait=False)

    async def nack(self, *, requeue: bool = True) -> None:
        """Nack it (back to its queue with ``requeue``)."""
        self.processed = True
        await self.channel.basic_nack(self.delivery_tag, requeue=requeue, wait=False)

    async def reject(self, *, requeue: bool = False) -> None:
        """Reject it (to the dead-letter exchange without ``requeue``)."""
        self.processed = True
        await self.channel.basic_reject(self.delivery_tag, requeue=requeue, wait=False)
