"""A request body protobuf cannot decode is refused as INVALID_ARGUMENT by the
server's last interceptor, not UNKNOWN: MALFORMED_REQUEST naming the method, or
the field of a JSON value nested too deep; a body that decodes reaches the
servicer's handler unchanged. Driven on the handlers, without a server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

from jobplane.errors import shown
from jobplane.server.decode import RefuseUndecodable
from jobplane.v1 import jobs_pb2
from tests.support.deep_json import deep_struct, wire_field
from tests.support.servicer_context import Aborted, ServicerContext

_PREFIX = "/jobplane.v1.JobService/"
_SUBMIT = _PREFIX + "SubmitJob"
_WATCH = _PREFIX + "WatchJob"
_NOT_PROTOBUF = b"\xff\xff\xff"


def _decoder_says() -> str:
    """What protobuf's decoder says of :data:`_NOT_PROTOBUF`."""
    with pytest.raises(DecodeError) as refused:
        jobs_pb2.SubmitJobRequest.FromString(_NOT_PROTOBUF)
    return str(refused.value)


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def _refusal(aborted: Aborted) -> tuple[grpc.StatusCode, str, str, dict[str, str]]:
    """The code, message, reason and ErrorInfo metadata of a refusal."""
    (raw,) = (v for k, v in aborted.status.trailing_metadata if k == "grpc-status-details-bin")
    status = status_pb2.Status.FromString(raw)
    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    return aborted.status.code, status.message, info.reason, dict(info.metadata)


async def _unary(request: Any, _context: Any) -> str:
    return f"served {request.type}"


async def _stream(request: Any, _context: Any) -> AsyncIterator[Any]:
    yield b"encoded once"
    yield jobs_pb2.WatchJobResponse()
    yield request.name


async def _guarded(method: str, handler: Any) -> Any:
    async def continuation(_details: Any) -> Any:
        return handler

    return await RefuseUndecodable(_PREFIX).intercept_service(continuation, _Details(method))


def _submit_handler() -> Any:
    return grpc.unary_unary_rpc_method_handler(
        _unary,
        jobs_pb2.SubmitJobRequest.FromString,
        jobs_pb2.Job.SerializeToString,
    )


async def test_a_decodable_body_reaches_the_servicer() -> None:
    handler = await _guarded(_SUBMIT, _submit_handler())
    body = jobs_pb2.SubmitJobRequest(type="a.b").SerializeToString()
    request = handler.request_deserializer(body)
    assert request == jobs_pb2.SubmitJobRequest(type="a.b")
    assert await handler.unary_unary(request, ServicerContext()) == "served a.b"
    assert handler.response_serializer is jobs_pb2.Job.SerializeToString


async def test_a_body_that_is_not_protobuf_is_a_malformed_request_of_its_method() -> None:
    handler = await _guarded(_SUBMIT, _submit_handler())
    request = handler.request_deserializer(_NOT_PROTOBUF)
    with pytest.raises(Aborted) as aborted:
        await handler.unary_unary(request, ServicerContext())
    code, message, reason, metadata = _refusal(aborted.value)
    assert (code, reason, metadata) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "MALFORMED_REQUEST",
        {},
    )
    assert message == f"the body is not a valid request of SubmitJob: {shown(_decoder_says(), 160)}"


async def test_a_json_value_too_deep_is_refused_on_its_field() -> None:
    handler = await _guarded(_SUBMIT, _submit_handler())
    body = jobs_pb2.SubmitJobRequest(type="a.b").SerializeToString()
    request = handler.request_deserializer(body + wire_field(2, deep_struct([True] * 60)))
    with pytest.raises(Aborted) as aborted:
        await handler.unary_unary(request, ServicerContext())
    assert _refusal(aborted.value) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "payload is nested more than 32 objects or arrays deep",
        "INVALID_ARGUMENT",
        {"limit": "32", "field": "payload"},
    )


async def test_a_stream_of_a_decodable_body_is_served_with_bytes_passed_through() -> None:
    handler = await _guarded(
        _WATCH,
        grpc.unary_stream_rpc_method_handler(
            _stream,
            jobs_pb2.WatchJobRequest.FromString,
            lambda message: b"encoded:" + message.SerializeToString(),
        ),
    )
    request = handler.request_deserializer(
        jobs_pb2.WatchJobRequest(name="jobs/x").SerializeToString()
    )
    responses = [r async for r in handler.unary_stream(request, ServicerContext())]
    assert [handler.response_serializer(r) for r in responses[:2]] == [
        b"encoded once",
        b"encoded:",
    ]
    assert responses[2] == "jobs/x"
    undecodable = handler.request_deserializer(_NOT_PROTOBUF)
    with pytest.raises(Aborted) as aborted:
        _ = [r async for r in handler.unary_stream(undecodable, ServicerContext())]
    code, message, reason, _ = _refusal(aborted.value)
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")
    assert message.startswith("the body is not a valid request of WatchJob: ")


async def test_only_the_unary_requests_of_its_services_are_guarded() -> None:
    handler = _submit_handler()
    assert await _guarded("/other.Service/SubmitJob", handler) is handler
    assert await _guarded(_SUBMIT, None) is None
    streaming: grpc.RpcMethodHandler[Any, Any] = grpc.stream_unary_rpc_method_handler(
        _unary, jobs_pb2.SubmitJobRequest.FromString, None
    )
    assert await _guarded(_PREFIX + "Upload", streaming) is streaming
    # One guarded handler a method, made once.
    gate = RefuseUndecodable(_PREFIX)

    async def continuation(_details: Any) -> Any:
        return handler

    first = await gate.intercept_service(continuation, _Details(_SUBMIT))
    assert first is not handler
    assert await gate.intercept_service(continuation, _Details(_SUBMIT)) is first
