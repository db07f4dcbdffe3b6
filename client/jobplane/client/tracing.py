"""The caller's trace into jobplane: OpenTelemetry client interceptors for the SDK.

``AsyncClient(..., tracing=True)`` (and ``Client(..., tracing=True)``) puts
these on its channel: each call gets a client span, named as the server's
(``jobplane.v1.JobService/SubmitJob``), child of the caller's current span,
and its W3C ``traceparent``/``tracestate`` go to the server as metadata, so
the job's trace (submit → publish → run → outcome) continues the caller's.

This module needs only ``opentelemetry-api`` (``pip install
'jobplane[tracing]'``) and is imported only when tracing is asked for: the
SDK's base install does not need it. The spans are recorded by whatever
tracer provider the application installed; with none, they cost next to
nothing and the context of the caller's own span (if any) still goes along.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = ["client_interceptors"]

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER = trace.get_tracer("jobplane.client")
# A tracestate longer than this is not sent (the server drops it too).
_MAX_TRACESTATE = 512
# The tasks that end streaming calls' spans (held until they ran).
_ends: set[asyncio.Task[None]] = set()


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """One interceptor for each kind of call the SDK makes (grpc.aio files an
    interceptor under one kind only)."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary()]


def _method(details: grpc.aio.ClientCallDetails) -> str:
    method: Any = details.method
    if isinstance(method, bytes):
        method = method.decode()
    return str(method).lstrip("/")


def _start(details: grpc.aio.ClientCallDetails) -> Span:
    name = _method(details)
    service, _, rpc = name.partition("/")
    return _TRACER.start_span(
        name,
        kind=SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc},
    )


def _with_context(details: grpc.aio.ClientCallDetails, span: Span) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    if len(carrier.get("tracestate", "")) > _MAX_TRACESTATE:
        del carrier["tracestate"]
    kept = [(k, v) for k, v in (details.metadata or ()) if k not in ("traceparent", "tracestate")]
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        grpc.aio.Metadata(*kept, *carrier.items()),
        details.credentials,
        details.wait_for_ready,
    )


def _end(span: Span, code: grpc.StatusCode | None) -> None:
    if code is not None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


def _end_when_done(span: Span, call: Any) -> None:
    """End ``span`` with the status of the streaming ``call``, once it ends."""

    async def finish() -> None:
        code: grpc.StatusCode | None = None
        try:
            code = await call.code()
        finally:
            _end(span, code)

    def done(_call: Any) -> None:
        task = asyncio.get_running_loop().create_task(finish())
        _ends.add(task)
        task.add_done_callback(_ends.discard)

    call.add_done_callback(done)


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        span = _start(client_call_details)
        code: grpc.StatusCode | None = None
        try:
            token = otel_context.attach(trace.set_span_in_context(span))
            try:
                call = await continuation(_with_context(client_call_details, span), request)
            finally:
                otel_context.detach(token)
            code = await call.code()
            return call
        finally:
            _end(span, code)


async def _streaming(
    continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
    details: grpc.aio.ClientCallDetails,
    request: Any,
) -> Any:
    """A call that streams one way or the other: its span ends when the call does."""
    span = _start(details)
    try:
        call = await continuation(_with_context(details, span), request)
    except BaseException:
        _end(span, None)
        raise
    _end_when_done(span, call)
    return call


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        return await _streaming(continuation, client_call_details, request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request_iterator: Any,
    ) -> Any:
        return await _streaming(continuation, client_call_details, request_iterator)
