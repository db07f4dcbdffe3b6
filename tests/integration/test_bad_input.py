"""Bad input gets a precise, small INVALID_ARGUMENT naming its field, and writes nothing.

Each test here is one input the server once answered with INTERNAL, with an
oversized error, or accepted although a later call or the broker could not
carry it.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc
import pytest
from google.protobuf import duration_pb2

from jobplane.client import InvalidArgument, JobState
from jobplane.convert import struct_from_dict
from jobplane.server.service import (
    MAX_BATCH_REQUEST_BYTES,
    MAX_PAYLOAD_DEPTH,
    max_request_bytes,
)
from jobplane.v1 import jobs_pb2, jobs_pb2_grpc
from tests.support.answers import check_refusal
from tests.support.deep_json import deep_struct, wire_field
from tests.support.stack import Stack

# Only the server: no relay or worker writes rows while a test counts them.
pytestmark = pytest.mark.stack(relay=False, worker=False)

NOTHING = {"jobs": 0, "job_events": 0, "outbox": 0}

# Calls of raw bytes: no serializer on either side.
Raw = grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]
RawStream = grpc.aio.UnaryStreamMultiCallable[bytes, bytes]


async def refused(stack: Stack, call: Awaitable[Any], field: str) -> None:
    """``call`` raises INVALID_ARGUMENT for ``field``, precisely, and writes nothing."""
    before = await stack.counts()
    with pytest.raises(InvalidArgument) as info:
        await call
    assert info.value.field == field
    cause = info.value.__cause__
    assert isinstance(cause, grpc.aio.AioRpcError)
    refusal = check_refusal(cause)
    assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    assert await stack.counts() == before


@pytest.fixture
async def stub(stack: Stack) -> AsyncIterator[jobs_pb2_grpc.JobServiceAsyncStub]:
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        yield jobs_pb2_grpc.JobServiceStub(channel)


def auth(stack: Stack) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {stack.key}"),)


async def raw_refused(stack: Stack, call: Awaitable[Any], field: str) -> None:
    """A raw stub's ``call`` is a precise INVALID_ARGUMENT for ``field``; nothing written."""
    before = await stack.counts()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    refusal = check_refusal(info.value)
    assert refusal.code == grpc.StatusCode.INVALID_ARGUMENT, refusal
    assert refusal.field == field
    assert await stack.counts() == before


# -- NUL characters: Postgres refuses them in text and jsonb -----------------


@pytest.mark.parametrize(
    ("payload", "labels"),
    [
        pytest.param({"a\x00b": 1}, {}, id="payload-key"),
        pytest.param({"a": "x\x00y"}, {}, id="payload-value"),
        pytest.param({"a": [{"b": ["\x00"]}]}, {}, id="payload-nested-value"),
        pytest.param({"a": {"\x00": None}}, {}, id="payload-nested-key"),
        pytest.param({}, {"team": "b\x00i"}, id="label-value"),
    ],
)
async def test_nul_in_payload_or_label_is_refused(
    stack: Stack, payload: dict[str, Any], labels: dict[str, str]
) -> None:
    field = "payload" if payload else "labels[team]"
    await refused(stack, stack.client().submit("demo.echo", payload, labels=labels), field)
    assert await stack.counts() == NOTHING


@pytest.mark.parametrize("field", ["request_id", "correlation_id"])
async def test_nul_in_an_id_is_refused(stack: Stack, field: str) -> None:
    ids = {"request_id": "", "correlation_id": "", field: "order\x0042"}
    call = stack.client().submit(
        "demo.echo", {}, request_id=ids["request_id"], correlation_id=ids["correlation_id"]
    )
    await refused(stack, call, field)


async def test_nul_in_a_job_type_is_refused(stack: Stack) -> None:
    await refused(stack, stack.client().submit("demo.echo\x00", {}), "type")


async def test_nul_in_a_cancel_reason_is_refused(stack: Stack) -> None:
    client = stack.client()
    job = await client.submit("demo.echo", {})
    await refused(stack, client.cancel(job.name, reason="because\x00"), "reason")
    assert (await client.get(job.name)).state is JobState.QUEUED


# -- numbers and durations conversion cannot carry ----------------------------


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param({"x": math.nan}, id="nan"),
        pytest.param({"x": math.inf}, id="inf"),
        pytest.param({"x": -math.inf}, id="-inf"),
        pytest.param({"x": [1, {"y": math.nan}]}, id="nested-nan"),
    ],
)
async def test_non_finite_number_in_payload_is_refused(
    stack: Stack, payload: dict[str, Any]
) -> None:
    await refused(stack, stack.client().submit("demo.echo", payload), "payload")
    assert await stack.counts() == NOTHING


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [
        pytest.param(2**62, 0, id="beyond-int"),
        pytest.param(315_576_000_001, 0, id="beyond-10000-years"),
        pytest.param(-(10**12), 0, id="far-negative"),
        pytest.param(1, -1, id="mixed-signs"),
        pytest.param(0, 10**9, id="nanos-overflow"),
        pytest.param(0, 0, id="zero"),
        # Would read back as a timeout of no time at all.
        pytest.param(0, 1, id="one-nanosecond"),
    ],
)
async def test_timeout_outside_the_duration_range_is_refused(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub, seconds: int, nanos: int
) -> None:
    request = jobs_pb2.SubmitJobRequest(
        type="demo.echo", timeout=duration_pb2.Duration(seconds=seconds, nanos=nanos)
    )
    await raw_refused(stack, stub.SubmitJob(request, metadata=auth(stack)), "timeout")


# -- page tokens ---------------------------------------------------------------


def _token(data: Any) -> str:
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


async def test_page_token_of_the_wrong_shape_is_refused(stack: Stack) -> None:
    client = stack.client()
    for _ in range(3):
        await client.submit("demo.echo", {})
    issued = (await client.list(page_size=1)).next_page_token
    real = json.loads(base64.urlsafe_b64decode(issued + "=" * (-len(issued) % 4)))
    shapes: list[Any] = [
        [],
        [real],
        5,
        "t",
        None,
        {"t": 5},
        {**real, "t": 5},
        {**real, "i": 5},
        {**real, "i": ["x"]},
        {**real, "t": "0001-01-01T00:00:00+14:00"},
        {**real, "t": "9999-12-31T23:59:59-14:00"},
        {**real, "f": {"x": 1}},
        b"[" * 100_000,
    ]
    for shape in shapes:
        await refused(stack, client.list(page_size=1, page_token=_token(shape)), "page_token")
    # The token as issued still works.
    assert len((await client.list(page_size=1, page_token=issued)).jobs) == 1


# -- errors stay small whatever they echo ------------------------------------

_LONG = "x" * 10_000
_WIDE = "\U0001f600" * 2_500  # 10,000 bytes of astral characters


@pytest.mark.parametrize("text", [_LONG, _WIDE], ids=["ascii", "astral"])
async def test_errors_do_not_echo_unbounded_input(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub, text: str
) -> None:
    job = await stack.client().submit("demo.echo", {})
    md = auth(stack)
    name = "jobs/" + text
    calls: list[tuple[Awaitable[Any], str]] = [
        (stub.GetJob(jobs_pb2.GetJobRequest(name=name), metadata=md), "name"),
        (stub.GetJob(jobs_pb2.GetJobRequest(name=text), metadata=md), "name"),
        (stub.CancelJob(jobs_pb2.CancelJobRequest(name=name), metadata=md), "name"),
        (stub.RetryJob(jobs_pb2.RetryJobRequest(name=name), metadata=md), "name"),
        (stub.SubmitJob(jobs_pb2.SubmitJobRequest(type=text), metadata=md), "type"),
        (stub.ListJobs(jobs_pb2.ListJobsRequest(type=text), metadata=md), "type"),
        (stub.ListJobs(jobs_pb2.ListJobsRequest(page_token=text), metadata=md), "page_token"),
        (
            stub.SubmitJob(
                jobs_pb2.SubmitJobRequest(type="demo.echo", labels={text: "v"}), metadata=md
            ),
            "labels",
        ),
        (
            stub.SubmitJob(
                jobs_pb2.SubmitJobRequest(type="demo.echo", labels={"k": text}), metadata=md
            ),
            "labels[k]",
        ),
        (
            stub.SubmitJob(
                jobs_pb2.SubmitJobRequest(type="demo.echo", request_id=text), metadata=md
            ),
            "request_id",
        ),
        (
            stub.SubmitJob(
                jobs_pb2.SubmitJobRequest(type="demo.echo", correlation_id=text), metadata=md
            ),
            "correlation_id",
        ),
        (
            stub.CancelJob(jobs_pb2.CancelJobRequest(name=job.name, reason=text), metadata=md),
            "reason",
        ),
    ]
    for call, field in calls:
        await raw_refused(stack, call, field)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.WatchJob(jobs_pb2.WatchJobRequest(name=name), metadata=md):
            pass
    assert check_refusal(info.value).field == "name"


# -- what later calls and the broker must be able to carry -------------------


def _submit_body(payload_struct: bytes, job_type: str = "demo.echo") -> bytes:
    # SubmitJobRequest.type (field 1) and .payload (field 2), on the wire.
    return wire_field(1, job_type.encode()) + wire_field(2, payload_struct)


def _raw_struct(depth: int) -> bytes:
    """A Struct ``depth`` objects deep, {"a": {"a": ... {}}}, as bytes."""
    return deep_struct([False] * (depth - 1))


async def test_payload_nested_deeper_than_the_limit_is_refused(stack: Stack) -> None:
    md = auth(stack)
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        submit: Raw = channel.unary_unary("/jobplane.v1.JobService/SubmitJob")
        before = await stack.counts()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit(_submit_body(_raw_struct(MAX_PAYLOAD_DEPTH + 1)), metadata=md)
        refusal = check_refusal(info.value)
        assert (refusal.code, refusal.field) == (grpc.StatusCode.INVALID_ARGUMENT, "payload")
        assert await stack.counts() == before

        # At the limit the job is accepted, and every read of it still decodes.
        reply = await submit(_submit_body(_raw_struct(MAX_PAYLOAD_DEPTH)), metadata=md)
    name = jobs_pb2.Job.FromString(reply).name
    client = stack.client()
    assert (await client.get(name)).name == name
    assert [j.name for j in (await client.list()).jobs] == [name]


async def test_correlation_id_must_fit_an_amqp_short_string(stack: Stack) -> None:
    client = stack.client()
    await refused(stack, client.submit("demo.echo", {}, correlation_id="c" * 256), "correlation_id")
    # 64 characters, but 256 bytes in UTF-8: AMQP counts bytes.
    wide = "\U0001f600" * 64
    await refused(stack, client.submit("demo.echo", {}, correlation_id=wide), "correlation_id")
    assert await stack.counts() == NOTHING
    # The longest one accepted travels to the worker and the job ends.
    await stack.start_relay()
    await stack.start_worker()
    job = await client.submit("demo.echo", {"k": 1}, correlation_id="\u00e9" * 127 + "c")
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED


async def test_unknown_state_filter_is_refused(
    stack: Stack, stub: jobs_pb2_grpc.JobServiceAsyncStub
) -> None:
    request = jobs_pb2.ListJobsRequest(state=99)  # type: ignore[arg-type]
    await raw_refused(stack, stub.ListJobs(request, metadata=auth(stack)), "state")


# -- bodies the server cannot parse -------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b"\xff\xff\xff\xff", id="garbage"),
        # Fields 1 and 2: a string (or a Struct) in every request but ListJobs'
        # (whose field 1 is an int, and an unknown field of another wire type).
        pytest.param(b"\x0a\x02\xc3\x28\x12\x02\xc3\x28", id="invalid-utf8"),
        pytest.param(b"\x12\x05\x0a\x03\x0a\x01", id="truncated-payload"),
    ],
)
async def test_undecodable_body_is_invalid_argument(stack: Stack, body: bytes) -> None:
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        for method in ("SubmitJob", "GetJob", "ListJobs", "CancelJob", "RetryJob"):
            call: Raw = channel.unary_unary(f"/jobplane.v1.JobService/{method}")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(body, metadata=auth(stack))
            assert check_refusal(info.value).code == grpc.StatusCode.INVALID_ARGUMENT
        watch: RawStream = channel.unary_stream("/jobplane.v1.JobService/WatchJob")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in watch(body, metadata=auth(stack)):
                pass
        assert check_refusal(info.value).code == grpc.StatusCode.INVALID_ARGUMENT
    assert await stack.counts() == NOTHING


@pytest.mark.parametrize(
    ("labels", "job_type", "field"),
    [
        ({}, "demo.echo\n", "type"),
        ({"team\n": "bi"}, "demo.echo", "labels"),
    ],
)
async def test_a_trailing_newline_does_not_pass_for_a_name(
    stack: Stack, labels: dict[str, str], job_type: str, field: str
) -> None:
    await refused(stack, stack.client().submit(job_type, {}, labels=labels), field)


async def test_a_list_of_large_jobs_comes_in_pages_the_client_can_read(stack: Stack) -> None:
    # 24 jobs of 200 KB each: one page of them would pass the 4 MiB a client
    # accepts by default.
    client = stack.client()
    names = {(await client.submit("demo.echo", {"s": "x" * 200_000})).name for _ in range(24)}
    first = await client.list()
    assert 0 < len(first.jobs) < 24
    assert first.next_page_token
    assert {job.name async for job in client.iter_jobs()} == names


def _submit_of_size(size: int) -> bytes:
    """A valid SubmitJobRequest body of exactly ``size`` bytes."""
    filler = size
    while True:
        body = jobs_pb2.SubmitJobRequest(
            type="demo.echo", payload=struct_from_dict({"s": "x" * filler})
        ).SerializeToString()
        if len(body) == size:
            return body
        filler += size - len(body)


async def test_the_receive_limit_takes_the_largest_valid_request_and_no_more(
    stack: Stack,
) -> None:
    limit = stack.server.max_receive_bytes
    # A BatchSubmitJobs body at its bound: more than the largest SubmitJob needs.
    assert limit == MAX_BATCH_REQUEST_BYTES > max_request_bytes(256 * 1024)
    # The payload's JSON at its limit, made of what grows most as a Struct.
    numbers = [0] * ((256 * 1024 - len('{"n":[]}') + 1) // 2)
    largest = jobs_pb2.SubmitJobRequest(
        type="a" * 128,
        payload=struct_from_dict({"n": numbers}),
        request_id="\U0001f600" * 256,
        correlation_id="c" * 255,
        max_attempts=100,
        labels={f"{i:02d}" + "k" * 61: "\U0001f600" * 256 for i in range(64)},
        timeout=duration_pb2.Duration(seconds=7 * 24 * 3600),
    )
    assert largest.ByteSize() <= limit
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        submit: Raw = channel.unary_unary("/jobplane.v1.JobService/SubmitJob")
        job = jobs_pb2.Job.FromString(
            await submit(largest.SerializeToString(), metadata=auth(stack))
        )
        assert len(job.payload.fields["n"].list_value.values) == len(numbers)

        before = await stack.counts()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await submit(_submit_of_size(limit + 1), metadata=auth(stack))
        refusal = check_refusal(
            info.value, core_codes=frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})
        )
        assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await stack.counts() == before
