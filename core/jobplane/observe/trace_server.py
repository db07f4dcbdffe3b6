"""The server's spans: :class:`ServerTracing`, the gRPC interceptor that starts
a server span for every call, continuing the trace of the call's metadata.

Reads the switch of :mod:`jobplane.observe.tracing` at each call (its tracer,
and the propagators of ``OTEL_PROPAGATORS`` that read a caller's context);
imported through it.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeAlias

import grpc
from opentelemetry import context as otel_context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from jobplane.observe import tracing
from jobplane.observe.trace_context import MAX_TRACEPARENT

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
#: What starts a call's span (made current for the block).
Start: TypeAlias = Callable[[Context], "tracing._Current"]

# Server-side codes that make a span an error (OpenTelemetry's gRPC conventions).
_SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


class _MetadataGetter(Getter[Iterable[tuple[str, Any]]]):
    def get(self, carrier: Iterable[tuple[str, Any]], key: str) -> list[str] | None:
        for name, value in carrier:
            if name == key and isinstance(value, str) and len(value) <= MAX_TRACEPARENT:
                return [value]
        return None

    def keys(self, carrier: Iterable[tuple[str, Any]]) -> list[str]:
        return [name for name, _ in carrier]


_METADATA = _MetadataGetter()


def _from_metadata(metadata: Any) -> otel_context.Context:
    try:
        return tracing._CALLERS.extract(
            tuple(metadata or ()), context=otel_context.Context(), getter=_METADATA
        )
    except Exception:
        return otel_context.Context()


class ServerTracing(grpc.aio.ServerInterceptor):
    """Starts a server span for every call under ``prefix``, continuing the trace of
    the call's ``traceparent`` metadata; named ``jobplane.v1.JobService/SubmitJob``.

    Installed only while tracing is on. First in the server's chain, so a call
    the gate refuses has its span too. Health and reflection are not traced.
    """

    def __init__(self, prefix: str = "/jobplane.v1.") -> None:
        self._prefix = prefix
        self._wrapped: dict[int, tuple[Handler, Handler]] = {}
        # Most handlers are made once per method; a refusal's may be made per
        # call (a tenant limit), so the cache is kept small.
        self._most = 512

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        # The gate's handlers are made once per method (and refusal): keyed
        # by identity, each is wrapped once.
        found = self._wrapped.get(id(handler))
        if found is not None and found[0] is handler:
            return found[1]
        wrapped = _traced(handler, method)
        if len(self._wrapped) >= self._most:
            self._wrapped.clear()
        self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped


def _traced(handler: Handler, method: str) -> Handler:
    """``handler`` inside the call's server span (a handler of another kind as it is)."""
    name = method.lstrip("/")
    service, _, rpc = name.partition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}

    def start(context: Context) -> tracing._Current:
        # The span made current by _Current (no generator, no exception
        # recording): most calls' spans are not sampled, and cost only this.
        return tracing._Current(
            tracing._TRACER.start_span(
                name,
                context=_from_metadata(context.invocation_metadata()),
                kind=SpanKind.SERVER,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ),
            mark_errors=False,
        )

    if handler.unary_unary is not None:
        return _unary_unary(handler, start)
    if handler.unary_stream is not None:
        return _unary_stream(handler, start)
    if handler.stream_unary is not None:
        return _stream_unary(handler, start)
    return handler


def _unary_unary(handler: Handler, start: Start) -> Handler:
    unary: Any = handler.unary_unary

    async def unary_unary(request: Any, context: Context) -> Any:
        with start(context) as span:
            try:
                response = await unary(request, context)
            except BaseException as exc:
                _finish(span, context, exc)
                raise
            _finish(span, context)
            return response

    return grpc.unary_unary_rpc_method_handler(
        unary_unary, handler.request_deserializer, handler.response_serializer
    )


def _unary_stream(handler: Handler, start: Start) -> Handler:
    streamed: Any = handler.unary_stream

    async def unary_stream(request: Any, context: Context) -> AsyncIterator[Any]:
        with start(context) as span:
            try:
                # A streaming handler is an async generator, or a coroutine
                # that writes through the context (or aborts, as a refusal
                # of the call gate does) and returns None.
                answer = streamed(request, context)
                if inspect.isawaitable(answer):
                    await answer
                else:
                    async for response in answer:
                        yield response
            except BaseException as exc:
                _finish(span, context, exc)
                raise
            _finish(span, context)

    return grpc.unary_stream_rpc_method_handler(
        unary_stream, handler.request_deserializer, handler.response_serializer
    )


def _stream_unary(handler: Handler, start: Start) -> Handler:
    uploaded: Any = handler.stream_unary

    async def stream_unary(requests: Any, context: Context) -> Any:
        with start(context) as span:
            try:
                response = await uploaded(requests, context)
            except BaseException as exc:
                _finish(span, context, exc)
                raise
            _finish(span, context)
            return response

    return grpc.stream_unary_rpc_method_handler(
        stream_unary, handler.request_deserializer, handler.response_serializer
    )


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _finish(span: Span, context: Context, error: BaseException | None = None) -> None:
    if not span.is_recording():  # a call the sampler dropped: nothing to note
        return
    found: Any = context.code()
    code = _CODES.get(found) if isinstance(found, int) else found
    if not isinstance(code, grpc.StatusCode) or (error is not None and code is grpc.StatusCode.OK):
        if error is None:
            code = grpc.StatusCode.OK
        elif isinstance(error, GeneratorExit | asyncio.CancelledError):
            code = grpc.StatusCode.CANCELLED
        else:
            code = grpc.StatusCode.UNKNOWN
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERRORS:
        span.set_status(Status(StatusCode.ERROR, code.name))
