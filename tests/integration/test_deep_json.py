"""JSON nested past the limit is refused naming its field, however deep, on every call.

Every JSON value a request carries (a job's payload, alone or in a batch, an
event's payload, a progress report's data, a result) may nest at most 32
objects or arrays. Past that it is INVALID_ARGUMENT with a BadRequest naming
the field and nothing is written, whether protobuf can still decode the body
(the server's own checks refuse it) or not (past protobuf's 100 levels, where
the body itself does not decode). Bodies are built on the wire: Struct.update
refuses such depths itself.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from jobplane.convert import dict_from_struct
from jobplane.v1 import events_pb2, jobs_pb2, workers_pb2
from tests.support.answers import check_refusal
from tests.support.deep_json import deep_struct, wire_field
from tests.support.stack import Stack

# A server alone: the test claims the job a worker would.
pytestmark = pytest.mark.stack(worker=False, relay=False)

LIMIT = 32
Raw = grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]


@dataclass(frozen=True)
class Call:
    """A method, the field its JSON goes in, and its body around a given Struct."""

    method: str
    field: str
    body: Callable[[bytes], bytes]
    #: Whether a body within the limit succeeds (else only its JSON is not refused).
    succeeds: bool = True


def _calls(ref: workers_pb2.AttemptRef) -> list[Call]:
    # An attempt of no job: a call within the limit passes the checks and finds none.
    nobody = workers_pb2.AttemptRef(
        job=f"jobs/{uuid.uuid4()}", attempt=1, lease_token=str(uuid.uuid4())
    )
    submit = jobs_pb2.SubmitJobRequest(type="demo.echo").SerializeToString()

    def publish(struct: bytes) -> bytes:
        head = events_pb2.PublishEventRequest(event_id=str(uuid.uuid4()), event_type="deep.one")
        return head.SerializeToString() + wire_field(7, struct)

    def progress(struct: bytes) -> bytes:
        return wire_field(3, struct)  # a Progress of only its data

    return [
        Call("/jobplane.v1.JobService/SubmitJob", "payload", lambda s: submit + wire_field(2, s)),
        Call(
            "/jobplane.v1.JobService/BatchSubmitJobs",
            "requests[0].payload",
            lambda s: wire_field(1, submit + wire_field(2, s)),
        ),
        Call("/jobplane.v1.EventService/PublishEvent", "payload", publish),
        Call(
            "/jobplane.v1.WorkerService/ReportProgress",
            "reports[0].data",
            lambda s: (
                workers_pb2.ReportProgressRequest(attempt=ref).SerializeToString()
                + wire_field(2, progress(s))
            ),
        ),
        Call(
            "/jobplane.v1.WorkerService/CompleteJob",
            "result",
            lambda s: (
                workers_pb2.CompleteJobRequest(attempt=nobody).SerializeToString()
                + wire_field(2, s)
            ),
            succeeds=False,
        ),
        Call(
            "/jobplane.v1.WorkerService/FailJob",
            "reports[0].data",
            lambda s: (
                workers_pb2.FailJobRequest(attempt=nobody).SerializeToString()
                + wire_field(6, progress(s))
            ),
            succeeds=False,
        ),
    ]


@pytest.fixture
async def claimed(stack: Stack) -> tuple[workers_pb2.AttemptRef, Any]:
    """A job claimed through WorkerService, and the worker key's metadata."""
    worker_key = (await stack.server.keys.create_worker()).key
    metadata = (("authorization", f"Bearer {worker_key}"),)
    job = await stack.client().submit("demo.echo", {})
    envelope = await stack.envelope(job.name.removeprefix("jobs/"))
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        claim: Raw = channel.unary_unary("/jobplane.v1.WorkerService/ClaimJob")
        reply = workers_pb2.ClaimJobResponse.FromString(
            await claim(
                workers_pb2.ClaimJobRequest(message_body=envelope.encode()).SerializeToString(),
                metadata=metadata,
            )
        )
    assert reply.status == workers_pb2.ClaimJobResponse.STATUS_CLAIMED
    return reply.attempt, metadata


async def _written(stack: Stack) -> tuple[Any, ...]:
    return (
        await stack.scalar("SELECT count(*) FROM jobs"),
        await stack.scalar("SELECT count(*) FROM job_events"),
        await stack.scalar("SELECT count(*) FROM events"),
    )


def test_the_wire_struct_is_as_deep_as_it_says() -> None:
    value = dict_from_struct(struct_pb2.Struct.FromString(deep_struct([False, True, False])))
    assert value == {"a": {"a": [{}]}}


async def test_json_past_the_limit_is_refused_naming_its_field_at_any_depth(
    stack: Stack, claimed: tuple[workers_pb2.AttemptRef, Any]
) -> None:
    loop = asyncio.get_running_loop()
    ref, worker_metadata = claimed
    tenant_metadata = (("authorization", f"Bearer {stack.key}"),)
    calls = _calls(ref)
    async with grpc.aio.insecure_channel(stack.server.address) as channel:

        async def probe(call: Call, arrays: list[bool]) -> None:
            depth = len(arrays) + 1
            worker = call.method.startswith("/jobplane.v1.WorkerService/")
            raw: Raw = channel.unary_unary(call.method)
            before = await _written(stack)
            try:
                await raw(
                    call.body(deep_struct(arrays)),
                    metadata=worker_metadata if worker else tenant_metadata,
                )
            except grpc.aio.AioRpcError as error:
                refusal = check_refusal(error)
                if depth > LIMIT:
                    assert (refusal.code, refusal.reason, refusal.field) == (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "INVALID_ARGUMENT",
                        call.field,
                    ), (call.method, depth, refusal)
                    assert await _written(stack) == before
                else:
                    assert not call.succeeds, (call.method, depth, refusal)
                    assert refusal.field != call.field, (call.method, depth, refusal)
                return
            assert depth <= LIMIT and call.succeeds, (call.method, depth)

        @settings(max_examples=80, deadline=None, derandomize=True)
        @given(
            call=st.sampled_from(calls),
            depth=st.one_of(st.integers(LIMIT - 2, LIMIT + 4), st.integers(1, 160)),
            data=st.data(),
        )
        def check(call: Call, depth: int, data: st.DataObject) -> None:
            arrays = data.draw(st.lists(st.booleans(), min_size=depth - 1, max_size=depth - 1))
            asyncio.run_coroutine_threadsafe(probe(call, arrays), loop).result()

        # Every call just past the limit and far past it, objects and arrays,
        # whatever hypothesis draws.
        for call in calls:
            for depth in (LIMIT, LIMIT + 1, LIMIT + 2, 40, 120):
                for arrays in ([False] * (depth - 1), [True] * (depth - 1)):
                    await probe(call, arrays)
        await asyncio.to_thread(check)
