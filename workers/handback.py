"""Compatibility name of :mod:`jobplane.workers.bounce`, for one call site.

``workers/runtime.py`` still imports ``hand_back`` from here; it becomes
``bounce_foreign`` there, and this module goes.
"""

from __future__ import annotations

from aio_pika.abc import AbstractChannel, AbstractIncomingMessage

from jobplane.workers.bounce import MAX_BOUNCES, BounceFailed, bounces_of, publish_bounce

HandBackFailed = BounceFailed


async def hand_back(
    channel: AbstractChannel,
    message: AbstractIncomingMessage,
    queue: str | None,
    *,
    timeout: float = 10.0,
) -> int:
    """Publish a bounced copy of ``message``; the caller acks the original.

    At the bounce limit nothing is published and :class:`BounceFailed` is
    raised: the caller's nack with requeue then counts towards the queue's
    delivery limit, which dead-letters the message.
    """
    if bounces_of(message) >= MAX_BOUNCES:
        raise BounceFailed(f"bounced {MAX_BOUNCES} times; left to the delivery limit")
    return await publish_bounce(channel, message, queue, timeout=timeout)
