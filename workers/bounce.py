"""Handing a message of another deployment back to its queue, at no cost to it.

When two deployments (two databases) share a vhost and queue names, a worker
of one receives the other's messages. Rejecting one would dead-letter it; a
nack with requeue would count towards the quorum queue's delivery limit and
end in the dead-letter exchange all the same. Instead the worker publishes an
unchanged copy (with publisher confirms) to the queue it came from, and only
then acks the original: the copy starts with a fresh delivery count.

A copy carries how many times it was handed back. When the other deployment
has no worker running, its messages would circle between ours as fast as the
broker moves them; the wait before each hand-back grows with that count (to
at most a second), which keeps a stranger's circling messages cheap while
costing a message that meets its own deployment's worker after a hop or two
almost nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

HOPS_HEADER = "x-jobplane-handbacks"


class HandBackFailed(Exception):
    """The broker did not confirm the copy; the original was not acked."""


def handback_delay(hops: int) -> float:
    """Seconds to wait before handing back a message already handed back ``hops`` times."""
    return min(0.01 * 2.0 ** min(hops, 10), 1.0)


def hops_of(message: AbstractIncomingMessage) -> int:
    """How many times ``message`` has been handed back."""
    value: Any = (message.headers or {}).get(HOPS_HEADER, 0)
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


async def hand_back(
    channel: AbstractChannel,
    message: AbstractIncomingMessage,
    queue: str | None,
    *,
    timeout: float = 10.0,
) -> int:
    """Publish a copy of ``message`` to ``queue``; returns its hand-back count.

    The copy goes straight to the queue the message was consumed from (through
    the default exchange), not through the jobs exchange again: with
    overlapping bindings that would put a copy in every matching queue at every
    hand-back. Without a ``queue`` it goes where the original was published.
    The caller acks the original after this returns (and leaves it unacked if
    it raises: the broker then redelivers the original).
    """
    hops = hops_of(message)
    await asyncio.sleep(handback_delay(hops))
    copy = aio_pika.Message(
        message.body,
        headers={**(message.headers or {}), HOPS_HEADER: hops + 1},
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=message.delivery_mode,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
        # user_id is left out: the broker checks it against our own login.
    )
    if queue is not None:
        exchange, routing_key = channel.default_exchange, queue
    elif message.exchange:
        exchange = await channel.get_exchange(message.exchange, ensure=False)
        routing_key = message.routing_key or ""
    else:
        exchange, routing_key = channel.default_exchange, message.routing_key or ""
    confirmation = await exchange.publish(
        copy, routing_key=routing_key, mandatory=True, timeout=timeout
    )
    if not isinstance(confirmation, aiormq.spec.Basic.Ack):
        raise HandBackFailed(f"not confirmed: {type(confirmation).__name__}")
    return hops + 1
