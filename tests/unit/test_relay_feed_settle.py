"""How the event feed settles what the broker did with a batch: a refusal stops the
pass until the same event was refused five times in a row, then it is parked in the
outbox (and said so); an event AMQP cannot carry is logged and passed over."""

from __future__ import annotations

import uuid
from typing import Any, cast

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.events.envelope import Event, encode
from jobplane.store.event_feed import FeedBatch, FeedEvent
from jobplane.store.events import Position, StoredEvent
from jobplane.topology import load_topology
from jobplane.workers import relay_feed
from jobplane.workers.relay import Relay
from jobplane.workers.relay_messages import PublishFailed, Unpublishable
from tests.support.logs import module_lines


class _Batch:
    """The events of one read, and the events it was asked to park."""

    def __init__(self, *events: FeedEvent) -> None:
        self.events = list(events)
        self.parked: list[tuple[FeedEvent, bytes, str, float]] = []

    async def park(self, event: FeedEvent, body: bytes, error: str, *, delay: float) -> None:
        self.parked.append((event, body, error, delay))


def _event(seq: int, event_type: str = "artifact.created") -> FeedEvent:
    event = Event.new(event_type, {"n": seq}, tenant_id=uuid.uuid4())
    return FeedEvent(StoredEvent(event, Position(1, seq)))


def _relay() -> Relay:
    return Relay(
        cast(AsyncEngine, None),
        "postgresql://unused@127.0.0.1:1/unused",
        "amqp://unused",
        load_topology(),
    )


async def _settle(relay: Relay, batch: _Batch, results: list[Any]) -> Any:
    return await relay._settle_results(cast(FeedBatch, batch), results)


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch) -> Any:
    with module_lines(monkeypatch, relay_feed, "jobplane.relay.settle") as captured:
        yield captured


async def test_an_event_refused_five_times_in_a_row_is_parked_and_the_feed_goes_on(
    logs: list[dict[str, Any]],
) -> None:
    relay, head, next_one = _relay(), _event(1), _event(2)
    refused = PublishFailed("not confirmed: Nack")
    for _ in range(4):
        batch = _Batch(head, next_one)
        assert await _settle(relay, batch, [refused, None]) == (0, 0, refused)
        assert batch.parked == []
    assert logs == []
    batch = _Batch(head, next_one)
    assert await _settle(relay, batch, [refused, None]) == (2, 1, None)
    assert batch.parked == [
        (
            head,
            encode(head.stored.event),
            f"the broker refused it 5 times in a row: {refused!r}",
            5.0,
        )
    ]
    assert logs == [
        {
            "event": "relay.event.parked",
            "log_level": "warning",
            "event_id": str(head.stored.event.event_id),
            "event_type": "artifact.created",
            "failures": 5,
            "error": repr(refused),
            "hint": "moved to the outbox, retried there on its own",
        }
    ]


async def test_refusals_of_another_event_start_the_count_again(
    logs: list[dict[str, Any]],
) -> None:
    relay, first, second = _relay(), _event(1), _event(2)
    refused = PublishFailed("not confirmed: Nack")
    for _ in range(4):
        await _settle(relay, _Batch(first), [refused])
    # The first went through at last; the second's refusals count from one.
    batch = _Batch(first, second)
    assert await _settle(relay, batch, [None, refused]) == (1, 0, refused)
    for _ in range(3):
        assert await _settle(relay, _Batch(second), [refused]) == (0, 0, refused)
    assert batch.parked == [] and logs == []


async def test_an_event_amqp_cannot_carry_is_logged_and_passed_over(
    logs: list[dict[str, Any]],
) -> None:
    relay, bad, good, worse = _relay(), _event(1, "artifact.huge"), _event(2), _event(3)
    batch = _Batch(bad, good)
    assert await _settle(relay, batch, [Unpublishable("body too big"), None]) == (2, 0, None)
    assert relay.failed == 1 and batch.parked == []
    await _settle(relay, _Batch(worse), [Unpublishable("body too big")])
    assert relay.failed == 2
    del logs[1:]
    assert logs == [
        {
            "event": "relay.event.failed",
            "log_level": "error",
            "event_id": str(bad.stored.event.event_id),
            "event_type": "artifact.huge",
            "error": "body too big",
            "hint": "AMQP cannot carry it; it stays in the events table",
        }
    ]


async def test_results_must_match_the_batchs_events() -> None:
    with pytest.raises(ValueError, match="zip"):
        await _settle(_relay(), _Batch(_event(1)), [None, None])
