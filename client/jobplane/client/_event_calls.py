"""The domain event calls of :class:`~jobplane.client.AsyncClient`: publish and subscribe.

How a subscription resumes after a lost stream is in ``subscription``; this
part builds the requests and opens the stream.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import grpc

from jobplane.client._channel import ChannelBase
from jobplane.client.subscription import EventSubscription, SubscribeStart, domain_event_of
from jobplane.convert import struct_from_dict
from jobplane.errors import InvalidArgument
from jobplane.events.envelope import Event
from jobplane.v1 import events_pb2


class EventCalls(ChannelBase):
    """The EventService calls."""

    async def publish(
        self,
        event_type: str,
        payload: dict[str, Any] | None = None,
        *,
        event_id: uuid.UUID | str | None = None,
        timestamp: datetime | None = None,
        project_id: str | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        timeout: float | None = None,
    ) -> Event:
        """Publish a domain event for the caller's tenant and return it as stored.

        ``event_id`` is the idempotency key: when None, a fresh UUID is made
        once and kept across the call's own retries, so a publish repeated
        after a lost reply stores the event once. Publishing an event_id again
        with the same event returns the stored one and writes nothing; with a
        different event it raises :class:`~jobplane.errors.EventIdReused`.

        ``timestamp`` (timezone-aware) is when the fact happened; None means
        when the server accepts it. ``correlation_id`` None starts a chain
        (the server uses the event's own id). ``timeout``, else the client's,
        bounds the call with its retries.
        """
        request = events_pb2.PublishEventRequest(
            event_id=_event_id_text(event_id),
            event_type=event_type,
            correlation_id=correlation_id or "",
            payload=struct_from_dict(payload),
        )
        if timestamp is not None:
            if timestamp.utcoffset() is None:
                raise InvalidArgument(
                    "timestamp must be a timezone-aware datetime", field="timestamp"
                )
            request.timestamp.FromDatetime(timestamp)
        if project_id is not None:
            request.project_id = project_id
        if causation_id is not None:
            request.causation_id = causation_id
        stored = await self._call(
            self._get_event_stub().PublishEvent, request, repeatable=True, timeout=timeout
        )
        return domain_event_of(stored)

    def subscribe(
        self,
        patterns: str | Iterable[str],
        *,
        after_cursor: str | None = None,
        start: SubscribeStart = "earliest",
    ) -> EventSubscription:
        """The caller's events whose type matches any of ``patterns``, in commit order.

        Patterns are in AMQP topic syntax (``job.*``, ``artifact.#``, ``#``).
        The subscription yields ``(event, cursor)`` items (
        :class:`~jobplane.client.SubscribedEvent`): first the stored events
        after ``after_cursor`` — or, without one, from ``start``:
        ``"earliest"`` (every event the server keeps) or ``"latest"`` (those
        committed after the call) — then live ones; it does not end by itself.
        It resumes by itself after a lost stream, from the last cursor it
        delivered, with no gap and no repeat, within :attr:`watch_retry`; its
        ``cursor`` attribute is that cursor, to store and resume from later.

        With ``start="latest"``, a stream lost before its first event is
        opened again at the latest event, and events committed in between are
        not seen: to never miss one, resume from a stored cursor.
        """
        chosen = [patterns] if isinstance(patterns, str) else list(patterns)
        return EventSubscription(
            self._open_subscription,
            chosen,
            after_cursor=after_cursor,
            start=start,
            retry=self._watch_retry,
            closed=lambda: self._closed,
        )

    def _open_subscription(
        self, request: events_pb2.SubscribeEventsRequest
    ) -> grpc.aio.UnaryStreamCall[
        events_pb2.SubscribeEventsRequest, events_pb2.SubscribeEventsResponse
    ]:
        return self._get_event_stub().SubscribeEvents(request, metadata=self._metadata)


def _event_id_text(event_id: uuid.UUID | str | None) -> str:
    """The event_id of a request: a new UUID, or the one given in canonical form.

    A string that is no UUID is sent as it is, for the server to refuse by name.
    """
    if event_id is None:
        return str(uuid.uuid4())
    if isinstance(event_id, uuid.UUID):
        return str(event_id)
    try:
        return str(uuid.UUID(event_id))
    except ValueError:
        return event_id
