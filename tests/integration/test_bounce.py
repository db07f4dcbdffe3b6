"""A message of another deployment is bounced back unchanged, a bounded number of times.

After :data:`MAX_BOUNCES` it is dead-lettered: a message of a deployment that
no longer exists must not circle between our workers for ever.
"""

from __future__ import annotations

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue

from jobplane.envelope import DEPLOYMENT_HEADER
from jobplane.topology import Topology, declare
from jobplane.workers.bounce import BOUNCES_HEADER, MAX_BOUNCES, Bounced, bounce_foreign
from jobplane.workers.inbound import Delivery
from tests.support.queues import ready_count
from tests.support.stack import eventually


async def _next(queue: AbstractQueue) -> AbstractIncomingMessage:
    message = await queue.get(no_ack=False, fail=False, timeout=5)
    assert message is not None
    return message


async def _delivery(channel: AbstractChannel, name: str) -> Delivery:
    """The next message of queue ``name`` as the worker holds a delivery."""
    raw = await channel.get_underlay_channel()
    assert isinstance(raw, aiormq.Channel)
    message = await raw.basic_get(name, no_ack=False, timeout=5)
    assert isinstance(message.delivery, aiormq.spec.Basic.GetOk)
    return Delivery(message, name)


async def test_a_foreign_message_is_bounced_then_dead_lettered_at_the_cap(
    amqp_url: str, topology: Topology
) -> None:
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await declare(channel, topology)
        name = topology.queues[0].name
        queue = await channel.get_queue(name, ensure=False)
        for message_id, bounces in (("young", 3), ("old", MAX_BOUNCES)):
            await channel.default_exchange.publish(
                aio_pika.Message(
                    b'{"v": 1}',
                    message_id=message_id,
                    correlation_id="c-1",
                    content_type="application/json",
                    content_encoding="identity",
                    type="their.type",
                    app_id="their-app",
                    priority=3,
                    headers={DEPLOYMENT_HEADER: "theirs", BOUNCES_HEADER: bounces},
                ),
                routing_key=name,
            )

        young = await _delivery(channel, name)
        assert await bounce_foreign(channel, young, name, this_deployment="ours") == (
            Bounced.REQUEUED,
            4,
        )
        old = await _delivery(channel, name)
        assert old.message_id == "old"
        assert await bounce_foreign(channel, old, name, this_deployment="ours") == (
            Bounced.DEAD_LETTERED,
            MAX_BOUNCES,
        )

        # The copy: same body and ids, one more bounce, a fresh delivery.
        copy = await _next(queue)
        assert (copy.message_id, copy.body, copy.correlation_id) == ("young", b'{"v": 1}', "c-1")
        # Every property the publisher set is the copy's too.
        assert (copy.content_type, copy.content_encoding, copy.type, copy.app_id) == (
            "application/json",
            "identity",
            "their.type",
            "their-app",
        )
        assert copy.priority == 3
        assert copy.headers[BOUNCES_HEADER] == 4 and copy.headers[DEPLOYMENT_HEADER] == "theirs"
        assert not copy.redelivered
        await copy.ack()
        assert await queue.get(no_ack=False, fail=False, timeout=5) is None

        async def dead_lettered() -> bool:
            return await ready_count(amqp_url, topology.failed_queue) == 1

        await eventually(dead_lettered)
