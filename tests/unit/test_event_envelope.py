"""The event envelope on the wire: exact field names, round trips, refusals with a field."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import aio_pika
import pytest
from pamqp import commands
from pamqp.frame import marshal
from pamqp.header import ContentHeader

from jobplane.events import (
    EVENT_VERSION,
    MAX_EVENT_BYTES,
    Event,
    EventError,
    amqp_properties,
    decode,
    encode,
    matches,
    validate_pattern,
)
from jobplane.workers.relay import spec_properties

TENANT = uuid.UUID("7d3c9d2e-4a51-4c8e-9d7e-0d6f1f1b2a33")
EVENT_ID = uuid.UUID("01937a2e-5b7c-7f00-8a1b-2c3d4e5f6a7b")


def make(**changes: Any) -> Event:
    fields: dict[str, Any] = {
        "event_id": EVENT_ID,
        "event_type": "artifact.created",
        "timestamp": datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC),
        "tenant_id": TENANT,
        "project_id": "proj-7",
        "correlation_id": "corr-1",
        "causation_id": "01937a2e-0000-7000-8000-000000000001",
        "payload": {"artifact": "a/b", "size": 12, "tags": ["x"], "ok": True, "ratio": 0.5},
    }
    fields.update(changes)
    return Event(**fields)


def test_the_wire_format_has_exactly_the_envelope_fields_in_order() -> None:
    body = encode(make())
    assert json.loads(body) == {
        "v": 1,
        "event_id": "01937a2e-5b7c-7f00-8a1b-2c3d4e5f6a7b",
        "event_type": "artifact.created",
        "timestamp": "2026-11-30T12:00:00.123456Z",
        "tenant_id": "7d3c9d2e-4a51-4c8e-9d7e-0d6f1f1b2a33",
        "project_id": "proj-7",
        "correlation_id": "corr-1",
        "causation_id": "01937a2e-0000-7000-8000-000000000001",
        "payload": {"artifact": "a/b", "size": 12, "tags": ["x"], "ok": True, "ratio": 0.5},
    }
    assert list(json.loads(body)) == [
        "v",
        "event_id",
        "event_type",
        "timestamp",
        "tenant_id",
        "project_id",
        "correlation_id",
        "causation_id",
        "payload",
    ]
    assert body.startswith(b'{"v":1,"event_id":')


def test_unset_optional_fields_are_written_as_null() -> None:
    data = json.loads(encode(make(project_id=None, causation_id=None)))
    assert data["project_id"] is None
    assert data["causation_id"] is None


def test_round_trip_keeps_every_field() -> None:
    event = make(payload={"nested": {"list": [1, 2.5, None, "ü", {"deep": False}]}})
    assert decode(encode(event)) == event


def test_timestamps_are_utc_with_z_and_offsets_are_read() -> None:
    plus_two = timezone(timedelta(hours=2))
    event = make(timestamp=datetime(2026, 11, 30, 14, 0, tzinfo=plus_two))
    assert event.timestamp == datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert event.timestamp.tzinfo is UTC
    assert json.loads(encode(event))["timestamp"] == "2026-11-30T12:00:00.000000Z"
    data = json.loads(encode(event))
    data["timestamp"] = "2026-11-30T13:00:00.5+01:00"
    assert decode(json.dumps(data).encode()).timestamp == datetime(
        2026, 11, 30, 12, 0, 0, 500000, tzinfo=UTC
    )
    data["timestamp"] = "2026-11-30T12:00:00.123456789Z"
    assert decode(json.dumps(data).encode()).timestamp.microsecond == 123456


def test_unknown_keys_are_ignored_and_missing_optionals_are_unset() -> None:
    data = json.loads(encode(make()))
    data["added_later"] = {"anything": 1}
    del data["project_id"], data["causation_id"]
    event = decode(json.dumps(data).encode())
    assert event.project_id is None and event.causation_id is None
    assert event.event_id == EVENT_ID


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"v": 2}, "v"),
        ({"v": True}, "v"),
        ({"v": None}, "v"),
        ({"event_id": "not-a-uuid"}, "event_id"),
        ({"event_id": "00000000-0000-0000-0000-000000000000"}, "event_id"),
        ({"event_id": 5}, "event_id"),
        ({"event_type": "Artifact.Created"}, "event_type"),
        ({"event_type": "job.*"}, "event_type"),
        ({"event_type": "a..b"}, "event_type"),
        ({"event_type": "x" * 129}, "event_type"),
        ({"event_type": "job.started\n"}, "event_type"),
        ({"event_type": None}, "event_type"),
        ({"timestamp": "2026-11-30 12:00:00Z"}, "timestamp"),
        ({"timestamp": "2026-11-30T12:00:00"}, "timestamp"),
        ({"timestamp": "2026-13-30T12:00:00Z"}, "timestamp"),
        ({"timestamp": 1764504000}, "timestamp"),
        ({"tenant_id": "tenant-a"}, "tenant_id"),
        ({"project_id": ""}, "project_id"),
        ({"project_id": 7}, "project_id"),
        ({"correlation_id": ""}, "correlation_id"),
        ({"correlation_id": None}, "correlation_id"),
        ({"correlation_id": "c" * 256}, "correlation_id"),
        ({"correlation_id": "é" * 128}, "correlation_id"),
        ({"correlation_id": "a\x01b"}, "correlation_id"),
        ({"causation_id": "\u0000"}, "causation_id"),
        ({"payload": None}, "payload"),
        ({"payload": [1, 2]}, "payload"),
        ({"payload": {"k": "a\u0000b"}}, "payload"),
        ({"payload": {"a\u0000": 1}}, "payload"),
        ({"payload": {"k": "\ud800"}}, "payload"),
    ],
)
def test_a_bad_field_is_refused_by_name(change: dict[str, Any], field: str) -> None:
    data = json.loads(encode(make()))
    data.update(change)
    with pytest.raises(EventError) as caught:
        decode(json.dumps(data).encode())
    assert caught.value.field == field


@pytest.mark.parametrize(
    "body",
    [b"", b"not json", b"[1]", b'"event"', b"\xff\xfe", b"null", b"[" * 5000 + b"]" * 5000],
)
def test_a_body_that_is_not_an_event_is_refused(body: bytes) -> None:
    with pytest.raises(EventError):
        decode(body)


def test_non_finite_numbers_are_refused_both_ways() -> None:
    data = encode(make()).replace(b'"size":12', b'"size":NaN')
    with pytest.raises(EventError) as caught:
        decode(data)
    assert caught.value.field == "payload"
    with pytest.raises(EventError) as caught:
        make(payload={"x": float("inf")})
    assert caught.value.field == "payload"


def test_payload_depth_is_bounded() -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(31):
        node["d"] = {}
        node = node["d"]
    make(payload=deep)  # 32 objects deep: the limit
    node["d"] = {}
    with pytest.raises(EventError) as caught:
        make(payload=deep)
    assert caught.value.field == "payload"


def test_payload_holds_json_values_only() -> None:
    with pytest.raises(EventError) as caught:
        make(payload={"when": datetime.now(UTC)})
    assert caught.value.field == "payload"
    with pytest.raises(EventError):
        make(payload={1: "key is not a string"})


def test_size_is_bounded_on_both_sides() -> None:
    event = make(payload={"blob": "x" * 1000})
    size = len(encode(event))
    assert len(encode(event, max_bytes=size)) == size
    with pytest.raises(EventError) as caught:
        encode(event, max_bytes=size - 1)
    assert caught.value.field == "payload"
    with pytest.raises(EventError):
        decode(encode(event), max_bytes=size - 1)
    with pytest.raises(EventError):
        decode(b" " * (MAX_EVENT_BYTES + 1))


def test_a_naive_timestamp_is_refused() -> None:
    with pytest.raises(EventError) as caught:
        make(timestamp=datetime(2026, 11, 30, 12, 0))
    assert caught.value.field == "timestamp"


def test_new_starts_a_chain_or_follows_its_cause() -> None:
    first = Event.new("deployment.started", {"env": "prod"}, tenant_id=TENANT)
    assert first.correlation_id == str(first.event_id)
    assert first.causation_id is None
    assert first.event_id.version == 7
    assert first.timestamp.tzinfo is UTC
    then = Event.new("deployment.completed", tenant_id=TENANT, caused_by=first)
    assert then.correlation_id == first.correlation_id
    assert then.causation_id == str(first.event_id)
    assert then.event_id != first.event_id
    assert then.payload == {}


def test_amqp_properties_mirror_the_body_and_fit_a_frame() -> None:
    event = make()
    props = amqp_properties(event, traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    assert props["message_id"] == str(event.event_id)
    assert props["type"] == event.event_type
    assert props["correlation_id"] == event.correlation_id
    assert props["content_type"] == "application/json"
    assert props["delivery_mode"] == 2
    assert props["headers"] == {
        "causation_id": event.causation_id,
        "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
    }
    assert amqp_properties(make(causation_id=None))["headers"] == {}
    # The largest ids and type still make a header frame AMQP accepts
    # (every connection may use at least 4096-byte frames).
    biggest = make(
        event_type="t" * 128,
        correlation_id="c" * 255,
        causation_id="k" * 255,
        project_id="p" * 255,
    )
    message = aio_pika.Message(encode(biggest), **amqp_properties(biggest, traceparent="t" * 55))
    header = ContentHeader(0, len(message.body), message.properties)
    assert len(marshal(header, 1)) < 4096
    method = commands.Basic.Publish(exchange="jobplane.events", routing_key=biggest.event_type)
    assert marshal(method, 1)


def test_version_constant_is_what_is_written() -> None:
    assert json.loads(encode(make()))["v"] == EVENT_VERSION


@pytest.mark.parametrize("pattern", ["#", "*", "job.*", "artifact.#", "a.*.c", "x-y.z_1"])
def test_patterns_in_topic_syntax_are_accepted(pattern: str) -> None:
    assert validate_pattern(pattern) == pattern


@pytest.mark.parametrize("pattern", ["", "Job.*", "job.", "job.**", "job*", "a b", "x" * 256])
def test_other_patterns_are_refused(pattern: str) -> None:
    with pytest.raises(EventError) as caught:
        validate_pattern(pattern)
    assert caught.value.field == "type_patterns"


def test_patterns_mean_what_the_broker_makes_of_them() -> None:
    assert matches(["job.*"], "job.started")
    assert not matches(["job.*"], "artifact.created")
    assert not matches(["job.*"], "job.started.late")
    assert matches(["artifact.#", "job.#"], "job.started.late")
    assert matches(["#"], "anything.at.all")
    assert not matches([], "job.started")


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"causation_id": None},
        {"correlation_id": "é" * 127 + "c"},
        {"event_type": "a" * 128},
    ],
    ids=["full", "no-causation", "long-correlation", "long-type"],
)
@pytest.mark.parametrize(
    "trace", [(None, None), ("00-" + "a" * 32 + "-" + "b" * 16 + "-01", "k=v")]
)
def test_the_feeds_properties_are_what_aio_pika_would_send(
    changes: dict[str, Any], trace: tuple[str | None, str | None]
) -> None:
    """The relay's event feed builds the AMQP properties itself (no aio-pika
    Message); on the wire they are byte for byte aio-pika's."""
    event = make(**changes)
    traceparent, tracestate = trace
    properties = amqp_properties(event, traceparent=traceparent, tracestate=tracestate)
    body = encode(event)
    ours = ContentHeader(0, len(body), spec_properties(properties))
    theirs = ContentHeader(0, len(body), aio_pika.Message(body, **properties).properties)
    assert marshal(ours, 1) == marshal(theirs, 1)
    # And the strings a consumer reads are the envelope's.
    read = spec_properties(properties)
    assert (read.message_id, read.message_type, read.correlation_id) == (
        str(event.event_id),
        event.event_type,
        event.correlation_id,
    )
    assert read.delivery_mode == 2 and read.app_id == "jobplane"
