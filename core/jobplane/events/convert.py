"""Between :class:`~jobplane.events.Event` and the protobuf messages of events.proto."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from jobplane.convert import dict_from_struct, struct_from_dict, timestamp
from jobplane.events.envelope import Event, EventError, parse_uuid
from jobplane.v1 import events_pb2


def event_to_pb(event: Event) -> events_pb2.Event:
    """The Event message of an event."""
    message = events_pb2.Event(
        event_id=str(event.event_id),
        event_type=event.event_type,
        timestamp=timestamp(event.timestamp),
        tenant_id=str(event.tenant_id),
        correlation_id=event.correlation_id,
        payload=struct_from_dict(event.payload),
    )
    if event.project_id is not None:
        message.project_id = event.project_id
    if event.causation_id is not None:
        message.causation_id = event.causation_id
    return message


def event_from_pb(message: events_pb2.Event) -> Event:
    """The event an Event message holds; :class:`EventError` naming the field if it is
    not a valid one."""
    if not message.HasField("timestamp"):
        raise EventError("timestamp is required", field="timestamp")
    return Event(
        event_id=parse_uuid(message.event_id, "event_id"),
        event_type=message.event_type,
        timestamp=_from_timestamp(message.timestamp, "timestamp"),
        tenant_id=parse_uuid(message.tenant_id, "tenant_id"),
        project_id=message.project_id if message.HasField("project_id") else None,
        correlation_id=message.correlation_id,
        causation_id=message.causation_id if message.HasField("causation_id") else None,
        payload=dict_from_struct(message.payload),
    )


def event_from_request(
    request: events_pb2.PublishEventRequest, *, tenant_id: uuid.UUID, now: datetime | None = None
) -> Event:
    """The event a PublishEventRequest asks to publish, for the caller's tenant.

    Applies the request's defaults (events.proto): no timestamp means ``now``,
    no correlation id means the event's own id, no payload an empty object.
    :class:`EventError` names the request field at fault.
    """
    if not request.event_id:
        raise EventError("event_id is required (a UUID the publisher chooses)", field="event_id")
    event_id = parse_uuid(request.event_id, "event_id")
    if request.HasField("timestamp"):
        when = _from_timestamp(request.timestamp, "timestamp")
    else:
        when = now or datetime.now(UTC)
    return Event(
        event_id=event_id,
        event_type=request.event_type,
        timestamp=when,
        tenant_id=tenant_id,
        project_id=request.project_id if request.HasField("project_id") else None,
        correlation_id=request.correlation_id or str(event_id),
        causation_id=request.causation_id if request.HasField("causation_id") else None,
        payload=dict_from_struct(request.payload),
    )


def _from_timestamp(message: timestamp_pb2.Timestamp, field: str) -> datetime:
    try:
        return message.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise EventError(f"{field} is not a valid Timestamp", field=field) from None
