"""Broker connections, the definition of "down", and what AMQP can carry."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aio_pika
import aiormq
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st
from pamqp.frame import marshal
from pamqp.header import ContentHeader

from jobplane import broker
from jobplane.envelope import AMQP_TYPE, DEPLOYMENT_HEADER, MAX_ENVELOPE_BYTES, Envelope
from jobplane.workers.bounce import bounce_delay, bounces_of
from jobplane.workers.relay import (
    Unpublishable,
    check_publishable,
    dispatch_properties,
)
from jobplane.workers.relay_messages import fits_at_once


@pytest.mark.parametrize("robust", [False, True])
async def test_a_connection_that_cannot_open_is_closed_not_left_to_the_gc(
    monkeypatch: pytest.MonkeyPatch, robust: bool
) -> None:
    # aio_pika.connect leaves such a connection to its finalizer, which
    # creates a close() coroutine that nobody awaits once the loop is gone.
    closed: list[aio_pika.Connection] = []
    original = aio_pika.Connection.close

    async def close(self: aio_pika.Connection, *args: Any, **kwargs: Any) -> None:
        closed.append(self)
        await original(self, *args, **kwargs)

    monkeypatch.setattr(aio_pika.Connection, "close", close)
    with pytest.raises((OSError, aiormq.exceptions.AMQPConnectionError, TimeoutError)):
        await broker.connect("amqp://guest:guest@127.0.0.1:1/", timeout=2, robust=robust)
    assert len(closed) == 1
    assert closed[0].is_closed


@pytest.mark.parametrize(
    ("error", "down"),
    [
        (ConnectionRefusedError(111, "refused"), True),
        (TimeoutError(), True),
        (aiormq.exceptions.ConnectionClosed(320, "CONNECTION_FORCED"), True),
        (aiormq.exceptions.ChannelInvalidStateError("closed"), True),
        (aiormq.exceptions.ChannelAccessRefused("ACCESS_REFUSED"), False),
        (aiormq.exceptions.ChannelNotFoundEntity("NOT_FOUND"), False),
        (aiormq.exceptions.ProbableAuthenticationError("login refused"), False),
        (RuntimeError("a bug of ours"), False),
        (ValueError("routing key too long"), False),
    ],
)
def test_broker_down_tells_an_outage_from_a_refusal(error: BaseException, down: bool) -> None:
    assert broker.broker_down(error) is down


async def test_a_stream_that_ended_before_a_frame_is_the_broker_down() -> None:
    # What aiormq raises when an address accepts the connection and closes it
    # before the handshake (a proxy in front of a broker that is down).
    reader = asyncio.StreamReader()
    reader.feed_eof()
    with pytest.raises(StopAsyncIteration) as raised:
        await aiormq.connection.FrameReceiver(reader).get_frame()
    assert broker.broker_down(raised.value)


async def test_a_stop_async_iteration_of_our_own_is_no_outage() -> None:
    async def ours() -> None:
        raise StopAsyncIteration

    with pytest.raises(StopAsyncIteration) as raised:
        await ours()
    assert not broker.broker_down(raised.value)


def test_access_refused() -> None:
    assert broker.access_refused(aiormq.exceptions.ChannelAccessRefused("ACCESS_REFUSED"))
    assert not broker.access_refused(aiormq.exceptions.ChannelNotFoundEntity("NOT_FOUND"))


async def test_until_up_waits_out_an_outage_and_passes_a_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError(111, "refused")
        return "up"

    async def no_sleep(_seconds: float) -> None:
        return None

    monkeypatch.setattr(asyncio, "sleep", no_sleep)
    log = structlog.get_logger("test")
    assert await broker.until_up(flaky, log) == "up"
    assert len(calls) == 3

    async def refused() -> str:
        raise aiormq.exceptions.ChannelAccessRefused("ACCESS_REFUSED")

    with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
        await broker.until_up(refused, log)


def _message(**kwargs: Any) -> aio_pika.Message:
    kwargs.setdefault("headers", {"job_id": "j"})
    return aio_pika.Message(b"{}", message_id="m", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "routing_key", "says"),
    [
        ({"correlation_id": "c" * 256}, "demo.echo", "correlation id is 256 bytes"),
        ({"correlation_id": "é" * 128}, "demo.echo", "correlation id is 256 bytes"),
        ({}, "k" * 256, "routing key (job type) is 256 bytes"),
        ({"headers": {"x": object()}}, "demo.echo", ""),
        ({"headers": {"x": "h" * 5000}}, "demo.echo", "exceed one frame"),
    ],
)
def test_a_message_amqp_cannot_carry_is_unpublishable(
    kwargs: dict[str, Any], routing_key: str, says: str
) -> None:
    with pytest.raises(Unpublishable) as refused:
        check_publishable(*_parts(_message(**kwargs)), "jobplane.jobs", routing_key)
    assert says in str(refused.value)


def test_the_longest_short_strings_are_publishable() -> None:
    check_publishable(*_parts(_message(correlation_id="c" * 255)), "jobplane.jobs", "k" * 255)
    big = aio_pika.Message(b"x" * MAX_ENVELOPE_BYTES, message_id="m")
    check_publishable(*_parts(big), "jobplane.jobs", "demo.echo")
    with pytest.raises(Unpublishable):
        check_publishable(*_parts(aio_pika.Message(big.body + b"x")), "jobplane.jobs", "demo.echo")


def test_a_header_frame_of_the_smallest_frame_max_is_publishable_one_byte_more_is_not() -> None:
    """4096 bytes, AMQP's smallest frame_max, counts the whole frame: any broker takes it."""

    def padded(size: int) -> aio_pika.Message:
        return _message(headers={"x": "h" * size})

    def frame(message: aio_pika.Message) -> int:
        return len(marshal(ContentHeader(0, len(message.body), message.properties), 1))

    pad = 4096 - frame(padded(0))
    assert frame(padded(pad)) == 4096
    check_publishable(*_parts(padded(pad)), "jobplane.jobs", "demo.echo")
    with pytest.raises(Unpublishable) as refused:
        check_publishable(*_parts(padded(pad + 1)), "jobplane.jobs", "demo.echo")
    assert str(refused.value) == "message properties of 4097 bytes exceed one frame"


def _parts(message: aio_pika.Message) -> tuple[bytes, aiormq.spec.Basic.Properties]:
    return message.body, message.properties


_ID = st.uuids()


@given(
    job_type=st.text(min_size=1, max_size=300),
    correlation_id=st.text(max_size=300),
    deployment=st.one_of(st.none(), st.text(max_size=40)),
    trace=st.dictionaries(st.sampled_from(["traceparent", "tracestate"]), st.text(max_size=600)),
    ids=st.tuples(_ID, _ID, _ID),
)
def test_a_dispatch_is_what_aio_pika_sent_and_a_quick_yes_is_never_wrong(
    job_type: str,
    correlation_id: str,
    deployment: str | None,
    trace: dict[str, str],
    ids: tuple[uuid.UUID, uuid.UUID, uuid.UUID],
) -> None:
    envelope = Envelope(ids[0], ids[1], ids[2], job_type, correlation_id, deployment=deployment)
    ours = dispatch_properties(envelope, trace)
    # What the relay published through aio-pika before it went straight to aiormq.
    theirs = aio_pika.Message(
        envelope.encode(),
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=str(envelope.event_id),
        correlation_id=envelope.correlation_id or None,
        type=AMQP_TYPE,
        headers={
            "job_id": str(envelope.job_id),
            **({DEPLOYMENT_HEADER: envelope.deployment} if envelope.deployment else {}),
            **trace,
        },
    ).properties
    body = envelope.encode()
    try:
        expected = marshal(ContentHeader(0, len(body), theirs), 1)
    except Exception as exc:
        with pytest.raises(type(exc)):
            marshal(ContentHeader(0, len(body), ours), 1)
    else:
        assert marshal(ContentHeader(0, len(body), ours), 1) == expected
    if fits_at_once(job_type, body, ours, max_body=MAX_ENVELOPE_BYTES):
        check_publishable(body, ours, "jobplane.jobs", job_type)


def test_a_usual_dispatch_is_a_quick_yes_and_a_header_not_a_string_takes_the_exact_check() -> None:
    ids = (uuid.uuid4(), uuid.uuid4(), uuid.uuid4())
    envelope = Envelope(*ids, "demo.echo", "order-7", deployment="0123456789abcdef")
    body = envelope.encode()
    trace = {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01"}
    usual = dispatch_properties(envelope, trace)
    # Every header a string, every string short: no frame encoded to know it fits.
    assert fits_at_once("demo.echo", body, usual, max_body=MAX_ENVELOPE_BYTES)
    # A header of another kind (a number, a table, bytes) is judged only by encoding
    # it: bytes, say, AMQP's field tables cannot carry.
    others: tuple[Any, ...] = (7, {"nested": "table"}, b"raw")
    for other in others:
        odd = dispatch_properties(envelope, trace)
        odd.headers = {**(usual.headers or {}), "x-extra": other}
        assert not fits_at_once("demo.echo", body, odd, max_body=MAX_ENVELOPE_BYTES), other
    check_publishable(body, usual, "jobplane.jobs", "demo.echo")
    with pytest.raises(Unpublishable, match="x-extra error: Unknown type"):
        check_publishable(body, odd, "jobplane.jobs", "demo.echo")


def test_bounce_delay_grows_and_never_holds_a_delivery_long() -> None:
    delays = [bounce_delay(bounces) for bounces in range(2000)]
    assert delays[0] < 0.01 and delays == sorted(delays)
    assert max(delays) == 0.1


def test_bounce_delay_doubles_from_5_ms() -> None:
    assert [bounce_delay(n) for n in range(6)] == [0.005, 0.01, 0.02, 0.04, 0.08, 0.1]


class _Delivered:
    """The one attribute of an incoming message bounces_of reads."""

    def __init__(self, headers: dict[str, Any] | None) -> None:
        self.headers = headers


@pytest.mark.parametrize(
    ("headers", "count"),
    [
        (None, 0),
        ({}, 0),
        ({"x-jobplane-bounces": 3}, 3),
        ({"x-jobplane-bounces": "7"}, 7),
        # Counted under the header's former name by workers of an older release.
        ({"x-jobplane-handbacks": 5}, 5),
        ({"x-jobplane-bounces": 2, "x-jobplane-handbacks": 5}, 5),
        ({"x-jobplane-bounces": 9, "x-jobplane-handbacks": 5}, 9),
        ({"x-jobplane-bounces": "many"}, 0),
        ({"x-jobplane-bounces": -4}, 0),
        ({"x-jobplane-bounces": -4, "x-jobplane-handbacks": -2}, 0),
        ({"x-jobplane-bounces": None}, 0),
    ],
)
def test_a_messages_bounces_are_read_from_its_headers(
    headers: dict[str, Any] | None, count: int
) -> None:
    message: Any = _Delivered(headers)
    assert bounces_of(message) == count
