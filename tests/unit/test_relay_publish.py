"""What the relay and a bouncing worker hand the broker, and what they make of its answer:
a dispatch's publish and its confirm, an event's, and a bounced message's copy."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import aio_pika
import aiormq
import pytest
from aio_pika.abc import AbstractChannel, AbstractExchange
from pamqp import commands
from pamqp.header import ContentHeader

from jobplane.envelope import Envelope
from jobplane.events.envelope import Event, amqp_properties, encode
from jobplane.faults import FaultPoints, InjectedFault
from jobplane.workers import relay_messages
from jobplane.workers.bounce import BOUNCES_HEADER, BounceFailed, publish_bounce
from jobplane.workers.inbound import Delivery
from jobplane.workers.relay_messages import (
    PublishFailed,
    Returned,
    Unpublishable,
    dispatch_properties,
    publish_dispatch,
    send_event,
    spec_properties,
)

_ACK = aiormq.spec.Basic.Ack()
_NACK = aiormq.spec.Basic.Nack()


class _Channel:
    """An aiormq channel's basic_publish: records each call, answers ``answer``
    (an exception is raised; a future that never resolves hangs)."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[tuple[bytes, dict[str, Any]]] = []

    async def basic_publish(self, body: bytes, **kwargs: Any) -> Any:
        self.calls.append((body, kwargs))
        if isinstance(self.answer, BaseException):
            raise self.answer
        if isinstance(self.answer, asyncio.Future):
            return await self.answer
        return self.answer


def _returned() -> aiormq.abc.DeliveredMessage:
    back = commands.Basic.Return(312, "NO_ROUTE", "jobplane.jobs", "demo.echo")
    return aiormq.abc.DeliveredMessage(back, ContentHeader(), b"", cast(Any, None))


@dataclass
class _Exchange:
    name: str = "jobplane.jobs"


class _Envelope:
    """What the dispatches of a test carry."""

    correlation_id = "order-17"


def _envelope() -> Envelope:
    return Envelope(
        uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), "demo.echo", _Envelope.correlation_id, "dep-a"
    )


async def _dispatch(
    monkeypatch: pytest.MonkeyPatch, answer: Any, timeout: float = 5.0
) -> tuple[_Channel, Envelope]:
    channel = _Channel(answer)

    async def underlay(_exchange: AbstractExchange) -> Any:
        return channel

    monkeypatch.setattr(relay_messages, "underlay", underlay)
    envelope = _envelope()
    await publish_dispatch(
        cast(AbstractExchange, _Exchange()), envelope, {"traceparent": "00-a-b-01"}, timeout=timeout
    )
    return channel, envelope


async def test_a_dispatch_is_published_mandatory_to_its_job_type(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    channel, envelope = await _dispatch(monkeypatch, _ACK)
    assert channel.calls == [
        (
            envelope.encode(),
            {
                "exchange": "jobplane.jobs",
                "routing_key": "demo.echo",
                "properties": dispatch_properties(envelope, {"traceparent": "00-a-b-01"}),
                "mandatory": True,
                "wait": False,
            },
        )
    ]


@pytest.mark.parametrize(
    ("answer", "error", "message"),
    [
        (_NACK, PublishFailed, "not confirmed: Nack"),
        (None, PublishFailed, "not confirmed: NoneType"),
        ("returned", Returned, "not confirmed: returned unroutable"),
        ("raised", Returned, "not confirmed: returned unroutable"),
        (ValueError("header value too long"), Unpublishable, "header value too long"),
    ],
)
async def test_a_dispatch_the_broker_did_not_confirm_raises_what_it_did(
    monkeypatch: pytest.MonkeyPatch, answer: Any, error: type[Exception], message: str
) -> None:
    if answer == "returned":
        answer = _returned()
    elif answer == "raised":
        answer = aiormq.exceptions.PublishError(_returned(), cast(Any, None))
    with pytest.raises(error) as raised:
        await _dispatch(monkeypatch, answer)
    assert type(raised.value) is error
    assert str(raised.value) == message


async def test_a_dispatch_waits_for_its_confirm_no_longer_than_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(_dispatch(monkeypatch, never, timeout=0.05))
    await asyncio.wait({waiting}, timeout=2.0)
    if not waiting.done():
        waiting.cancel()
        pytest.fail("the dispatch waited past its timeout")
    assert isinstance(waiting.exception(), TimeoutError)


async def test_a_dispatch_too_long_to_check_at_a_glance_is_checked_then_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    long_id = "order-" + "7" * 100
    monkeypatch.setattr(_Envelope, "correlation_id", long_id)
    channel, envelope = await _dispatch(monkeypatch, _ACK)
    assert envelope.correlation_id == long_id
    [(body, sent)] = channel.calls
    assert body == envelope.encode() and sent["properties"].correlation_id == long_id
    assert (sent["exchange"], sent["routing_key"]) == ("jobplane.jobs", "demo.echo")
    # One AMQP cannot carry is refused before anything is sent.
    monkeypatch.setattr(_Envelope, "correlation_id", "x" * 300)
    with pytest.raises(Unpublishable) as refused:
        await _dispatch(monkeypatch, _ACK)
    assert str(refused.value) == "its correlation id is 300 bytes; AMQP carries at most 255"


def _event() -> Event:
    return Event.new("artifact.created", {"n": 1}, tenant_id=uuid.uuid4(), correlation_id="c-9")


async def _send(
    answer: Any,
    faults: FaultPoints | None = None,
    *,
    event: Event | None = None,
    traceparent: str = "00-a-b-01",
    tracestate: str = "k=v",
) -> tuple[_Channel, Event]:
    channel, event = _Channel(answer), event or _event()
    await send_event(
        cast(aiormq.Channel, channel),
        "jobplane.events",
        "artifact.created",
        event,
        encode(event),
        traceparent=traceparent,
        tracestate=tracestate,
        faults=faults or FaultPoints([]),
    )
    return channel, event


async def test_an_event_is_published_not_mandatory_with_its_properties() -> None:
    channel, event = await _send(_ACK)
    properties = amqp_properties(event, traceparent="00-a-b-01", tracestate="k=v")
    assert channel.calls == [
        (
            encode(event),
            {
                "exchange": "jobplane.events",
                "routing_key": "artifact.created",
                "properties": spec_properties(properties),
                "mandatory": False,
                "wait": False,
            },
        )
    ]


async def test_an_event_the_broker_did_not_confirm_raises_what_it_did() -> None:
    with pytest.raises(PublishFailed, match=r"^not confirmed: Nack$"):
        await _send(_NACK)
    with pytest.raises(Unpublishable) as refused:
        await _send(ValueError("header value too long"))
    assert str(refused.value) == "header value too long"


async def test_an_event_too_long_to_check_at_a_glance_is_checked_then_sent() -> None:
    # A trace context past the quick check's budget and a body past a dispatch's
    # limit (an event may be far larger): checked against the event's limits, sent.
    big = Event.new("artifact.created", {"blob": "x" * 100_000}, tenant_id=uuid.uuid4())
    long = "0" * 1000
    for parent, state in ((long, "k=v"), ("00-a-b-01", long)):
        channel, _event_sent = await _send(_ACK, event=big, traceparent=parent, tracestate=state)
        [(body, sent)] = channel.calls
        assert body == encode(big) and len(body) > 100_000
        assert (sent["exchange"], sent["routing_key"]) == ("jobplane.events", "artifact.created")
        assert long in sent["properties"].headers.values()
    # Headers past one frame are refused before anything is sent.
    for parent, state in (("0" * 5000, "k=v"), ("00-a-b-01", "0" * 5000)):
        with pytest.raises(Unpublishable, match="exceed one frame"):
            await _send(_ACK, traceparent=parent, tracestate=state)


async def test_a_confirmed_event_passes_its_fault_point() -> None:
    with pytest.raises(InjectedFault, match=r"relay\.event\.confirmed"):
        await _send(_ACK, FaultPoints(["relay.event.confirmed"]))


@dataclass
class _BouncedExchange:
    name: str
    answer: Any = _ACK
    published: list[tuple[aio_pika.Message, dict[str, Any]]] = field(default_factory=list)

    async def publish(self, message: aio_pika.Message, **kwargs: Any) -> Any:
        self.published.append((message, kwargs))
        return self.answer


class _BounceChannel:
    def __init__(self) -> None:
        self.default_exchange = _BouncedExchange("")
        self.named: dict[str, _BouncedExchange] = {}

    async def get_exchange(self, name: str, *, ensure: bool) -> _BouncedExchange:
        assert ensure is False
        return self.named.setdefault(name, _BouncedExchange(name))


@dataclass
class _Delivery:
    headers: dict[str, Any]
    exchange: str = "jobplane.jobs"
    routing_key: str = "demo.echo"
    body: bytes = b'{"v": 1}'
    properties: Any = field(
        default_factory=lambda: aiormq.spec.Basic.Properties(
            content_type="application/json",
            content_encoding="utf-8",
            delivery_mode=2,
            priority=3,
            correlation_id="order-17",
            reply_to="replies",
            message_id="m-1",
            timestamp=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
            message_type="jobplane.dispatch",
            app_id="jobplane",
            user_id="guest",
        )
    )


async def _bounce(
    message: _Delivery, queue: str | None, answer: Any = _ACK
) -> tuple[int, _BounceChannel]:
    channel = _BounceChannel()
    channel.default_exchange.answer = answer
    count = await publish_bounce(
        cast(AbstractChannel, channel), cast(Delivery, message), queue, timeout=3.5
    )
    return count, channel


async def test_a_bounced_copy_is_the_message_with_its_count_sent_to_its_queue() -> None:
    message = _Delivery({"x-jobplane-handbacks": 2, "job_id": "j-1"})
    count, channel = await _bounce(message, "jobs.default")
    assert count == 3
    [(copy, kwargs)] = channel.default_exchange.published
    assert kwargs == {"routing_key": "jobs.default", "mandatory": True, "timeout": 3.5}
    assert copy.body == message.body
    assert copy.headers == {"job_id": "j-1", BOUNCES_HEADER: 3}
    sent, original = copy.properties, message.properties
    for name in (
        "content_type",
        "content_encoding",
        "delivery_mode",
        "priority",
        "correlation_id",
        "reply_to",
        "message_id",
        "timestamp",
        "message_type",
        "app_id",
    ):
        assert getattr(sent, name) == getattr(original, name), name
    # The broker checks user_id against the publisher's own login: never copied.
    assert sent.user_id is None
    assert channel.named == {}


async def test_without_a_queue_a_copy_goes_where_the_original_was_published() -> None:
    count, channel = await _bounce(_Delivery({BOUNCES_HEADER: 4}), None)
    assert count == 5
    [(_copy, kwargs)] = channel.named["jobplane.jobs"].published
    assert kwargs["routing_key"] == "demo.echo"
    assert channel.default_exchange.published == []
    _count, channel = await _bounce(_Delivery({}, exchange="", routing_key="jobs.low"), None)
    [(_copy, kwargs)] = channel.default_exchange.published
    assert kwargs["routing_key"] == "jobs.low"
    # No routing key: the empty one, through either exchange.
    _count, channel = await _bounce(_Delivery({}, routing_key=""), None)
    assert channel.named["jobplane.jobs"].published[0][1]["routing_key"] == ""
    _count, channel = await _bounce(_Delivery({}, exchange="", routing_key=""), None)
    assert channel.default_exchange.published[0][1]["routing_key"] == ""


async def test_a_copy_waits_ten_seconds_for_its_confirm_unless_told() -> None:
    channel = _BounceChannel()
    await publish_bounce(cast(AbstractChannel, channel), cast(Delivery, _Delivery({})), "q")
    assert channel.default_exchange.published[0][1]["timeout"] == 10.0


async def test_a_copy_the_broker_did_not_confirm_fails_the_bounce() -> None:
    with pytest.raises(BounceFailed, match=r"^not confirmed: Nack$"):
        await _bounce(_Delivery({}), "jobs.default", answer=_NACK)
