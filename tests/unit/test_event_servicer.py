"""PublishEvent over the servicer, without a server: what of the request (and of
the call's trace metadata) reaches the EventService, what the caller gets back,
and the refusal of an event time AMQP cannot carry, at both ends of its range;
and a SubscribeEvents stream that breaks."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime
from typing import Any, cast

import grpc
import pytest
from google.protobuf import timestamp_pb2
from google.rpc import error_details_pb2, status_pb2

from jobplane.errors import EventIdReused
from jobplane.events.convert import event_to_pb
from jobplane.events.envelope import Event
from jobplane.server import status as status_module
from jobplane.server.auth import CallGate
from jobplane.server.events import EventService, PublishRequest
from jobplane.server.limits import TenantLimiter, TenantLimits
from jobplane.server.servicer import EventServiceServicer
from jobplane.store.events import Position, StoredEvent
from jobplane.store.keys import KeyIdentity, KeyStore
from jobplane.v1 import events_pb2
from tests.support.logs import module_lines
from tests.support.servicer_context import Aborted, ServicerContext

_KEY = "the-key"
_SERVICE = "jobplane.v1.EventService"
_TENANT = uuid.UUID(int=5)
_EVENT = Event(
    event_id=uuid.UUID(int=9),
    event_type="artifact.created",
    timestamp=datetime(2026, 1, 1, tzinfo=UTC),
    tenant_id=_TENANT,
    correlation_id="c",
    payload={"stored": True},
)


class _Keys:
    async def resolve(self, key: str) -> KeyIdentity | None:
        return KeyIdentity(_TENANT, "key_0123456789abcdef") if key == _KEY else None


class _Details(grpc.HandlerCallDetails):
    def __init__(self, rpc: str = "PublishEvent") -> None:
        self.method = f"/{_SERVICE}/{rpc}"
        self.invocation_metadata = (("authorization", f"Bearer {_KEY}"),)


class _Events:
    """Stores every event as :data:`_EVENT`, or raises ``refusal``."""

    def __init__(self, refusal: Exception | None = None) -> None:
        self.published: list[tuple[uuid.UUID, PublishRequest]] = []
        self.refusal = refusal

    async def publish(self, tenant: uuid.UUID, request: PublishRequest) -> StoredEvent:
        self.published.append((tenant, request))
        if self.refusal is not None:
            raise self.refusal
        return StoredEvent(_EVENT, Position(1, 1))


async def _publish(
    request: events_pb2.PublishEventRequest,
    events: _Events,
    metadata: tuple[tuple[str, Any], ...] = (),
) -> events_pb2.Event:
    """PublishEvent as an admitted caller of the tenant would make it."""
    limiter = TenantLimiter(TenantLimits())
    gate = CallGate(_SERVICE, cast(KeyStore, _Keys()), limiter)
    servicer = EventServiceServicer(cast(EventService, events))

    async def call() -> events_pb2.Event:
        async def continuation(_details: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(servicer.PublishEvent)

        await gate.intercept_service(continuation, _Details())
        return await servicer.PublishEvent(request, ServicerContext(metadata))  # type: ignore[arg-type]

    return await asyncio.create_task(call())


def _refusal(aborted: Aborted) -> tuple[grpc.StatusCode, str, str | None]:
    (raw,) = (v for k, v in aborted.status.trailing_metadata if k == "grpc-status-details-bin")
    info = error_details_pb2.ErrorInfo()
    status_pb2.Status.FromString(raw).details[0].Unpack(info)
    return aborted.status.code, aborted.status.details, info.metadata.get("field")


async def test_every_field_of_an_event_reaches_the_service() -> None:
    events = _Events()
    request = events_pb2.PublishEventRequest(
        event_id="e-1",
        event_type="artifact.created",
        timestamp=timestamp_pb2.Timestamp(seconds=1_800_000_000, nanos=123_456_789),
        project_id="p",
        correlation_id="c-1",
        causation_id="cause",
    )
    request.payload.update({"n": 1})
    metadata = (("traceparent", "00-abc-01"), ("tracestate", "k=v"), ("other", "x"))
    assert await _publish(request, events, metadata) == event_to_pb(_EVENT)
    assert events.published == [
        (
            _TENANT,
            PublishRequest(
                event_id="e-1",
                event_type="artifact.created",
                timestamp=datetime(2027, 1, 15, 8, 0, 0, 123456, tzinfo=UTC),
                project_id="p",
                correlation_id="c-1",
                causation_id="cause",
                payload={"n": 1},
                traceparent="00-abc-01",
                tracestate="k=v",
            ),
        )
    ]


async def test_fields_left_unset_are_none_and_set_empty_ones_are_empty() -> None:
    events = _Events()
    await _publish(events_pb2.PublishEventRequest(event_type="a.b"), events)
    await _publish(
        events_pb2.PublishEventRequest(event_type="a.b", project_id="", causation_id=""),
        events,
        (("traceparent", b"binary"),),
    )
    assert [request for _, request in events.published] == [
        PublishRequest(event_id="", event_type="a.b"),
        PublishRequest(event_id="", event_type="a.b", project_id="", causation_id=""),
    ]


async def test_an_event_time_is_taken_from_1970_to_the_end_of_year_9999() -> None:
    events = _Events()
    for seconds, nanos in ((0, 0), (253_402_300_799, 999_999_999)):
        request = events_pb2.PublishEventRequest(
            event_type="a.b", timestamp=timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
        )
        await _publish(request, events)
    assert [request.timestamp for _, request in events.published] == [
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
    ]
    for seconds, nanos in ((-1, 0), (253_402_300_800, 0), (0, -1), (0, 1_000_000_000)):
        request = events_pb2.PublishEventRequest(
            event_type="a.b", timestamp=timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)
        )
        with pytest.raises(Aborted) as aborted:
            await _publish(request, events)
        assert _refusal(aborted.value) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "timestamp must be a valid Timestamp from 1970-01-01T00:00:00Z to the end of "
            f"year 9999 (seconds={seconds}, nanos={nanos})",
            "timestamp",
        )
    assert len(events.published) == 2


async def test_a_refusal_of_the_service_is_the_callers_status() -> None:
    refusal = EventIdReused("event_id e-1 was used for another event", field="event_id")
    with pytest.raises(Aborted) as aborted:
        await _publish(events_pb2.PublishEventRequest(event_id="e-1"), _Events(refusal))
    assert _refusal(aborted.value) == (
        refusal.code,
        "event_id e-1 was used for another event",
        "event_id",
    )


class _BrokenStream:
    """A subscription that yields :data:`_EVENT`, then fails as a bug would."""

    def __init__(self) -> None:
        self.tenants: list[uuid.UUID] = []

    async def subscribe(
        self, tenant: uuid.UUID, patterns: Sequence[str], after_cursor: str, start: int
    ) -> AsyncIterator[StoredEvent]:
        self.tenants.append(tenant)
        yield StoredEvent(_EVENT, Position(1, 1))
        raise KeyError("a bug in the subscription")


async def test_a_broken_subscription_is_internal_and_logged_naming_the_rpc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = _BrokenStream()
    servicer = EventServiceServicer(cast(EventService, events))
    gate = CallGate(_SERVICE, cast(KeyStore, _Keys()), TenantLimiter(TenantLimits()))
    received: list[events_pb2.SubscribeEventsResponse] = []

    async def call() -> None:
        async def continuation(_details: Any) -> Any:
            return grpc.unary_stream_rpc_method_handler(servicer.SubscribeEvents)

        await gate.intercept_service(continuation, _Details("SubscribeEvents"))
        request = events_pb2.SubscribeEventsRequest(type_patterns=["#"])
        stream = servicer.SubscribeEvents(request, ServicerContext())  # type: ignore[arg-type]
        async for response in stream:
            received.append(response)

    with (
        module_lines(monkeypatch, status_module, "jobplane.server") as lines,
        pytest.raises(Aborted) as aborted,
    ):
        await asyncio.create_task(call())
    assert aborted.value.status.code is grpc.StatusCode.INTERNAL
    assert "a bug" not in aborted.value.status.details  # nothing of the failure is told
    assert events.tenants == [_TENANT]
    assert [r.event for r in received] == [event_to_pb(_EVENT)]
    (line,) = (line for line in lines if line["event"] == "rpc.failed")
    assert (line["log_level"], line["rpc"]) == ("error", "SubscribeEvents")
    assert isinstance(line["exc_info"], KeyError)
