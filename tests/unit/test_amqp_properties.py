"""The short path of message properties encodes what pamqp encodes, byte for byte."""

from __future__ import annotations

import calendar
import struct
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import aio_pika
import aiormq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobplane.amqp import Properties
from jobplane.events import Event, amqp_properties
from jobplane.workers.relay import spec_properties

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

_TEXT = st.text(max_size=40)
_VALUES = st.one_of(
    _TEXT,
    st.integers(min_value=-(2**40), max_value=2**40),
    st.booleans(),
    st.none(),
    st.text(min_size=60, max_size=90),  # past 255 bytes of UTF-8 at times
)
_HEADERS = st.dictionaries(st.text(max_size=140), st.one_of(_TEXT, _VALUES), max_size=6)
_STAMPS = st.one_of(
    st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1)),
    st.datetimes(
        min_value=datetime(1971, 1, 1),
        max_value=datetime(2200, 1, 1),
        timezones=st.sampled_from([UTC, timezone(timedelta(hours=5))]),
    ),
)
_FIELDS: dict[str, Any] = {
    "content_type": st.one_of(st.none(), _TEXT, st.just("")),
    "content_encoding": st.one_of(st.none(), _TEXT),
    "headers": st.one_of(st.none(), _HEADERS),
    "delivery_mode": st.one_of(st.none(), st.integers(min_value=0, max_value=255)),
    "priority": st.one_of(st.none(), st.integers(min_value=0, max_value=255)),
    "correlation_id": st.one_of(st.none(), _TEXT, st.text(min_size=60, max_size=90)),
    "reply_to": st.one_of(st.none(), _TEXT),
    "expiration": st.one_of(st.none(), _TEXT),
    "message_id": st.one_of(st.none(), _TEXT),
    "timestamp": st.one_of(st.none(), _STAMPS),
    "message_type": st.one_of(st.none(), _TEXT),
    "user_id": st.one_of(st.none(), _TEXT),
    "app_id": st.one_of(st.none(), _TEXT),
}


def _marshal(kind: type[Any], fields: dict[str, Any]) -> bytes | type[BaseException]:
    try:
        return bytes(kind(**fields).marshal())
    except Exception as exc:
        return type(exc)


# Drawing thirteen optional fields is slow on a loaded machine; the comparison, not
# the drawing, is what is tested.
@settings(suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=_FIELDS))
def test_the_same_bytes_or_the_same_error_as_pamqp(fields: dict[str, Any]) -> None:
    assert _marshal(Properties, fields) == _marshal(aiormq.spec.Basic.Properties, fields)


def test_a_published_events_properties() -> None:
    fields: dict[str, Any] = {
        "app_id": "jobplane",
        "content_type": "application/json",
        "correlation_id": "c-1",
        "delivery_mode": 2,
        "headers": {"tenant_id": "t", "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
        "message_id": "m-1",
        "message_type": "job.succeeded",
        "priority": 0,
        "timestamp": datetime(2026, 12, 4, 12, 0, tzinfo=UTC),
    }
    fast = Properties(**fields).marshal()
    assert fast == aiormq.spec.Basic.Properties(**fields).marshal()
    # And it reads back as what it was.
    header = aiormq.spec.Basic.Properties()
    header.unmarshal(int.from_bytes(fast[:2], "big"), fast[2:])
    assert header.headers == fields["headers"] and header.message_type == "job.succeeded"


@pytest.mark.parametrize("value", [256, -1])
def test_an_octet_out_of_range_is_refused_as_pamqp_refuses_it(value: int) -> None:
    assert _marshal(Properties, {"priority": value}) == _marshal(
        aiormq.spec.Basic.Properties, {"priority": value}
    )


# Every microsecond of every year the envelope allows, and the last
# microsecond of a second in particular: far from 1970 a float holds the
# seconds too coarsely to keep ".999999" below the next whole second.
_LAST = datetime(9999, 12, 31, 23, 59, 59, 999999)
_ANY_STAMPS = st.one_of(
    st.datetimes(min_value=datetime(1970, 1, 1), max_value=_LAST, timezones=st.just(UTC)),
    st.datetimes(min_value=datetime(1970, 1, 1), max_value=_LAST).map(
        lambda value: value.replace(microsecond=999999)
    ),
    st.datetimes(
        min_value=datetime(1970, 1, 2),
        max_value=datetime(9999, 12, 30),
        timezones=st.sampled_from([timezone(timedelta(hours=5)), timezone(-timedelta(hours=3.5))]),
    ).map(lambda value: value.replace(microsecond=999999)),
)


def _whole_seconds(value: datetime) -> int:
    """The seconds since 1970 of ``value`` (naive: UTC), rounded down, in integers."""
    return calendar.timegm(value.utctimetuple())


def _at(seconds: int) -> datetime:
    """A whole second as a datetime: a float holds it exactly, whoever encodes it."""
    return _EPOCH + timedelta(seconds=seconds)


@given(_ANY_STAMPS)
def test_the_timestamp_is_whole_seconds_rounded_down_in_any_year(value: datetime) -> None:
    seconds = _whole_seconds(value)
    assert Properties(timestamp=value).marshal()[2:] == struct.pack(">Q", seconds)
    # pamqp's own encoding, where a header sends the short path to it.
    headers: dict[str, Any] = {"n": 1}
    assert Properties(timestamp=value, headers=headers).marshal() == (
        aiormq.spec.Basic.Properties(timestamp=_at(seconds), headers=headers).marshal()
    )


@given(_ANY_STAMPS)
def test_an_events_timestamp_property_is_its_time_rounded_down(value: datetime) -> None:
    """Both ways an event reaches the broker: the relay's properties, and
    aio-pika's (``aio_pika.Message(body, **amqp_properties(event))``)."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    event = Event.new("thing.made", {}, tenant_id=uuid.uuid4(), timestamp=value)
    properties = amqp_properties(event)
    whole = {**properties, "timestamp": _at(_whole_seconds(value))}
    assert spec_properties(properties).marshal() == spec_properties(whole).marshal()
    sent = aio_pika.Message(b"{}", **properties).properties.marshal()
    assert sent == aio_pika.Message(b"{}", **whole).properties.marshal()
