"""Bouncing a message of ANOTHER deployment back to its queue, at no cost to it.

Not to be confused with a worker handing back a job of its own deployment
that it has no handler for: that goes through the outbox (ADR-0007). A bounce
never touches the database — it re-publishes the message unchanged — because
the message is not ours: no job of ours stands for it.

When two deployments (two databases) share a vhost and queue names, a worker
of one receives the other's messages. Rejecting one would dead-letter it; a
nack with requeue would count towards the quorum queue's delivery limit and
end in the dead-letter exchange all the same. Instead the worker publishes an
unchanged copy (with publisher confirms) to the queue it came from, and only
then acks the original: the copy starts with a fresh delivery count.

A copy carries how many times it was bounced (``x-jobplane-bounces``). After
:data:`MAX_BOUNCES` the message is dead-lettered instead, with an error naming
both deployments: a message of a deployment that no longer exists (or has no
worker for a long time) must not circle for ever. Its own deployment still
ends the job: that deployment's sweeper re-publishes a dispatch the broker
lost. Before each bounce the worker waits a little (growing with the count, at
most 100 ms): enough to keep a stranger's circling messages cheap, short
enough not to hold the delivery for long.
"""

from __future__ import annotations

import asyncio
import enum
from typing import Any

import aio_pika
import aiormq
import structlog
from aio_pika.abc import AbstractChannel

from jobplane.envelope import DEPLOYMENT_HEADER
from jobplane.workers.inbound import Delivery

log = structlog.get_logger("jobplane.worker")

BOUNCES_HEADER = "x-jobplane-bounces"
# The header of the same count before it was renamed: a message already
# circling when workers are upgraded keeps its count.
_OLD_BOUNCES_HEADER = "x-jobplane-handbacks"
# At most 100 ms a bounce, so about 100 s of bouncing in all (plus the time in
# the queue) before a message of a deployment with no worker is dead-lettered.
MAX_BOUNCES = 1000
_MAX_DELAY = 0.1


class BounceFailed(Exception):
    """The broker did not confirm the copy; the original was not settled."""


class Bounced(enum.Enum):
    """What :func:`bounce_foreign` did with a message."""

    REQUEUED = "requeued"  # a copy is back in the queue; the original is acked
    DEAD_LETTERED = "dead_lettered"  # bounced too often: rejected to the dead-letter exchange


def bounce_delay(bounces: int) -> float:
    """Seconds to wait before bouncing a message already bounced ``bounces`` times."""
    return min(0.005 * 2.0 ** min(bounces, 10), _MAX_DELAY)


def bounces_of(message: Delivery) -> int:
    """How many times ``message`` has been bounced."""
    headers = message.headers or {}
    return max(_count(headers.get(BOUNCES_HEADER)), _count(headers.get(_OLD_BOUNCES_HEADER)))


def _count(value: Any) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0


async def bounce_foreign(
    channel: AbstractChannel,
    message: Delivery,
    queue: str | None,
    *,
    this_deployment: str | None,
    limit: int = MAX_BOUNCES,
    timeout: float = 10.0,
) -> tuple[Bounced, int]:
    """Bounce ``message`` (another deployment's) back to ``queue`` and settle it.

    Returns what was done and the message's bounce count. Below ``limit``
    bounces, a copy is published (see :func:`publish_bounce`) and then the
    original acked; at ``limit`` the original is rejected without requeue, so
    the queue's dead-letter exchange takes it, and an error names both
    deployments. Raises (:class:`BounceFailed`, or the broker's error) with
    the original unsettled when the copy was not confirmed: the caller nacks
    it with requeue.
    """
    bounces = bounces_of(message)
    if bounces >= limit:
        log.error(
            "job.message.bounce_limit",
            message_id=message.message_id,
            owner=(message.headers or {}).get(DEPLOYMENT_HEADER),
            this=this_deployment,
            bounces=bounces,
            queue=queue,
            hint="no worker of the owning deployment took it; dead-lettered",
        )
        await message.reject(requeue=False)
        return Bounced.DEAD_LETTERED, bounces
    bounces = await publish_bounce(channel, message, queue, timeout=timeout)
    await message.ack()
    return Bounced.REQUEUED, bounces


async def publish_bounce(
    channel: AbstractChannel,
    message: Delivery,
    queue: str | None,
    *,
    timeout: float = 10.0,
) -> int:
    """Publish a copy of ``message`` to ``queue``; returns its bounce count.

    The original is left to the caller. The copy goes straight to the queue
    the message was consumed from (through the default exchange), not through
    the jobs exchange again: with overlapping bindings that would put a copy
    in every matching queue at every bounce. Without a ``queue`` it goes
    where the original was published.
    """
    bounces = bounces_of(message)
    await asyncio.sleep(bounce_delay(bounces))
    headers = {k: v for k, v in (message.headers or {}).items() if k != _OLD_BOUNCES_HEADER}
    properties = message.properties
    copy = aio_pika.Message(
        message.body,
        headers={**headers, BOUNCES_HEADER: bounces + 1},
        content_type=properties.content_type,
        content_encoding=properties.content_encoding,
        delivery_mode=properties.delivery_mode,
        priority=properties.priority,
        correlation_id=properties.correlation_id,
        reply_to=properties.reply_to,
        message_id=properties.message_id,
        timestamp=properties.timestamp,
        type=properties.message_type,
        app_id=properties.app_id,
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
        raise BounceFailed(f"not confirmed: {type(confirmation).__name__}")
    return bounces + 1
