"""A worker's spans: the delivery's context, ``job claim``, ``job run <type>``,
progress events and ``job outcome``, and :class:`WorkerTracing`, the
interceptor that makes them.

Reads the switch of :mod:`jobplane.observe.tracing` at each call; imported
through it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from jobplane.observe import tracing
from jobplane.observe.trace_context import (
    ATTEMPT,
    CLAIM_STATUS,
    JOB_ID,
    JOB_TYPE,
    QUEUE,
    REDELIVERED,
    TENANT_ID,
    TRACEPARENT,
    extract,
    inject,
    remote,
)

if TYPE_CHECKING:
    from jobplane.envelope import Envelope
    from jobplane.store.attempts import Attempt, ClaimResult
    from jobplane.store.machine import Transition
    from jobplane.topology import Topology
    from jobplane.workers.interceptors import Delivered


def delivered(headers: Mapping[str, Any] | None) -> contextlib.AbstractContextManager[object]:
    """The context of a delivered message, current for the block (its spans' parent)."""
    if not tracing.ENABLED:
        return tracing._NULL
    passed = tracing._passed_on(headers)
    if passed is not None:
        # Current for the handler (its own calls out carry the trace on), and
        # carried on as it came by the delivery's writes.
        return _attached(remote(passed[TRACEPARENT]), passed)
    context = extract(headers)
    return _attached(context, inject(context) if tracing._unsampled(context) else None)


@contextlib.contextmanager
def _attached(context: otel_context.Context, quiet: Mapping[str, str] | None) -> Iterator[object]:
    token = otel_context.attach(context)
    marked = tracing._QUIET.set(quiet)
    try:
        yield None
    finally:
        tracing._QUIET.reset(marked)
        otel_context.detach(token)


def claim_span(
    envelope: Envelope, message: Delivered
) -> contextlib.AbstractContextManager[Span | None]:
    """``job claim``: the consumer span of a delivery, around the fenced claim
    (none for a delivery of a trace that is not sampled)."""
    if not tracing.ENABLED or tracing._unsampled():
        return tracing._NULL
    attributes: dict[str, Any] = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "process",
        "messaging.operation.name": "claim",
        "messaging.rabbitmq.destination.routing_key": message.routing_key or "",
        "messaging.message.id": message.message_id or "",
        JOB_ID: str(envelope.job_id),
    }
    if message.redelivered:
        attributes[REDELIVERED] = True
    return tracing._span("job claim", SpanKind.CONSUMER, attributes)


def claimed(span: Span | None, claim: ClaimResult) -> None:
    """What the claim found, on its span."""
    if span is None or not span.is_recording():
        return
    if claim.attempt is None:
        span.set_attribute(CLAIM_STATUS, claim.status.value)
    else:
        span.set_attributes({CLAIM_STATUS: claim.status.value, ATTEMPT: claim.attempt.attempt})


def _attempt_attributes(attempt: Attempt) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        JOB_ID: str(attempt.job_id),
        JOB_TYPE: attempt.type,
        QUEUE: attempt.queue,
        ATTEMPT: attempt.attempt,
        TENANT_ID: str(attempt.tenant_id),
    }
    if attempt.stage is not None:
        attributes["jobplane.pipeline"] = attempt.stage.pipeline
        attributes["jobplane.stage"] = attempt.stage.name
    return attributes


def start_run(attempt: Attempt) -> Span | None:
    """``job run <type>``: the handler's span (None when off, or for a trace that is not
    sampled); end it with :func:`end_run`."""
    if not tracing.ENABLED or tracing._unsampled():
        return None
    return tracing._TRACER.start_span(
        f"job run {attempt.type}", kind=SpanKind.INTERNAL, attributes=_attempt_attributes(attempt)
    )


def run_context(span: Span | None) -> Any:
    """The contextvars the handler's task runs in (its current span: ``span``);
    None (a copy of the current ones) when off."""
    if span is None:
        return None
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        return contextvars.copy_context()
    finally:
        otel_context.detach(token)


def end_run(span: Span | None, error: BaseException | None = None) -> None:
    """End the handler's span; ``error``: what the handler raised (its type is kept)."""
    if span is None:
        return
    if error is not None:
        tracing._failed(span, error)
    span.end()


def progress_event(progress: float) -> None:
    """A progress report, as an event on the handler's span (the current one)."""
    if not tracing.ENABLED:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event("progress", {"jobplane.progress": progress})


def outcome_span(attempt: Attempt) -> contextlib.AbstractContextManager[Span | None]:
    """``job outcome``: the span of the attempt's outcome write (its transition named;
    none for a trace that is not sampled)."""
    if not tracing.ENABLED or tracing._unsampled():
        return tracing._NULL
    attributes = {JOB_ID: str(attempt.job_id), JOB_TYPE: attempt.type, ATTEMPT: attempt.attempt}
    return tracing._span("job outcome", SpanKind.INTERNAL, attributes)


class WorkerTracing:
    """A worker's :class:`~jobplane.workers.interceptors.Interceptor` that traces:
    the delivery's context, the ``job claim``, ``job run <type>`` and ``job
    outcome`` spans, progress events and the transitions a group applied.

    Handed to the worker by the process where it turns tracing on (the CLI's
    :func:`worker_interceptors`); the worker imports no tracing.
    """

    def known(
        self, slots: Callable[[], tuple[int, int]], topology: Topology, types: Iterable[str]
    ) -> None:
        """Nothing of the worker's make-up is traced."""

    def delivered(
        self, headers: Mapping[str, Any] | None
    ) -> contextlib.AbstractContextManager[Any]:
        """:func:`delivered`."""
        return delivered(headers)

    async def claim(
        self,
        envelope: Envelope,
        message: Delivered,
        claim: Callable[[], Awaitable[ClaimResult]],
    ) -> ClaimResult:
        """The claim inside :func:`claim_span`, what it found on the span."""
        with claim_span(envelope, message) as span:
            found = await claim()
            claimed(span, found)
        return found

    def applied(self, transition: Transition) -> None:
        """:func:`~jobplane.observe.tracing.applied`, while tracing is on."""
        if tracing.ENABLED:
            tracing.applied(transition)

    def grouped(self, kind: str, size: int) -> None:
        """A group is not traced (each of its deliveries names its transition)."""

    def submitted(self, job_type: str, queue: str, count: int) -> None:
        """A child's submit is on the span of the attempt that made it."""

    def started(self, attempt: Attempt) -> _Run | None:
        """:func:`start_run` (None when it makes no span)."""
        span = start_run(attempt)
        return None if span is None else _Run(span)

    def progress(self, progress: float) -> None:
        """:func:`progress_event`."""
        progress_event(progress)

    def outcome(self, attempt: Attempt) -> contextlib.AbstractContextManager[Any]:
        """:func:`outcome_span`."""
        return outcome_span(attempt)

    def ended(self, attempt: Attempt, outcome: str, seconds: float) -> None:
        """The outcome is on the ``job outcome`` span's transition already."""


class _Run:
    """The ``job run <type>`` span of one attempt."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def context(self) -> Any:
        """:func:`run_context`."""
        return run_context(self._span)

    def ended(self, error: BaseException | None) -> None:
        """:func:`end_run`."""
        end_run(self._span, error)
