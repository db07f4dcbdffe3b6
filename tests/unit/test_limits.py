"""The limits at the door, without a server: conversion never raises, errors stay short."""

from __future__ import annotations

import math

import pytest
from google.protobuf import duration_pb2, struct_pb2

from jobplane.convert import dict_from_struct, seconds_from_duration, struct_from_dict
from jobplane.errors import InvalidArgument, shown
from jobplane.server.service import MAX_CORRELATION_ID_BYTES, max_request_bytes
from jobplane.v1 import jobs_pb2


@pytest.mark.parametrize("max_payload", [1024, 64 * 1024, 256 * 1024])
def test_the_receive_limit_holds_the_largest_valid_request(max_payload: int) -> None:
    # The payload's JSON at its limit, of what grows most as a Struct: "0,".
    numbers = [0] * ((max_payload - len('{"n":[]}') + 1) // 2)
    request = jobs_pb2.SubmitJobRequest(
        type="a" * 128,
        payload=struct_from_dict({"n": numbers}),
        request_id="\U0001f600" * 256,
        correlation_id="c" * MAX_CORRELATION_ID_BYTES,
        max_attempts=100,
        labels={f"{i:02d}" + "k" * 61: "\U0001f600" * 256 for i in range(64)},
        timeout=duration_pb2.Duration(seconds=7 * 24 * 3600, nanos=999_999_999),
    )
    assert request.ByteSize() <= max_request_bytes(max_payload)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_numbers_convert_for_the_service_to_refuse(value: float) -> None:
    struct = struct_pb2.Struct()
    struct.fields["x"].list_value.values.add().number_value = value
    converted = dict_from_struct(struct)["x"][0]
    assert isinstance(converted, float)
    assert not math.isfinite(converted)


def test_a_value_without_a_kind_converts_to_null() -> None:
    struct = struct_pb2.Struct()
    struct.fields["x"].SetInParent()
    assert dict_from_struct(struct) == {"x": None}


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [(2**62, 0), (315_576_000_001, 0), (-315_576_000_001, 0), (1, -1), (-1, 1), (0, 10**9)],
)
def test_a_duration_outside_protobufs_range_is_invalid(seconds: int, nanos: int) -> None:
    with pytest.raises(InvalidArgument) as info:
        seconds_from_duration(duration_pb2.Duration(seconds=seconds, nanos=nanos), field="t")
    assert info.value.field == "t"


def test_a_valid_duration_converts() -> None:
    duration = duration_pb2.Duration(seconds=-2, nanos=-500_000_000)
    assert seconds_from_duration(duration, field="t") == -2.5


@pytest.mark.parametrize("value", ["x" * 10_000, "\U0001f600" * 10_000, "\x00" * 5_000])
def test_shown_cuts_what_an_error_repeats(value: str) -> None:
    text = shown(value)
    assert len(text) < 100
    assert text.startswith(repr(value)[:10])
    assert str(len(value)) in text


def test_shown_keeps_a_short_value_whole() -> None:
    assert shown("jobs/x") == "'jobs/x'"
