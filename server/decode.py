"""A request body that does not decode is INVALID_ARGUMENT, not UNKNOWN.

gRPC deserializes the body before any servicer code runs, and answers a
body protobuf refuses (corrupt wire format, a string that is not UTF-8, a
message nested past protobuf's depth limit) with UNKNOWN and the decoder's
exception text. The interceptor here swaps each method's deserializer for one
that hands the failure to the call instead, which then ends with our own rich
status like every other refusal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from jobplane.errors import MalformedRequest, shown
from jobplane.server.status import to_grpc_status

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """Stands in for a request whose body did not decode."""

    method: str
    error: str

    def refusal(self) -> MalformedRequest:
        return MalformedRequest(
            f"the body is not a valid request of {self.method}: {shown(self.error, 160)}"
        )


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """Refuse undecodable bodies of the unary-request methods under ``prefix``.

    It must be the last interceptor of the server (nearest the servicer): it
    makes its handler once per method from the first one it is handed.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._guarded: dict[str, Handler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        # Last in the server's chain, this interceptor is handed the servicer's
        # own handler, which is the same for every call of a method.
        guarded = self._guarded.get(method)
        if guarded is None:
            guarded = self._guarded[method] = _guard(handler, method.rsplit("/", 1)[-1])
        return guarded


def _guard(handler: Handler, name: str) -> Handler:
    decode = handler.request_deserializer
    if decode is None or handler.request_streaming:
        return handler

    def tolerant(body: bytes) -> Any:
        try:
            return decode(body)
        except (DecodeError, ValueError) as exc:
            return _Undecodable(name, str(exc))

    if handler.unary_unary is not None:
        unary: Any = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort_with_status(to_grpc_status(request.refusal()))
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, tolerant, handler.response_serializer
        )
    if handler.unary_stream is not None:
        stream: Any = handler.unary_stream

        async def unary_stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await context.abort_with_status(to_grpc_status(request.refusal()))
            async for response in stream(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, tolerant, _passing_bytes(handler.response_serializer)
        )
    return handler


def _passing_bytes(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """A streaming method's response serializer that sends ``bytes`` as they are: its
    handler may yield a message it encoded once for many streams (WatchJob does)."""
    if serialize is None:
        return None
    encode = serialize

    def serialized(response: Any) -> bytes:
        if type(response) is bytes:
            return response
        return encode(response)

    return serialized
