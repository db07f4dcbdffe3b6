"""A submit request's payload, labels and a list's waiting_code, each checked at
its bounds: what is taken, and the refusal (field, message) of what is not."""

from __future__ import annotations

from typing import Any

import pytest

from jobplane.errors import InvalidArgument, shown
from jobplane.server.job_requests import (
    MAX_PAYLOAD_DEPTH,
    check_labels,
    check_payload,
    check_waiting_code,
)
from jobplane.types import JobState


def _refused(call: Any, *args: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as refused:
        call(*args)
    return refused.value


def _nested(depth: int, inner: Any) -> dict[str, Any]:
    """``depth`` objects, each under the key ``k`` of the one before, ``inner`` in the last."""
    value: Any = inner
    for _ in range(depth):
        value = {"k": value}
    return dict(value)


def test_a_payload_nested_to_the_limit_is_taken_and_one_deeper_refused() -> None:
    assert MAX_PAYLOAD_DEPTH == 32
    check_payload(_nested(32, 1))
    check_payload(_nested(31, [1, "s", None, True, 1.5]))
    empty: tuple[Any, ...] = ({}, [])
    for inner in empty:
        refused = _refused(check_payload, _nested(32, inner))
        assert (refused.field, refused.metadata) == ("payload", {"limit": "32"})
        assert refused.message == (
            "payload is nested more than 32 objects or arrays deep at "
            + shown("payload" + ".k" * 32)
        )
    # Arrays count as objects do, at any place in the payload.
    check_payload({"a": [0] * 3 + [_nested(30, 0)]})
    assert _refused(check_payload, {"a": [0] * 3 + [_nested(31, 0)]}).message.endswith(
        "at " + shown("payload.a[3]" + ".k" * 30)
    )


def test_what_json_or_jsonb_cannot_carry_is_refused_where_it_is() -> None:
    cases = [
        ({"x": [0, {"y": "a\x00"}]}, "payload has a NUL character at 'payload.x[1].y'"),
        ({"a": {"k\x00": 1}}, "payload has a key with a NUL character at 'payload.a.k\\x00'"),
        ({"v": [float("inf")]}, "payload has inf at 'payload.v[0]'; JSON numbers are finite"),
        ({"v": float("-inf")}, "payload has -inf at 'payload.v'; JSON numbers are finite"),
        ({"v": {"w": float("nan")}}, "payload has nan at 'payload.v.w'; JSON numbers are finite"),
    ]
    for payload, message in cases:
        refused = _refused(check_payload, payload)
        assert (refused.field, refused.message) == ("payload", message)
    check_payload({"s": "a\x01b", "f": 1e308, "i": 10**30, "k\x01": None})


def test_labels_are_taken_up_to_their_bounds() -> None:
    check_labels({})
    check_labels({f"k{i}": "v" * 256 for i in range(64)})
    for key in ("a", "0", "a" * 63, "a/b.c_d-e", "team.io/name"):
        check_labels({key: ""})
    check_labels({"k": "\x01 é"})


def test_labels_past_their_bounds_are_refused_on_their_field() -> None:
    refused = _refused(check_labels, {f"k{i}": "" for i in range(65)})
    assert (refused.field, refused.message) == ("labels", "at most 64 labels")
    for key in ("", "a" * 64, "-a", "a-", ".a", "A", "a b", "a\n", "é"):
        refused = _refused(check_labels, {"ok": "", key: ""})
        assert (refused.field, refused.message) == (
            "labels",
            f"label key {shown(key)} must be 1..63 lowercase letters, digits, '.', '_', '-', '/'",
        )
    refused = _refused(check_labels, {"k": "v" * 257})
    assert (refused.field, refused.message) == (
        "labels[k]",
        "label 'k' is longer than 256 characters",
    )
    refused = _refused(check_labels, {"k": "v\x00"})
    assert (refused.field, refused.message) == ("labels[k]", "label 'k' has a NUL character")


def test_a_waiting_code_is_an_upper_snake_code_of_queued_jobs() -> None:
    for code, state in (
        ("", JobState.RUNNING),
        ("SCHEDULED", None),
        ("CONCURRENCY_LIMIT", JobState.QUEUED),
        ("A", None),
        ("A" + "_9" * 31 + "Z", None),  # 64 characters
    ):
        check_waiting_code(code, state)
    for code in ("scheduled", "1A", "_A", "A" * 65, "A-B", "A\n", " A"):
        refused = _refused(check_waiting_code, code, None)
        assert (refused.field, refused.message) == (
            "waiting_code",
            f"waiting_code {shown(code)} must be a code such as SCHEDULED or "
            "CONCURRENCY_LIMIT (UPPER_SNAKE, at most 64 characters)",
        )
    for state in (JobState.RUNNING, JobState.SUCCEEDED):
        refused = _refused(check_waiting_code, "SCHEDULED", state)
        assert (refused.field, refused.message) == (
            "waiting_code",
            f"waiting_code names why a QUEUED job waits: not with state {state.value}",
        )
