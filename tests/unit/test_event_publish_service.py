"""EventService.publish on a fake store: the event it stores for a request, and the
refusals of a request before anything is stored."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from jobplane.errors import InvalidArgument
from jobplane.server.events import EventService, PublishRequest
from jobplane.store.events import EventStore, NewEvent
from jobplane.store.listen import Listener

_TENANT = uuid.UUID(int=1)
_EVENT_ID = "0b5c8a8e-5b8e-4c1e-9f4e-2f0a8c3d9e11"
_TRACEPARENT = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"


class _Store:
    def __init__(self) -> None:
        self.published: list[NewEvent] = []

    async def publish(self, tenant: uuid.UUID, new: NewEvent) -> Any:
        assert tenant == _TENANT
        self.published.append(new)
        return new


def _service(store: _Store, **options: Any) -> EventService:
    return EventService(
        cast(EventStore, store), Listener("postgresql://unused/db", "unused"), **options
    )


async def test_publish_stores_the_event_as_given() -> None:
    store = _Store()
    when = datetime(2026, 2, 3, 4, 5, 6, tzinfo=UTC)
    request = PublishRequest(
        event_id=_EVENT_ID,
        event_type="order.placed",
        timestamp=when,
        project_id="shop",
        correlation_id="c-1",
        causation_id="cause-1",
        payload={"n": 1},
        traceparent=_TRACEPARENT,
        tracestate="k=v",
    )
    await _service(store).publish(_TENANT, request)
    (new,) = store.published
    event = new.event
    assert (event.event_id, event.event_type, event.timestamp, event.tenant_id) == (
        uuid.UUID(_EVENT_ID),
        "order.placed",
        when,
        _TENANT,
    )
    assert (event.project_id, event.correlation_id, event.causation_id, event.payload) == (
        "shop",
        "c-1",
        "cause-1",
        {"n": 1},
    )
    assert (new.traceparent, new.tracestate, new.timestamp_given) == (_TRACEPARENT, "k=v", True)


async def test_publish_fills_what_the_request_leaves_out() -> None:
    store = _Store()
    before = datetime.now(UTC)
    await _service(store).publish(
        _TENANT, PublishRequest(_EVENT_ID, "order.placed", tracestate="k=v")
    )
    (new,) = store.published
    assert new.event.correlation_id == _EVENT_ID  # the event starts its own chain
    assert before <= new.event.timestamp <= datetime.now(UTC)
    assert new.event.project_id is None and new.event.causation_id is None
    assert (new.traceparent, new.tracestate, new.timestamp_given) == (None, None, False)


async def test_publish_refuses_a_bad_request_whole() -> None:
    store = _Store()
    service = _service(store, max_payload_bytes=100)
    refusals = [
        (
            PublishRequest("", "order.placed"),
            "event_id is required (a UUID the publisher chooses)",
            "event_id",
        ),
        (
            PublishRequest(_EVENT_ID.upper(), "order.placed"),
            f"event_id '{_EVENT_ID.upper()}' must be a UUID in its canonical lowercase form "
            "(8-4-4-4-12 hex digits)",
            "event_id",
        ),
        (PublishRequest(_EVENT_ID, "order.placed", payload={"x": "y" * 200}), None, "payload"),
        (PublishRequest(_EVENT_ID, ""), None, "event_type"),
    ]
    for request, message, field in refusals:
        with pytest.raises(InvalidArgument) as refused:
            await service.publish(_TENANT, request)
        if message is not None:
            assert str(refused.value) == message
        assert refused.value.field == field
    assert store.published == []
