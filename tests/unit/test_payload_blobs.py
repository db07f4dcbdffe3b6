"""A payload blob is held to what an inline payload (a Struct) can be."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.blobs.payloads import MAX_DEPTH, InvalidPayloadBlob, payload_from_blob

NAME = "blobs/" + "0" * 64


def _nested(depth: int) -> bytes:
    """An object nesting ``depth`` levels: an object, arrays, an empty object."""
    return ('{"a": ' + "[" * (depth - 2) + "{}" + "]" * (depth - 2) + "}").encode()


def test_an_object_comes_back() -> None:
    assert payload_from_blob(b'{"a": [1, {"b": null}]}', NAME) == {"a": [1, {"b": None}]}


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "not JSON"),
        (b"\xff\xfe\x00", "not JSON"),
        (b"[1, 2]", "holds a JSON list"),
        (b'"text"', "holds a JSON str"),
        (b'{"a": NaN}', "not JSON"),
        (b'{"a": Infinity}', "not JSON"),
        (b"[" * 5000 + b"]" * 5000, "deeper"),  # past Python's recursion limit
    ],
)
def test_what_is_not_a_payload_is_refused_with_why(data: bytes, why: str) -> None:
    with pytest.raises(InvalidPayloadBlob, match=why):
        payload_from_blob(data, NAME)


def test_the_depth_limit_is_exact() -> None:
    assert payload_from_blob(_nested(MAX_DEPTH), NAME)
    with pytest.raises(InvalidPayloadBlob, match="deeper"):
        payload_from_blob(_nested(MAX_DEPTH + 1), NAME)


@given(
    st.dictionaries(
        st.text(max_size=5),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=5),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
            max_leaves=20,
        ),
        max_size=4,
    )
)
def test_any_shallow_json_object_round_trips(payload: dict[str, object]) -> None:
    assert payload_from_blob(json.dumps(payload).encode(), NAME) == payload
