"""Hypothesis strategies for any protobuf message, built from its descriptor.

Nothing here knows jobplane: :func:`requests` walks a message descriptor and
draws every field of every type, odd values first — extreme and non-finite
numbers, unknown enum values, strings with NUL, astral and combining
characters, very long strings, Structs nested past protobuf's limits,
Durations and Timestamps outside their range. ``hints`` mixes in plausible
values per field (by full name) so that draws also get past validation.

Strategies draw *fillers*, functions that write into a fresh message, rather
than messages: protobuf's ``CopyFrom`` parses what it copies and refuses the
deep Structs this module means to send.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, overload

from google.protobuf import descriptor, message, struct_pb2
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

Fill = Callable[[Any], None]
Hints = Mapping[str, st.SearchStrategy[Any]]

FD = descriptor.FieldDescriptor

_INT_RANGES: dict[int, tuple[int, int]] = {
    **dict.fromkeys((FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32), (-(2**31), 2**31 - 1)),
    **dict.fromkeys((FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64), (-(2**63), 2**63 - 1)),
    **dict.fromkeys((FD.TYPE_UINT32, FD.TYPE_FIXED32), (0, 2**32 - 1)),
    **dict.fromkeys((FD.TYPE_UINT64, FD.TYPE_FIXED64), (0, 2**64 - 1)),
}

# protobuf's own limits of Duration and Timestamp, and one step past them.
_DURATION_SECONDS = (0, 1, -1, 604_800, 604_801, 315_576_000_000, 315_576_000_001)
_TIMESTAMP_SECONDS = (0, -62_135_596_800, -62_135_596_801, 253_402_300_799, 253_402_300_800)
_NANOS = (0, 1, -1, 999_999_999, 1_000_000_000, -1_000_000_000, 2**31 - 1, -(2**31))


def integers(low: int, high: int) -> st.SearchStrategy[int]:
    """Integers in [low, high], the bounds and small values often."""
    edges = sorted({v for v in (low, low + 1, -1, 0, 1, high - 1, high) if low <= v <= high})
    return st.one_of(st.sampled_from(edges), st.integers(low, high))


# Characters a protobuf string can hold (UTF-8, so no surrogates), and some
# that make trouble in one layer or another.
_ANY_CHARACTER = st.characters(codec="utf-8")
_ODD_CHARACTERS = st.sampled_from(
    [
        "\x00",
        "\n",
        "\r",
        "\t",
        "\x7f",
        "\x85",
        "\u2028",
        "\u202e",
        "\u0301",
        "\ufeff",
        "\ufffd",
        "\uffff",
        "\U0001f600",
        "\U0010ffff",
        "%",
        "\\",
        '"',
        "'",
        "/",
        ".",
    ]
)
_CHARACTERS = st.one_of(_ANY_CHARACTER, _ODD_CHARACTERS)
# Lengths at the limits of every layer: AMQP short strings (255 bytes), our
# own limits, and far past them.
_LONG_LENGTHS = (63, 64, 127, 128, 129, 255, 256, 257, 1024, 1025, 10_000)


def texts(max_size: int = 24) -> st.SearchStrategy[str]:
    """Short strings of any character, with one odd character (NUL most of
    all: Postgres refuses it), or long runs of one piece."""
    short = st.text(_CHARACTERS, max_size=max_size)
    spiked = st.tuples(short, st.one_of(st.just("\x00"), _ODD_CHARACTERS), short).map("".join)
    # Runs of a 1-, 2- or 4-byte character, or of any piece: limits in
    # characters and in bytes (AMQP counts bytes) both get their edges.
    piece = st.one_of(
        st.sampled_from(["c", "\u00e9", "\U0001f600"]), st.text(_CHARACTERS, min_size=1, max_size=2)
    )
    long = st.builds(lambda p, n: p * n, piece, st.sampled_from(_LONG_LENGTHS))
    return st.one_of(short, spiked, long)


def floats(width: int = 64) -> st.SearchStrategy[float]:
    """Any float, NaN and ±Infinity included, and the edges of a double."""
    edges = st.sampled_from(
        [0.0, -0.0, 1.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 2.0**53 + 2]
    )
    return st.one_of(edges, st.floats(width=width))  # type: ignore[arg-type]


# -- JSON-like values for Struct, Value and ListValue --------------------------


@dataclass(frozen=True)
class NoKind:
    """A Value with no kind set (JSON has only null for it)."""


@dataclass(frozen=True)
class NullOf:
    """A Value whose null_value holds an enum number NullValue does not define."""

    number: int


@dataclass(frozen=True)
class Chain:
    """A value nested ``len(kinds)`` containers deep: True an object, False a list."""

    kinds: tuple[bool, ...]
    leaf: Any


_LEAVES: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    floats(),
    st.sampled_from([math.nan, math.inf, -math.inf]),
    integers(-(2**53), 2**53).map(float),
    texts(),
    st.just(NoKind()),
    st.integers(1, 2**31 - 1).map(NullOf),
)
# Depths around every limit on the way: ours (32), what protobuf decodes
# inside a request or a list of jobs (33 objects, 49 lists), its hard 100.
_DEPTHS = st.one_of(
    st.sampled_from([31, 32, 33, 34, 48, 49, 50, 99, 100, 101]), st.integers(1, 120)
)


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Trees of objects, lists and leaves; or one chain of any depth."""
    trees = st.recursive(
        _LEAVES,
        lambda kids: st.one_of(
            st.lists(kids, max_size=4), st.dictionaries(texts(12), kids, max_size=4)
        ),
        max_leaves=max_leaves,
    )
    chains = st.builds(
        lambda kinds, leaf: Chain(tuple(kinds), leaf),
        _DEPTHS.flatmap(lambda n: st.lists(st.booleans(), min_size=n, max_size=n)),
        _LEAVES,
    )
    return st.one_of(trees, chains)


def plain(value: Any) -> Any:
    """A drawn JSON-like value as plain JSON (NaN and Infinity stay as they are)."""
    if isinstance(value, Chain):
        inner = plain(value.leaf)
        for is_object in reversed(value.kinds):
            inner = {"k": inner} if is_object else [inner]
        return inner
    if isinstance(value, NoKind | NullOf):
        return None
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def fill_value(target: struct_pb2.Value, value: Any) -> None:
    """Write a drawn JSON-like value into a Value, in place."""
    if isinstance(value, Chain):
        for is_object in value.kinds:
            target = (
                target.struct_value.fields["k"] if is_object else target.list_value.values.add()
            )
        fill_value(target, value.leaf)
    elif isinstance(value, NoKind):
        pass
    elif isinstance(value, NullOf):
        target.null_value = value.number  # type: ignore[assignment]
    elif value is None:
        target.null_value = struct_pb2.NULL_VALUE
    elif isinstance(value, bool):
        target.bool_value = value
    elif isinstance(value, int | float):
        target.number_value = value
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, list):
        target.list_value.SetInParent()
        for item in value:
            fill_value(target.list_value.values.add(), item)
    else:
        fill_struct(target.struct_value, value)


def fill_struct(target: struct_pb2.Struct, value: Any) -> None:
    """Write a drawn object (a dict, or a chain under key "k") into a Struct."""
    target.SetInParent()
    if isinstance(value, Chain):
        fill_value(target.fields["k"], value)
        return
    for key, item in value.items():
        fill_value(target.fields[key], item)


def _structs() -> st.SearchStrategy[Fill]:
    objects = st.one_of(st.dictionaries(texts(12), json_values(), max_size=5), json_values())
    return objects.map(
        lambda v: lambda m: fill_struct(m, v if isinstance(v, dict | Chain) else {"v": v})
    )


def _values() -> st.SearchStrategy[Fill]:
    return json_values().map(lambda v: lambda m: fill_value(m, v))


def _list_values() -> st.SearchStrategy[Fill]:
    def filler(items: list[Any]) -> Fill:
        def fill(m: Any) -> None:
            for item in items:
                fill_value(m.values.add(), item)

        return fill

    return st.lists(json_values(), max_size=4).map(filler)


def _seconds_and_nanos(seconds: tuple[int, ...]) -> st.SearchStrategy[Fill]:
    low, high = _INT_RANGES[FD.TYPE_INT64]
    return st.builds(
        _set_seconds_nanos,
        st.one_of(st.sampled_from(seconds + tuple(-s for s in seconds)), integers(low, high)),
        st.one_of(st.sampled_from(_NANOS), integers(-(2**31), 2**31 - 1)),
    )


def _set_seconds_nanos(seconds: int, nanos: int) -> Fill:
    def fill(m: Any) -> None:
        m.seconds, m.nanos = seconds, nanos

    return fill


_WELL_KNOWN: dict[str, Callable[[], st.SearchStrategy[Fill]]] = {
    "google.protobuf.Struct": _structs,
    "google.protobuf.Value": _values,
    "google.protobuf.ListValue": _list_values,
    "google.protobuf.Duration": lambda: _seconds_and_nanos(_DURATION_SECONDS),
    "google.protobuf.Timestamp": lambda: _seconds_and_nanos(_TIMESTAMP_SECONDS),
}


# -- any message ------------------------------------------------------------------


def requests(
    message_descriptor: descriptor.Descriptor,
    hints: Hints | None = None,
    *,
    odd: str | None = None,
) -> st.SearchStrategy[message.Message]:
    """Messages of ``message_descriptor``.

    Half are wild (every field drawn from anything, or left unset); half are
    plausible but for one field drawn from anything, so that each field's own
    checks are reached even where another field is checked first. With
    ``odd``, all are plausible but for that field.
    """
    cls = GetMessageClass(message_descriptor)
    hints = hints or {}

    def build(fill: Fill) -> message.Message:
        made = cls()
        fill(made)
        return made

    if odd is not None:
        return _around(message_descriptor, hints, odd).map(build)
    names = st.sampled_from([f.name for f in message_descriptor.fields])
    return st.one_of(
        fillers(message_descriptor, hints),
        names.flatmap(partial(_around, message_descriptor, hints)),
    ).map(build)


def fillers(message_descriptor: descriptor.Descriptor, hints: Hints) -> st.SearchStrategy[Fill]:
    """Fillers for a message of this descriptor, every field wild or unset."""
    well_known = _WELL_KNOWN.get(message_descriptor.full_name)
    if well_known is not None:
        return well_known()
    parts = {
        field.name: st.one_of(st.none(), _field(field, hints))
        for field in message_descriptor.fields
    }
    return st.fixed_dictionaries(parts).map(_fill_all)


def _around(
    message_descriptor: descriptor.Descriptor, hints: Hints, odd: str
) -> st.SearchStrategy[Fill]:
    """Field ``odd`` drawn from anything (its hint too), every other one plausible."""
    parts: dict[str, st.SearchStrategy[Fill | None]] = {}
    for field in message_descriptor.fields:
        if field.name == odd:
            parts[field.name] = _field(field, hints)
        else:
            # A hint may be what it takes to pass (a required field): no None.
            plausible = _field(field, hints, only_hints=True)
            parts[field.name] = st.none() if plausible is None else plausible
    return st.fixed_dictionaries(parts).map(_fill_all)


def _fill_all(drawn: dict[str, Fill | None]) -> Fill:
    def fill(m: Any) -> None:
        for part in drawn.values():
            if part is not None:
                part(m)

    return fill


@overload
def _field(
    field: descriptor.FieldDescriptor, hints: Hints, *, only_hints: Literal[False] = False
) -> st.SearchStrategy[Fill]: ...
@overload
def _field(
    field: descriptor.FieldDescriptor, hints: Hints, *, only_hints: bool
) -> st.SearchStrategy[Fill] | None: ...
def _field(
    field: descriptor.FieldDescriptor, hints: Hints, *, only_hints: bool = False
) -> st.SearchStrategy[Fill] | None:
    """Fillers of one field: hinted or anything; with ``only_hints``, hinted or None."""
    name = field.name
    if _is_map(field):
        entry = _message_type(field)
        key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
        keys = _hinted(f"{field.full_name}.key", _scalar(key_field), hints, only_hints)
        if value_field.type == FD.TYPE_MESSAGE:
            if keys is None or only_hints:
                return None
            sub = fillers(_message_type(value_field), hints)
            return st.dictionaries(keys, sub, max_size=4).map(partial(_fill_message_map, name))
        values = _hinted(f"{field.full_name}.value", _scalar(value_field), hints, only_hints)
        if keys is None or values is None:
            return None
        return st.dictionaries(keys, values, max_size=4).map(partial(_fill_scalar_map, name))
    if field.type == FD.TYPE_MESSAGE:
        # A hint for a message field draws fillers, like the field's own strategy.
        hint = hints.get(field.full_name)
        if only_hints:
            return None if hint is None else hint.map(partial(_fill_message, name))
        sub = fillers(_message_type(field), hints)
        if hint is not None:
            sub = st.one_of(hint, sub)
        if _is_repeated(field):
            return st.lists(sub, max_size=3).map(partial(_fill_messages, name))
        return sub.map(partial(_fill_message, name))
    scalar = _hinted(field.full_name, _scalar(field), hints, only_hints)
    if scalar is None:
        return None
    if _is_repeated(field):
        return st.lists(scalar, max_size=4).map(partial(_fill_scalars, name))
    return scalar.map(partial(_fill_scalar, name))


def _fill_message_map(name: str, drawn: dict[Any, Fill]) -> Fill:
    def fill(m: Any) -> None:
        for key, fill_entry in drawn.items():
            fill_entry(getattr(m, name)[key])

    return fill


def _fill_scalar_map(name: str, drawn: dict[Any, Any]) -> Fill:
    return lambda m: getattr(m, name).update(drawn)


def _fill_messages(name: str, drawn: list[Fill]) -> Fill:
    def fill(m: Any) -> None:
        for fill_one in drawn:
            fill_one(getattr(m, name).add())

    return fill


def _fill_message(name: str, drawn: Fill) -> Fill:
    return lambda m: _fill_present(getattr(m, name), drawn)


def _fill_scalars(name: str, drawn: list[Any]) -> Fill:
    return lambda m: getattr(m, name).extend(drawn)


def _fill_scalar(name: str, drawn: Any) -> Fill:
    return lambda m: setattr(m, name, drawn)


def _message_type(field: descriptor.FieldDescriptor) -> descriptor.Descriptor:
    message_type = field.message_type
    assert message_type is not None, field.full_name
    return message_type


def _fill_present(target: Any, fill: Fill) -> None:
    target.SetInParent()
    fill(target)


def _hinted(
    full_name: str, generic: st.SearchStrategy[Any], hints: Hints, only_hints: bool
) -> st.SearchStrategy[Any] | None:
    hint = hints.get(full_name)
    if only_hints:
        return hint
    return generic if hint is None else st.one_of(hint, generic)


def _scalar(field: descriptor.FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_RANGES:
        return integers(*_INT_RANGES[kind])
    if kind == FD.TYPE_DOUBLE:
        return floats()
    if kind == FD.TYPE_FLOAT:
        return floats(width=32)
    if kind == FD.TYPE_BOOL:
        return st.booleans()
    if kind == FD.TYPE_STRING:
        return texts()
    if kind == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FD.TYPE_ENUM:
        enum_type = field.enum_type
        assert enum_type is not None, field.full_name
        known = [v.number for v in enum_type.values]
        # proto3 enums are open: any int32 travels.
        return st.one_of(st.sampled_from(known), integers(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def _is_repeated(field: descriptor.FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _is_map(field: descriptor.FieldDescriptor) -> bool:
    return (
        _is_repeated(field)
        and field.type == FD.TYPE_MESSAGE
        and _message_type(field).GetOptions().map_entry
    )
