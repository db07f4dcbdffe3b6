"""Domain events: facts that happened, on the same backbone as jobs (docs/events.md).

:class:`Event` is the envelope every service reads; :func:`encode` and
:func:`decode` are its JSON on RabbitMQ, and :func:`amqp_properties` the
properties it is published with. :class:`Consumer` applies the events of a
queue to a service's own database, each one once, through the inbox table
that :func:`ensure_inbox` creates.

Example::

    from jobplane.events import Consumer, Event, ensure_inbox
    from sqlalchemy import text

    async def on_artifact(event: Event, conn) -> None:
        await conn.execute(
            text("INSERT INTO thumbnails (artifact) VALUES (:a)"),
            {"a": event.payload["artifact"]},
        )

    await ensure_inbox(engine)
    async with Consumer("thumbnailer", on_artifact, engine=engine,
                        amqp_url=amqp_url, patterns=["artifact.created"]):
        ...
"""

from __future__ import annotations

from jobplane.events.consumer import Consumer, ConsumerCounts, Handler
from jobplane.events.envelope import (
    CONTENT_TYPE,
    EVENT_VERSION,
    EXCHANGE,
    MAX_EVENT_BYTES,
    Event,
    EventError,
    amqp_properties,
    decode,
    encode,
    matches,
    validate_event_type,
    validate_pattern,
)
from jobplane.events.inbox import INBOX_TABLE, ensure_inbox, prune_inbox

__all__ = [
    "CONTENT_TYPE",
    "EVENT_VERSION",
    "EXCHANGE",
    "INBOX_TABLE",
    "MAX_EVENT_BYTES",
    "Consumer",
    "ConsumerCounts",
    "Event",
    "EventError",
    "Handler",
    "amqp_properties",
    "decode",
    "encode",
    "ensure_inbox",
    "matches",
    "prune_inbox",
    "validate_event_type",
    "validate_pattern",
]
