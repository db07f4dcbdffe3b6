"""The relay's AMQP messages: their properties, the checks that AMQP can carry them,
and publishing them confirmed straight through aiormq.

The outbox's dispatches and events and the event feed's events all leave
through here, so what the broker is sent is decided in one place (docs/events.md,
docs/workers.md). A message AMQP cannot carry is refused before it is sent:
one bad message never reaches (or closes) the channel its batch shares.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import aio_pika
import aiormq
import pamqp.exceptions
import pamqp.frame
import pamqp.header
from aio_pika.abc import AbstractExchange

from jobplane.amqp import Properties
from jobplane.envelope import AMQP_TYPE, DEPLOYMENT_HEADER, MAX_ENVELOPE_BYTES, Envelope
from jobplane.events.envelope import MAX_EVENT_BYTES, Event, amqp_properties
from jobplane.faults import FaultPoints

_SHORT_STRING = 255  # bytes of an AMQP short string
# AMQP's smallest frame: a header frame this size fits any broker's frame_max.
_MIN_FRAME_MAX = 4096


class PublishFailed(Exception):
    """The broker did not confirm a message (a nack, or no answer in time)."""


class Returned(PublishFailed):
    """The broker returned the message: no queue is bound for its routing key."""


class Unpublishable(Exception):
    """The broker can never accept this message as it is; retrying cannot help."""


async def publish_dispatch(
    exchange: AbstractExchange,
    envelope: Envelope,
    trace_headers: Mapping[str, str],
    *,
    timeout: float,
) -> None:
    """Publish a job dispatch, mandatory, and wait for the broker's confirm.

    Raises :class:`Returned` when no queue is bound for its job type,
    :class:`Unpublishable` when AMQP cannot carry it, and
    :class:`PublishFailed` when the broker does not confirm it.
    """
    body = envelope.encode()
    properties = dispatch_properties(envelope, trace_headers)
    if not fits_at_once(envelope.job_type, body, properties, max_body=MAX_ENVELOPE_BYTES):
        check_publishable(body, properties, exchange.name, envelope.job_type, mandatory=True)
    # Straight through aiormq, as the events are: aio-pika's message and
    # exchange layers cost a seventh of a dispatch, for nothing it adds here.
    channel = await underlay(exchange)
    try:
        async with asyncio.timeout(timeout):
            confirmation = await channel.basic_publish(
                body,
                exchange=exchange.name,
                routing_key=envelope.job_type,
                properties=properties,
                mandatory=True,
                wait=False,
            )
    except aiormq.exceptions.PublishError as exc:  # a return, on a raising channel
        raise Returned("not confirmed: returned unroutable") from exc
    except (TypeError, ValueError, pamqp.exceptions.PAMQPException) as exc:
        # Encoding refused it after all (check_publishable missed a case).
        raise Unpublishable(str(exc)) from exc
    # A returned (unroutable) message resolves the confirm too, carrying the
    # message instead of a Basic.Ack: that is not a publish.
    if isinstance(confirmation, aiormq.spec.Basic.Ack):
        return
    if isinstance(confirmation, aiormq.abc.DeliveredMessage):
        raise Returned("not confirmed: returned unroutable")
    raise PublishFailed(f"not confirmed: {type(confirmation).__name__}")


async def send_event(
    channel: aiormq.Channel,
    exchange: str,
    routing_key: str,
    event: Event,
    body: bytes,
    *,
    traceparent: str | None,
    tracestate: str | None,
    faults: FaultPoints,
) -> None:
    """Publish ``body`` (``event``'s envelope) with ``routing_key``; wait for the confirm.

    Straight through aiormq, not waiting for the frames to be written:
    events are many small messages, and aio-pika's message and exchange
    layers cost a fifth of each. Not mandatory: with no queue bound the
    broker drops the event and confirms it, and that is a publish.
    """
    properties = spec_properties(
        amqp_properties(event, traceparent=traceparent, tracestate=tracestate)
    )
    if not surely_publishable(event, routing_key, body, traceparent, tracestate):
        check_publishable(
            body, properties, exchange, routing_key, mandatory=False, max_body=MAX_EVENT_BYTES
        )
    try:
        confirmation = await channel.basic_publish(
            body,
            exchange=exchange,
            routing_key=routing_key,
            properties=properties,
            mandatory=False,
            wait=False,
        )
    except (TypeError, ValueError, pamqp.exceptions.PAMQPException) as exc:
        raise Unpublishable(str(exc)) from exc
    if isinstance(confirmation, aiormq.spec.Basic.Ack):
        # Mid-batch: some events of the batch confirmed, others in
        # flight, none recorded yet.
        faults.hit("relay.event.confirmed")
        return
    raise PublishFailed(f"not confirmed: {type(confirmation).__name__}")


async def underlay(exchange: AbstractExchange) -> aiormq.Channel:
    """The aiormq channel under ``exchange``'s aio-pika channel (for basic_publish(wait=False))."""
    if not isinstance(exchange, aio_pika.Exchange):
        raise TypeError(f"an aio-pika exchange was expected, not {type(exchange).__name__}")
    channel = await exchange.channel.get_underlay_channel()
    if not isinstance(channel, aiormq.Channel):
        raise TypeError(f"an aiormq channel was expected, not {type(channel).__name__}")
    return channel


def dispatch_properties(envelope: Envelope, trace_headers: Mapping[str, str]) -> Properties:
    """A job dispatch's AMQP properties (docs/workers.md): byte for byte what
    ``aio_pika.Message`` made of them when the relay published through it (a
    unit test compares them)."""
    return Properties(
        content_type="application/json",
        headers={
            "job_id": str(envelope.job_id),
            **({DEPLOYMENT_HEADER: envelope.deployment} if envelope.deployment else {}),
            **trace_headers,
        },
        delivery_mode=int(aio_pika.DeliveryMode.PERSISTENT),
        priority=0,
        correlation_id=envelope.correlation_id or None,
        message_id=str(envelope.event_id),
        message_type=AMQP_TYPE,
    )


def fits_at_once(
    routing_key: str, body: bytes, properties: aiormq.spec.Basic.Properties, *, max_body: int
) -> bool:
    """True when a message is far within every AMQP limit, without encoding a frame:
    short strings of at most 63 characters (252 bytes of UTF-8 at most), and all
    its strings at four bytes a character beside the fixed properties fit the
    smallest frame. Anything else takes :func:`check_publishable`."""
    headers: dict[str, str] = {}
    for key, value in (properties.headers or {}).items():
        if not isinstance(value, str):
            return False
        headers[key] = value
    shorts = (routing_key, properties.correlation_id or "", properties.message_id or "")
    strings = sum(map(len, shorts)) + sum(len(k) + len(v) for k, v in headers.items())
    return (
        max(map(len, shorts)) <= 63
        and 4 * strings + 512 <= _MIN_FRAME_MAX
        and len(body) <= max_body
    )


def spec_properties(properties: dict[str, Any]) -> aiormq.spec.Basic.Properties:
    """``aio_pika.Message(body, **properties).properties``, built directly.

    ``properties`` as :func:`jobplane.events.envelope.amqp_properties` makes
    them; the result is what aio-pika would send (a unit test compares them).
    """
    return Properties(
        app_id=properties["app_id"],
        content_type=properties["content_type"],
        correlation_id=properties["correlation_id"],
        delivery_mode=int(properties["delivery_mode"]),
        headers=properties["headers"],
        message_id=properties["message_id"],
        message_type=properties["type"],
        priority=0,
        timestamp=properties["timestamp"],
    )


def surely_publishable(
    event: Event,
    routing_key: str,
    body: bytes,
    traceparent: str | None,
    tracestate: str | None,
) -> bool:
    """True when ``event`` is far within every AMQP limit, without encoding a frame.

    Short strings of at most 63 characters are at most 252 bytes of UTF-8, and
    all the strings at four bytes a character plus the fixed properties fit
    the smallest frame. Anything else takes :func:`check_publishable`.
    """
    short = max(
        len(routing_key), len(event.event_type), len(event.correlation_id), len(str(event.event_id))
    )
    strings = (
        len(routing_key)
        + len(event.event_type)
        + len(event.correlation_id)
        + len(event.causation_id or "")
        + len(traceparent or "")
        + len(tracestate or "")
    )
    return short <= 63 and 4 * strings + 512 <= _MIN_FRAME_MAX and len(body) <= MAX_EVENT_BYTES


def check_publishable(
    body: bytes,
    properties: aiormq.spec.Basic.Properties,
    exchange: str,
    routing_key: str,
    *,
    mandatory: bool = True,
    max_body: int = MAX_ENVELOPE_BYTES,
) -> None:
    """Raise :class:`Unpublishable` unless AMQP can carry ``body`` with ``properties``.

    Encodes the method and header frames the way the client will, without
    sending them: a string over 255 bytes (correlation id, routing key), a
    header that cannot be encoded, a header frame over the smallest frame
    size, a body over ``max_body``. Checked before the publish, so one bad
    row never reaches (or closes) the channel its batch shares.
    """
    if len(body) > max_body:
        raise Unpublishable(f"body of {len(body)} bytes exceeds {max_body}")
    for name, value in (
        ("routing key (job type)", routing_key),
        ("correlation id", properties.correlation_id),
    ):
        size = len((value or "").encode("utf-8", "surrogatepass"))
        if size > _SHORT_STRING:
            raise Unpublishable(f"its {name} is {size} bytes; AMQP carries at most {_SHORT_STRING}")
    try:
        pamqp.frame.marshal(
            aiormq.spec.Basic.Publish(
                exchange=exchange, routing_key=routing_key, mandatory=mandatory
            ),
            1,
        )
        header = pamqp.frame.marshal(pamqp.header.ContentHeader(0, len(body), properties), 1)
    except (TypeError, ValueError, pamqp.exceptions.PAMQPException) as exc:
        raise Unpublishable(short_error(exc)) from exc
    if len(header) > _MIN_FRAME_MAX:
        raise Unpublishable(f"message properties of {len(header)} bytes exceed one frame")


def short_error(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
