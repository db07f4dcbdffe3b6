"""Domain events: facts that happened, on the same backbone as jobs (docs/events.md).

:class:`Event` is the envelope every service reads; :func:`encode` and
:func:`decode` are its JSON on RabbitMQ, and :func:`amqp_properties` the
properties it is published with. :class:`Consumer` applies the events of a
queue to a service's own database, each one once, through the inbox table
that :func:`ensure_inbox` creates.

The consumer and the inbox (aio-pika, SQLAlchemy: the server install) are
imported on first use of one of their names, so that the SDK's use of
:mod:`jobplane.events.envelope` costs it nothing.

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

from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from jobplane.events.consumer import Consumer, ConsumerCounts, Handler
    from jobplane.events.inbox import INBOX_TABLE, ensure_inbox, prune_inbox

_FROM_CONSUMER = frozenset({"Consumer", "ConsumerCounts", "Handler"})
_FROM_INBOX = frozenset({"INBOX_TABLE", "ensure_inbox", "prune_inbox"})


def __getattr__(name: str) -> Any:
    if name in _FROM_CONSUMER:
        from jobplane.events import consumer

        return getattr(consumer, name)
    if name in _FROM_INBOX:
        from jobplane.events import inbox

        return getattr(inbox, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
