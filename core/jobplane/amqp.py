"""AMQP message properties, encoded on a short path.

Every message the relay publishes carries its properties in a content header
frame, and pamqp encodes them generically: a type lookup and an encoder call
for each property and each header value. That was a fifth of the relay's CPU
per message (docs/performance.md). :class:`Properties` is pamqp's
``Basic.Properties`` with a ``marshal`` that encodes the usual shapes — string
properties, a delivery mode and priority, a timestamp, headers of string
values — straight to bytes, and hands anything else to pamqp's own
encoding, so the bytes (and the errors) are pamqp's either way: a unit test
holds the two to the same output with hypothesis. One difference, on both
paths: the timestamp is its time rounded down to the second in integers,
where pamqp's float rounds a far year's ``…59.999999`` up.
"""

from __future__ import annotations

import struct
from datetime import UTC, datetime, timedelta
from typing import Any

import aiormq

_BASE = aiormq.spec.Basic.Properties
_FLAGS = struct.Struct(">H")
_LONG = struct.Struct(">I")
_STAMP = struct.Struct(">Q")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SECOND = timedelta(seconds=1)
_SHORT_STRINGS = frozenset(
    name for name in _BASE.__slots__ if getattr(_BASE, f"_{name}", "") == "shortstr"
)
# The properties in the order they are encoded, with their flag bits.
_ORDER = tuple((name, _BASE.flags[name]) for name in _BASE.__slots__)


class _Unusual(Exception):
    """A value the short path does not encode: pamqp's encoding takes over."""


def _short_string(value: Any) -> bytes:
    if type(value) is not str:
        raise _Unusual
    data = value.encode("utf-8")
    if len(data) > 255:
        raise _Unusual
    return bytes((len(data),)) + data


def _table(value: Any) -> bytes:
    if type(value) is not dict:
        raise _Unusual
    parts: list[bytes] = []
    for key, item in sorted(value.items()):
        if type(key) is not str or type(item) is not str:
            raise _Unusual
        name = key.encode("utf-8")
        if len(name) > 128:
            raise _Unusual  # pamqp truncates it, and says so
        data = item.encode("utf-8")
        parts += (bytes((len(name),)), name, b"S", _LONG.pack(len(data)), data)
    body = b"".join(parts)
    return _LONG.pack(len(body)) + body


def _octet(value: Any) -> bytes:
    if type(value) is not int or not 0 <= value <= 255:
        raise _Unusual
    return bytes((value,))


def whole_seconds(value: datetime) -> int:
    """The seconds since 1970 of ``value`` (naive: UTC), rounded down.

    In integers: ``int(value.timestamp())`` goes through a float, which far
    from 1970 holds too few digits to keep ``…59.999999`` below the next
    second and rounds it up (pamqp encodes a datetime that way).
    """
    if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
        value = value.replace(tzinfo=UTC)
    return (value - _EPOCH) // _SECOND


def _timestamp(value: Any) -> bytes:
    if type(value) is not datetime:
        raise _Unusual
    seconds = whole_seconds(value)
    if seconds < 0:
        raise _Unusual  # pamqp's error, from its own encoding
    return _STAMP.pack(seconds)


_ENCODERS = {
    **dict.fromkeys(_SHORT_STRINGS, _short_string),
    "headers": _table,
    "delivery_mode": _octet,
    "priority": _octet,
    "timestamp": _timestamp,
}


class Properties(_BASE):
    """pamqp's ``Basic.Properties``, marshalled on the short path (module docstring)."""

    def marshal(self) -> bytes:
        flags = 0
        parts = []
        try:
            for name, flag in _ORDER:
                value = getattr(self, name)
                if value is None or value == "":
                    continue
                flags |= flag
                parts.append(_ENCODERS[name](value))
        except _Unusual:
            stamp = self.timestamp
            if type(stamp) is datetime and whole_seconds(stamp) >= 0:
                # Rounded down to a whole second first: a float holds that
                # exactly, so pamqp's encoding writes it as whole_seconds does.
                fields = {name: getattr(self, name) for name in _BASE.__slots__}
                fields["timestamp"] = _EPOCH + timedelta(seconds=whole_seconds(stamp))
                return bytes(_BASE(**fields).marshal())
            return bytes(super().marshal())
        return _FLAGS.pack(flags) + b"".join(parts)
