"""A request body that does not decode is INVALID_ARGUMENT, not UNKNOWN.

gRPC deserializes the body before any servicer code runs, and answers a
body protobuf refuses (corrupt wire format, a string that is not UTF-8, a
message nested past protobuf's depth limit) with UNKNOWN and the decoder's
exception text. The interceptor here swaps each method's deserializer for one
that hands the failure to the call instead, which then ends with our own rich
status like every other refusal.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import DecodeError

from jobplane.errors import InvalidArgument, MalformedRequest, shown
from jobplane.server.status import to_grpc_status
from jobplane.workers.values import MAX_JSON_DEPTH

if TYPE_CHECKING:
    Handler = grpc.RpcMethodHandler[Any, Any]


@dataclass(frozen=True, slots=True)
class _Undecodable:
    """Stands in for a request whose body did not decode."""

    method: str
    error: str
    #: The JSON field nested past the limit, when that is why it did not decode.
    too_deep: str | None = None

    def refusal(self) -> InvalidArgument:
        if self.too_deep is not None:
            return InvalidArgument(
                f"{self.too_deep} is nested more than {MAX_JSON_DEPTH} objects or arrays deep",
                field=self.too_deep,
                metadata={"limit": str(MAX_JSON_DEPTH)},
            )
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
            guarded = self._guarded[method] = _guard(handler, method)
        return guarded


def _guard(handler: Handler, method: str) -> Handler:
    decode = handler.request_deserializer
    if decode is None or handler.request_streaming:
        return handler
    name = method.rsplit("/", 1)[-1]
    request_type = _request_type(method)

    def tolerant(body: bytes) -> Any:
        try:
            return decode(body)
        except (DecodeError, ValueError) as exc:
            error = str(exc)
            deep = None
            # Only when protobuf says it went too deep ("Exceeded
            # upb_DecodeOptions_MaxDepth"): any other undecodable body would
            # be read twice for nothing.
            if request_type is not None and "depth" in error.lower():
                deep = too_deep_json(request_type, body)
            return _Undecodable(name, error, deep)

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


def _request_type(method: str) -> Descriptor | None:
    """The request message of ``/package.Service/Method``, from the default pool."""
    try:
        service, name = method.lstrip("/").rsplit("/", 1)
        found = descriptor_pool.Default().FindServiceByName(service).FindMethodByName(name)
    except (KeyError, ValueError):
        return None
    return None if found is None else found.input_type


# A JSON value in a request: a Struct or ListValue level is one object or
# array; a Value holds one.
_JSON_LEVELS = frozenset({"google.protobuf.Struct", "google.protobuf.ListValue"})
_JSON = _JSON_LEVELS | {"google.protobuf.Value"}


# Fields (of any wire type) and messages read at most in search of a JSON
# value too deep: a deep one takes about three messages of one or two fields
# per level, and a body this search cannot settle quickly is left
# MALFORMED_REQUEST rather than read at length on the event loop. Every field
# counts, the ones stepped over too: a body of a million one-byte fields is
# as long to walk as one of a million messages.
MAX_FIELDS_READ = 50_000


class _Broken(Exception):
    """The body is not protobuf's wire format (or is too long to read through)."""


class _Budget:
    """What is left of :data:`MAX_FIELDS_READ` for one search."""

    __slots__ = ("left",)

    def __init__(self, left: int) -> None:
        self.left = left

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise _Broken


def too_deep_json(message: Descriptor, body: bytes, *, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The field of a JSON value in ``body`` nested more than ``limit`` objects or
    arrays deep (``payload``, ``reports[0].data``), or None.

    Protobuf stops decoding at 100 levels of messages, and a JSON object costs
    three of them (Struct, map entry, Value): a value nested a few levels past
    our limit makes the whole body undecodable, and the decoder does not say
    where. Read on the wire format with the request's descriptors, without
    recursion, it is found and refused like one just past the limit, with its
    field. Anything that does not parse on the way gives None, and so does a
    body that takes more than a bounded number of messages to read through.
    """
    data = memoryview(body)
    budget = _Budget(MAX_FIELDS_READ)
    # A message to read: where it is, its type, its path (or, inside a JSON
    # value, the path of the field holding that value) and its JSON levels.
    pending: list[tuple[int, int, Descriptor, str, bool, int]] = [
        (0, len(data), message, "", False, 0)
    ]
    try:
        while pending:
            start, end, descriptor, path, in_json, levels = pending.pop()
            budget.spend()
            seen: dict[int, int] = {}
            for number, inner_start, inner_end in _length_delimited(data, start, end, budget):
                field = descriptor.fields_by_number.get(number)
                inner = None if field is None else field.message_type
                if field is None or inner is None:
                    continue
                inner_path = path
                if not in_json:
                    index = seen[number] = seen.get(number, -1) + 1
                    inner_path = f"{path}.{field.name}" if path else field.name
                    if field.is_repeated and not inner.GetOptions().map_entry:
                        inner_path += f"[{index}]"
                inner_levels = levels + (inner.full_name in _JSON_LEVELS)
                if inner_levels > limit:
                    return inner_path
                if inner_levels + (inner_end - inner_start) // 2 <= limit:
                    # Each level below needs two bytes at least (its tag and
                    # length): this one is too small to go past the limit.
                    continue
                pending.append(
                    (
                        inner_start,
                        inner_end,
                        inner,
                        inner_path,
                        in_json or inner.full_name in _JSON,
                        inner_levels,
                    )
                )
    except _Broken:
        return None
    return None


def _length_delimited(
    data: memoryview, start: int, end: int, budget: _Budget
) -> Iterator[tuple[int, int, int]]:
    """The length-delimited fields of the message in ``data[start:end]``: (number,
    where its bytes start, where they end). Other fields are stepped over, each
    spending ``budget`` as one read does."""
    at = start
    while at < end:
        budget.spend()
        tag, at = _varint(data, at, end)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, at = _varint(data, at, end)
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        elif wire == 2:
            size, at = _varint(data, at, end)
            if at + size > end:
                raise _Broken
            yield number, at, at + size
            at += size
        else:
            raise _Broken  # groups: no message of ours has them
        if at > end or number == 0:
            raise _Broken


def _varint(data: memoryview, at: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= end or shift > 63:
            raise _Broken
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
