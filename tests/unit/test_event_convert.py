"""Events between Python and protobuf: every field both ways, the request's defaults."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from google.protobuf import struct_pb2, timestamp_pb2

from jobplane.events import Event, EventError
from jobplane.events.convert import event_from_pb, event_from_request, event_to_pb
from jobplane.v1 import events_pb2

TENANT = uuid.UUID("7d3c9d2e-4a51-4c8e-9d7e-0d6f1f1b2a33")
WHEN = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)


def test_every_field_round_trips_through_the_message() -> None:
    event = Event(
        event_id=uuid.uuid4(),
        event_type="artifact.created",
        timestamp=WHEN,
        tenant_id=TENANT,
        project_id="p-1",
        correlation_id="c-1",
        causation_id="k-1",
        payload={"n": 5, "f": 0.25, "s": "x", "l": [1, {"b": None}], "t": True},
    )
    message = event_to_pb(event)
    assert message.event_id == str(event.event_id)
    assert message.tenant_id == str(TENANT)
    assert message.timestamp.ToDatetime(tzinfo=UTC) == WHEN
    assert event_from_pb(events_pb2.Event.FromString(message.SerializeToString())) == event


def test_unset_optionals_stay_unset_and_empty_is_not_unset() -> None:
    event = Event.new("job.started", tenant_id=TENANT)
    message = event_to_pb(event)
    assert not message.HasField("project_id")
    assert not message.HasField("causation_id")
    back = event_from_pb(message)
    assert back.project_id is None and back.causation_id is None
    message.project_id = ""
    with pytest.raises(EventError) as caught:
        event_from_pb(message)
    assert caught.value.field == "project_id"


def test_a_message_without_a_timestamp_is_not_an_event() -> None:
    message = event_to_pb(Event.new("job.started", tenant_id=TENANT))
    message.ClearField("timestamp")
    with pytest.raises(EventError) as caught:
        event_from_pb(message)
    assert caught.value.field == "timestamp"


def test_a_request_gets_the_documented_defaults() -> None:
    event_id = uuid.uuid4()
    request = events_pb2.PublishEventRequest(event_id=str(event_id), event_type="deploy.done")
    event = event_from_request(request, tenant_id=TENANT, now=WHEN)
    assert event.event_id == event_id
    assert event.timestamp == WHEN
    assert event.tenant_id == TENANT
    assert event.correlation_id == str(event_id)
    assert event.causation_id is None and event.project_id is None
    assert event.payload == {}


def test_a_request_keeps_what_the_publisher_gave() -> None:
    given = timestamp_pb2.Timestamp()
    given.FromDatetime(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))
    payload = struct_pb2.Struct()
    payload.update({"env": "prod", "n": 3})
    request = events_pb2.PublishEventRequest(
        event_id=str(uuid.uuid4()),
        event_type="deployment.completed",
        timestamp=given,
        project_id="web",
        correlation_id="chain-9",
        causation_id="cause-1",
        payload=payload,
    )
    event = event_from_request(request, tenant_id=TENANT, now=WHEN)
    assert event.timestamp == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert (event.project_id, event.correlation_id, event.causation_id) == (
        "web",
        "chain-9",
        "cause-1",
    )
    assert event.payload == {"env": "prod", "n": 3}


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"event_type": "x.y"}, "event_id"),
        ({"event_id": "nope", "event_type": "x.y"}, "event_id"),
        ({"event_id": str(uuid.uuid4())}, "event_type"),
        ({"event_id": str(uuid.uuid4()), "event_type": "X"}, "event_type"),
        (
            {"event_id": str(uuid.uuid4()), "event_type": "x", "correlation_id": "a\nb"},
            "correlation_id",
        ),
        ({"event_id": str(uuid.uuid4()), "event_type": "x", "causation_id": ""}, "causation_id"),
        ({"event_id": str(uuid.uuid4()), "event_type": "x", "project_id": "p" * 256}, "project_id"),
        (
            {
                "event_id": str(uuid.uuid4()),
                "event_type": "x",
                "timestamp": timestamp_pb2.Timestamp(seconds=-(10**12)),
            },
            "timestamp",
        ),
    ],
)
def test_a_bad_request_names_its_field(fields: dict[str, object], field: str) -> None:
    request = events_pb2.PublishEventRequest(**fields)  # type: ignore[arg-type]
    with pytest.raises(EventError) as caught:
        event_from_request(request, tenant_id=TENANT)
    assert caught.value.field == field


def test_non_finite_numbers_in_a_request_payload_are_refused() -> None:
    payload = struct_pb2.Struct()
    payload.update({"x": float("nan")})
    request = events_pb2.PublishEventRequest(
        event_id=str(uuid.uuid4()), event_type="x", payload=payload
    )
    with pytest.raises(EventError) as caught:
        event_from_request(request, tenant_id=TENANT)
    assert caught.value.field == "payload"
