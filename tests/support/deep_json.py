"""JSON values nested to any depth, as protobuf bytes built on the wire.

``Struct.update`` and ``CopyFrom`` parse what they copy and refuse depths
past protobuf's 100 levels: bodies that deep are made here byte by byte.
"""

from __future__ import annotations


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def wire_field(number: int, data: bytes) -> bytes:
    """A length-delimited field ``number`` holding ``data``."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def deep_struct(arrays: list[bool]) -> bytes:
    """A Struct nested ``len(arrays) + 1`` objects or arrays deep, itself counted:
    level i below it an array when ``arrays[i - 1]``, else an object."""
    kinds = [False, *arrays]
    inner = b""  # the deepest level: empty, whichever it is
    for level in range(len(arrays), 0, -1):
        # Value.list_value or Value.struct_value, in ListValue.values or Struct.fields["a"].
        value = wire_field(6 if kinds[level] else 5, inner)
        if kinds[level - 1]:
            inner = wire_field(1, value)
        else:
            inner = wire_field(1, wire_field(1, b"a") + wire_field(2, value))
    return inner
