"""Payloads that went by reference: the bytes of a payload blob back into a JSON object.

An inline payload arrives as a protobuf Struct, which bounds its nesting and
cannot hold NaN; a payload blob is any bytes its tenant uploaded, so it is
held to the same rules here before a handler or a foreign worker sees it.
"""

from __future__ import annotations

import json
from typing import Any

#: Nesting of objects and arrays a payload may have: within what a Struct can
#: carry through protobuf's recursion limit of 100 (about three messages a level).
MAX_DEPTH = 32


class InvalidPayloadBlob(ValueError):
    """A payload blob that is not a JSON object jobplane can hand to a handler."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _depth(value: Any) -> int:
    """The deepest nesting of objects and arrays in ``value`` (iterative: no recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break
        stack.extend((child, level + 1) for child in children)
    return deepest


def payload_from_blob(data: bytes, name: str) -> dict[str, Any]:
    """The JSON object of a payload blob; :class:`InvalidPayloadBlob` saying why it is not one."""
    try:
        payload = json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise InvalidPayloadBlob(
            f"the payload blob {name} nests deeper than {MAX_DEPTH} levels"
        ) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError among them
        raise InvalidPayloadBlob(f"the payload blob {name} is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise InvalidPayloadBlob(
            f"the payload blob {name} holds a JSON {type(payload).__name__}, not an object"
        )
    if _depth(payload) > MAX_DEPTH:
        raise InvalidPayloadBlob(f"the payload blob {name} nests deeper than {MAX_DEPTH} levels")
    return payload
