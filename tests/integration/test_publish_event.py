"""PublishEvent: stored once, published once by the relays' feed, refused whole when bad.

Through the generated stubs, on a real server, relay, Postgres and RabbitMQ.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
import structlog
from google.protobuf import struct_pb2, timestamp_pb2
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from structlog.testing import capture_logs

from jobplane.events import Event, decode, encode
from jobplane.events.convert import event_from_pb
from jobplane.server.service import MAX_PAYLOAD_DEPTH
from jobplane.v1 import events_pb2
from jobplane.workers import relay_feed, relay_record
from tests.support.answers import check_refusal
from tests.support.event_api import EventApi, all_published, bound_queue, event_api, request
from tests.support.events import take_all
from tests.support.stack import Stack

# Server and relay; no worker (events need none).
pytestmark = pytest.mark.stack(worker=False)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
async def api(stack: Stack) -> AsyncIterator[EventApi]:
    async with event_api(stack) as client:
        yield client


async def counts(stack: Stack) -> dict[str, int]:
    """Events stored, and outbox rows (an event needs none: the relays read ``events``)."""
    return {
        table: int(await stack.scalar(f"SELECT count(*) FROM {table}"))
        for table in ("events", "outbox")
    }


async def test_a_bound_queue_receives_the_event_once_with_the_documented_properties(
    stack: Stack, api: EventApi, amqp_url: str
) -> None:
    async with bound_queue(amqp_url, stack.topology.events_exchange, ["artifact.*"]) as (name, _):
        sent = request(
            "artifact.created",
            project_id="web",
            correlation_id="chain-7",
            causation_id="cause-6",
            payload={"artifact": "builds/42/app.tar", "size": 18230},
        )
        sent.timestamp.FromDatetime(datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC))
        reply = await api.publish(sent, traceparent=TRACEPARENT, tracestate="vendor=x")
        event = event_from_pb(reply)
        assert event.event_id == uuid.UUID(sent.event_id)
        assert event.tenant_id == stack.tenant_id
        assert (event.project_id, event.correlation_id, event.causation_id) == (
            "web",
            "chain-7",
            "cause-6",
        )
        # The replay, as an SDK retry sends it: nothing new is written.
        before = await counts(stack)
        assert await api.publish(sent, traceparent=TRACEPARENT) == reply
        assert await counts(stack) == before == {"events": 1, "outbox": 0}
        # One no queue is bound for: published all the same, and dropped.
        await api.publish(request("deployment.completed"))

        await all_published(stack)
        (message,) = await take_all(amqp_url, name)
        assert decode(message.body) == event
        assert message.routing_key == "artifact.created"
        assert message.exchange == stack.topology.events_exchange
        assert message.content_type == "application/json"
        assert message.delivery_mode == 2  # persistent
        assert message.message_id == sent.event_id
        assert message.type == "artifact.created"
        assert message.correlation_id == "chain-7"
        assert message.app_id == "jobplane"
        assert message.timestamp == datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
        assert message.headers == {
            "causation_id": "cause-6",
            "traceparent": TRACEPARENT,
            "tracestate": "vendor=x",
        }
    # No bound queue is not an error: no row failed, none counted as returned.
    assert (
        await stack.scalar("SELECT count(*) FROM outbox WHERE failed_at IS NOT NULL OR returns > 0")
        == 0
    )
    assert stack.relay is not None and stack.relay.failed == 0


async def test_defaults_of_an_event_and_a_replay_without_a_time(
    stack: Stack, api: EventApi
) -> None:
    sent = events_pb2.PublishEventRequest(event_id=str(uuid.uuid4()), event_type="job.noted")
    reply = await api.publish(sent)
    event = event_from_pb(reply)
    assert event.correlation_id == sent.event_id
    assert event.causation_id is None and event.project_id is None
    assert event.payload == {}
    # Unset time means "when the server accepted it": a retry of the same
    # call, later, is the same event, and gets the stored time back.
    assert await api.publish(sent) == reply
    stored = event_from_pb(reply)
    at_that_time = events_pb2.PublishEventRequest()
    at_that_time.CopyFrom(sent)
    at_that_time.timestamp.CopyFrom(reply.timestamp)
    assert await api.publish(at_that_time) == reply
    assert stored.timestamp == event.timestamp
    assert await counts(stack) == {"events": 1, "outbox": 0}


@pytest.mark.parametrize(
    "change",
    [
        {"event_type": "artifact.deleted"},
        {"payload": {"artifact": "other"}},
        {"project_id": "web"},
        {"correlation_id": "another-chain"},
        {"causation_id": "cause"},
        {"timestamp": timestamp_pb2.Timestamp(seconds=1_700_000_000)},
    ],
    ids=lambda change: next(iter(change)),
)
async def test_the_same_event_id_with_a_different_event_is_refused(
    stack: Stack, api: EventApi, change: dict[str, Any]
) -> None:
    first = request("artifact.created")
    first.timestamp.FromSeconds(1_800_000_000)
    await api.publish(first)
    before = await counts(stack)
    again = events_pb2.PublishEventRequest()
    again.CopyFrom(first)
    for name, value in change.items():
        if name == "payload":
            again.payload.Clear()
            again.payload.update(value)
        elif name == "timestamp":
            again.timestamp.CopyFrom(value)
        else:
            setattr(again, name, value)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await api.publish(again)
    refusal = check_refusal(info.value)
    assert refusal.code is grpc.StatusCode.ALREADY_EXISTS
    assert refusal.reason == "EVENT_ID_REUSED"
    assert await counts(stack) == before


async def test_an_event_id_is_a_key_per_tenant(stack: Stack, api: EventApi) -> None:
    other = await stack.new_key("globex")
    sent = request("artifact.created")
    mine = await api.publish(sent)
    theirs = await api.stub.PublishEvent(sent, metadata=api.metadata(other), timeout=30)
    assert mine.tenant_id != theirs.tenant_id
    assert mine.event_id == theirs.event_id
    assert await counts(stack) == {"events": 2, "outbox": 0}


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


def _nested(depth: int) -> struct_pb2.Struct:
    """A payload ``depth`` objects deep, the payload itself counted."""
    message = struct_pb2.Struct()
    target = message.fields["k"]
    for _ in range(depth - 2):
        target = target.struct_value.fields["k"]
    target.struct_value.SetInParent()
    return message


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("no event_id", {"event_id": ""}, "event_id"),
    ("event_id not a UUID", {"event_id": "not-a-uuid"}, "event_id"),
    ("event_id upper case", {"event_id": str(uuid.uuid4()).upper()}, "event_id"),
    ("event_id in braces", {"event_id": "{" + str(uuid.uuid4()) + "}"}, "event_id"),
    ("event_id without dashes", {"event_id": uuid.uuid4().hex}, "event_id"),
    ("nil event_id", {"event_id": str(uuid.UUID(int=0))}, "event_id"),
    ("no event_type", {"event_type": ""}, "event_type"),
    ("event_type upper case", {"event_type": "Artifact.Created"}, "event_type"),
    ("event_type with a wildcard", {"event_type": "artifact.*"}, "event_type"),
    ("event_type with an empty word", {"event_type": "artifact..created"}, "event_type"),
    ("event_type too long", {"event_type": "a" * 129}, "event_type"),
    ("event_type with a newline", {"event_type": "artifact.created\n"}, "event_type"),
    ("empty project_id", {"project_id": ""}, "project_id"),
    ("project_id too long", {"project_id": "p" * 256}, "project_id"),
    ("project_id with a control character", {"project_id": "a\x01b"}, "project_id"),
    ("correlation_id too long", {"correlation_id": "\u00e9" * 128}, "correlation_id"),
    ("correlation_id with a NUL", {"correlation_id": "a\x00"}, "correlation_id"),
    ("correlation_id with DEL", {"correlation_id": "a\x7f"}, "correlation_id"),
    ("empty causation_id", {"causation_id": ""}, "causation_id"),
    ("causation_id too long", {"causation_id": "c" * 256}, "causation_id"),
    ("causation_id with a newline", {"causation_id": "a\nb"}, "causation_id"),
    ("payload with NUL", {"payload": _struct({"a": "x\x00"})}, "payload"),
    ("payload key with NUL", {"payload": _struct({"a\x00": 1})}, "payload"),
    ("payload with NaN", {"payload": _struct({"a": float("nan")})}, "payload"),
    ("payload with infinity", {"payload": _struct({"a": float("inf")})}, "payload"),
    ("payload nested too deep", {"payload": _nested(MAX_PAYLOAD_DEPTH + 1)}, "payload"),
    ("payload too large", {"payload": _struct({"a": "x" * 300_000})}, "payload"),
    ("time before 1970", {"timestamp": timestamp_pb2.Timestamp(seconds=-1)}, "timestamp"),
    (
        "time after 9999",
        {"timestamp": timestamp_pb2.Timestamp(seconds=253_402_300_800)},
        "timestamp",
    ),
    ("negative nanos", {"timestamp": timestamp_pb2.Timestamp(nanos=-1)}, "timestamp"),
    ("nanos too large", {"timestamp": timestamp_pb2.Timestamp(nanos=10**9)}, "timestamp"),
]


@pytest.mark.parametrize(("case", "fields", "field"), BAD, ids=[case for case, _, _ in BAD])
async def test_bad_input_is_refused_whole(
    stack: Stack, api: EventApi, case: str, fields: dict[str, Any], field: str
) -> None:
    sent = request(**{"event_type": "artifact.created", **fields})
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await api.publish(sent)
    refusal = check_refusal(info.value)
    assert refusal.code is grpc.StatusCode.INVALID_ARGUMENT, case
    assert refusal.field == field, (case, refusal.message)
    assert await counts(stack) == {"events": 0, "outbox": 0}


async def test_limits_of_the_fields_are_accepted(stack: Stack, api: EventApi) -> None:
    sent = request(
        "a" * 128,
        project_id="p" * 255,
        correlation_id="\u00e9" * 127 + "c",
        causation_id="c" * 255,
        payload=_nested(MAX_PAYLOAD_DEPTH),
    )
    sent.timestamp.FromSeconds(253_402_300_799)
    await api.publish(sent)
    earliest = request("artifact.created")
    earliest.timestamp.FromSeconds(0)
    await api.publish(earliest)
    await all_published(stack)
    assert stack.relay is not None and stack.relay.failed == 0
    assert stack.relay.events_published == 2


async def test_an_event_a_relay_cannot_publish_fails_alone(
    stack: Stack, api: EventApi, amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Events no broker can take (written around the checks) are passed over
    or failed, one by one; the events around them are published."""
    # Loggers not yet used, so that capture_logs sees the relay's lines.
    monkeypatch.setattr(relay_record, "log", structlog.get_logger("jobplane.relay"))
    monkeypatch.setattr(relay_feed, "log", structlog.get_logger("jobplane.relay"))
    with capture_logs() as logs:
        await _an_event_a_relay_cannot_publish_fails_alone(stack, api, amqp_url)
    failed = [line for line in logs if line["event"] == "relay.event.failed"]
    # Each outbox row given up on is one line naming the row, not a job.
    rows = sorted(
        (line for line in failed if "outbox_id" in line), key=lambda line: line["event_type"]
    )
    assert [(line["kind"], line["event_type"], line["code"]) for line in rows] == [
        ("event", "artifact.created", "DISPATCH_FAILED"),
        ("event", "artifact.moved", "DISPATCH_FAILED"),
    ]
    ids = await stack.scalar(
        "SELECT array_agg(CAST(id AS text)) FROM outbox WHERE failed_at IS NOT NULL"
    )
    assert {line["outbox_id"] for line in rows} == set(ids)
    assert all(line["job_failed"] is False and "job" not in line for line in rows)
    # The event the feed passes over names the event, and says where it stays.
    (passed_over,) = [line for line in failed if "outbox_id" not in line]
    assert passed_over["event_type"] == "x" * 300
    assert passed_over["hint"] == "AMQP cannot carry it; it stays in the events table"


async def _an_event_a_relay_cannot_publish_fails_alone(
    stack: Stack, api: EventApi, amqp_url: str
) -> None:
    async with bound_queue(amqp_url, stack.topology.events_exchange, ["#"]) as (name, _):
        assert stack.relay is not None
        await stack.relay.stop()
        first = await api.publish(request("artifact.created"))
        async with stack.engine.begin() as conn:
            # In the events table: a routing key AMQP cannot carry.
            await conn.exec_driver_sql(
                "INSERT INTO events (tenant_id, event_id, event_type, event_time, "
                "correlation_id, payload, request_hash) "
                f"VALUES ('{stack.tenant_id}', gen_random_uuid(), repeat('x', 300), now(), "
                "'c', '{}', '')"
            )
            # Outbox rows of kind event: a body that is not an event, and an
            # exchange that is not the topology's.
            body = encode(Event.new("artifact.moved", tenant_id=stack.tenant_id))
            await conn.execute(
                text(
                    "INSERT INTO outbox (id, tenant_id, kind, routing_key, body, exchange) "
                    "VALUES (gen_random_uuid(), :t, 'event', 'artifact.created', "
                    "'not an event', NULL), "
                    "(gen_random_uuid(), :t, 'event', 'artifact.moved', :body, 'elsewhere')"
                ),
                {"t": stack.tenant_id, "body": body},
            )
        last = await api.publish(request("artifact.deleted"))
        relay = await stack.start_relay()
        await all_published(stack)
        failed = await stack.scalar(
            "SELECT array_agg(last_error ORDER BY last_error) FROM outbox "
            "WHERE failed_at IS NOT NULL"
        )
        assert len(failed) == 2
        assert "not an event" in failed[0] or "not an event" in failed[1]
        assert any("elsewhere" in error for error in failed)
        assert relay.failed == 3
        messages = await take_all(amqp_url, name)
        assert [m.message_id for m in messages] == [first.event_id, last.event_id]
        # The one passed over stays for subscribers; the feed is past it.
        assert await stack.scalar("SELECT count(*) FROM events") == 3


async def test_the_outbox_holds_each_kind_to_its_columns(stack: Stack) -> None:
    """The CHECK of migration 0006: a dispatch needs its job, an event its body."""
    bad = [
        "INSERT INTO outbox (id, tenant_id, kind, routing_key) "
        "VALUES (gen_random_uuid(), :t, 'job.dispatch', 'demo.echo')",
        "INSERT INTO outbox (id, tenant_id, kind, routing_key) "
        "VALUES (gen_random_uuid(), :t, 'event', 'artifact.created')",
        "INSERT INTO outbox (id, tenant_id, kind, routing_key, body) "
        "VALUES (gen_random_uuid(), :t, 'stage', 'x', 'y')",
    ]
    for statement in bad:
        with pytest.raises(IntegrityError, match="outbox_kind_shape"):
            async with stack.engine.begin() as conn:
                await conn.execute(text(statement), {"t": stack.tenant_id})
