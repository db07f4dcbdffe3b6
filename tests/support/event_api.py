"""EventService through the generated stubs, for tests of the server side of events."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aio_pika
import grpc
from google.protobuf import struct_pb2

from jobplane.v1 import events_pb2, events_pb2_grpc
from tests.support.stack import Stack, eventually

# How long a test waits for one message of a stream before it fails.
STREAM_WAIT = 20.0


def request(event_type: str = "artifact.created", **fields: Any) -> events_pb2.PublishEventRequest:
    """A valid PublishEventRequest with a fresh event_id, ``fields`` set over it."""
    payload = fields.pop("payload", {"artifact": "builds/42/app.tar"})
    message = events_pb2.PublishEventRequest(event_id=str(uuid.uuid4()), event_type=event_type)
    if isinstance(payload, dict):
        message.payload.update(payload)
    elif isinstance(payload, struct_pb2.Struct):
        message.payload.CopyFrom(payload)
    for name, value in fields.items():
        if name == "timestamp":
            message.timestamp.CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


@dataclass
class EventApi:
    """The EventService of a stack's server, called as one tenant."""

    channel: grpc.aio.Channel
    stub: events_pb2_grpc.EventServiceAsyncStub
    key: str

    def metadata(self, key: str | None = None, **extra: str) -> tuple[tuple[str, str], ...]:
        """The call's metadata: the key, and any ``extra`` pairs."""
        return (("authorization", f"Bearer {key or self.key}"), *extra.items())

    async def publish(
        self, message: events_pb2.PublishEventRequest, **extra: str
    ) -> events_pb2.Event:
        """PublishEvent."""
        return await self.stub.PublishEvent(message, metadata=self.metadata(**extra), timeout=30)

    def subscribe(
        self,
        patterns: list[str],
        *,
        after_cursor: str = "",
        start: int = 0,
        key: str | None = None,
    ) -> Subscription:
        """SubscribeEvents, read message by message."""
        call = self.stub.SubscribeEvents(
            events_pb2.SubscribeEventsRequest(
                type_patterns=patterns,
                after_cursor=after_cursor,
                start=events_pb2.SubscribeEventsRequest.Start.ValueType(start),
            ),
            metadata=self.metadata(key),
        )
        return Subscription(call)


class Subscription:
    """An open SubscribeEvents call."""

    def __init__(self, call: Any) -> None:
        self.call = call

    async def take(self, count: int) -> list[events_pb2.SubscribeEventsResponse]:
        """The next ``count`` responses (the stream never ends by itself)."""
        taken = []
        for _ in range(count):
            reply = await asyncio.wait_for(self.call.read(), STREAM_WAIT)
            assert reply is not grpc.aio.EOF, "the stream ended"
            taken.append(reply)
        return taken

    def cancel(self) -> None:
        """End the call from the client side."""
        self.call.cancel()


@contextlib.asynccontextmanager
async def event_api(stack: Stack, key: str | None = None) -> AsyncIterator[EventApi]:
    """An EventService client of ``stack``'s server."""
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        yield EventApi(channel, events_pb2_grpc.EventServiceStub(channel), key or stack.key)


@contextlib.asynccontextmanager
async def bound_queue(
    amqp_url: str, exchange: str, patterns: list[str]
) -> AsyncIterator[tuple[str, aio_pika.abc.AbstractQueue]]:
    """A queue of the test's own bound to the events exchange with ``patterns``."""
    name = f"test.events.{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        target = await channel.get_exchange(exchange, ensure=True)
        queue = await channel.declare_queue(name, durable=True)
        for pattern in patterns:
            await queue.bind(target, routing_key=pattern)
        try:
            yield name, queue
        finally:
            await queue.delete(if_unused=False, if_empty=False)


async def all_published(stack: Stack) -> None:
    """Until the relay has published every outbox row and every event."""

    async def done() -> bool:
        pending = await stack.scalar(
            "SELECT (SELECT count(*) FROM outbox WHERE published_at IS NULL AND failed_at IS NULL)"
            " + (SELECT count(*) FROM events e, event_relay r"
            " WHERE (e.txid, e.seq) > (r.txid, r.seq))"
        )
        return int(pending) == 0

    await eventually(done, timeout=20)
