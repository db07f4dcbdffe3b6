"""The limits at the door, without a server: conversion never raises, errors stay short,
and the largest job the server accepts is one the SDK can read."""

from __future__ import annotations

import json
import math

import pytest
from google.protobuf import duration_pb2, struct_pb2

from jobplane.client._channel import _CHANNEL_OPTIONS, MAX_RECEIVE_BYTES
from jobplane.config import MAX_PAYLOAD_BYTES_LIMIT, ConfigError, Settings
from jobplane.convert import dict_from_struct, seconds_from_duration, struct_from_dict
from jobplane.errors import InvalidArgument, shown
from jobplane.server import JobplaneServer
from jobplane.server.service import (
    MAX_CORRELATION_ID_BYTES,
    STRUCT_BYTES_PER_JSON_BYTE,
    max_request_bytes,
)
from jobplane.store.engine import create_engine
from jobplane.topology import load_topology
from jobplane.v1 import jobs_pb2
from tests.support.deep_json import wire_field


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


def _worst_struct_bytes(json_bytes: int) -> tuple[bytes, int]:
    """The Struct of ``{"n": [0, 0, ...]}`` as long as ``json_bytes`` allows, and its length.

    Made as bytes: building two million Values one by one takes seconds.
    """
    count = (json_bytes - len('{"n":[]}') + 1) // 2
    # ListValue.values (field 1) holding a Value of number_value (field 2, fixed64) 0.
    values = b"\x0a\x09\x11" + b"\x00" * 8
    listed = values * count
    value = wire_field(6, listed)  # Value.list_value
    entry = wire_field(1, b"n") + wire_field(2, value)  # map entry "n" -> value
    return wire_field(1, entry), count  # Struct.fields


def test_the_sdk_reads_the_largest_job_the_server_can_hold() -> None:
    wire, count = _worst_struct_bytes(MAX_PAYLOAD_BYTES_LIMIT)
    assert len(json.dumps({"n": [0] * count}, separators=(",", ":"))) <= MAX_PAYLOAD_BYTES_LIMIT
    job = jobs_pb2.Job(
        name="jobs/" + "0" * 36,
        type="a" * 128,
        request_id="\U0001f600" * 256,
        correlation_id="c" * MAX_CORRELATION_ID_BYTES,
        labels={f"{i:02d}" + "k" * 61: "\U0001f600" * 256 for i in range(64)},
        progress_message="\U0001f600" * 4096,
        waiting_reason="w" * 4096,
        error=jobs_pb2.JobError(code="X" * 64, message="\U0001f600" * 4096),
    )
    job.payload.MergeFromString(wire)
    job.result.MergeFromString(wire)
    # The payload and the result each take the most a Struct can take of
    # their JSON size, and the SDK still has a quarter of its limit to spare.
    assert job.payload.ByteSize() <= MAX_PAYLOAD_BYTES_LIMIT * STRUCT_BYTES_PER_JSON_BYTE
    assert job.payload.ByteSize() > 0.99 * MAX_PAYLOAD_BYTES_LIMIT * STRUCT_BYTES_PER_JSON_BYTE
    assert job.ByteSize() < 0.75 * MAX_RECEIVE_BYTES
    assert ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES) in _CHANNEL_OPTIONS


@pytest.mark.parametrize("value", [str(MAX_PAYLOAD_BYTES_LIMIT + 1), str(2**31)])
def test_the_payload_limit_has_a_ceiling(value: str) -> None:
    with pytest.raises(ConfigError, match="at most"):
        Settings.from_env({"JOBPLANE_MAX_PAYLOAD_BYTES": value})
    settings = Settings.from_env({"JOBPLANE_MAX_PAYLOAD_BYTES": str(MAX_PAYLOAD_BYTES_LIMIT)})
    assert settings.max_payload_bytes == MAX_PAYLOAD_BYTES_LIMIT


def test_a_server_refuses_a_payload_limit_past_the_ceiling() -> None:
    engine = create_engine("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(ValueError, match="max_payload_bytes"):
        JobplaneServer(
            engine,
            "postgresql://nobody@127.0.0.1:1/none",
            load_topology(),
            max_payload_bytes=MAX_PAYLOAD_BYTES_LIMIT + 1,
        )
