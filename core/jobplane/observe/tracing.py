"""OpenTelemetry tracing: one trace from SubmitJob to the job's outcome (docs/tracing.md).

Off unless the standard ``OTEL_*`` variables ask for an exporter
(:attr:`jobplane.config.Settings.trace_exporters`). Off, nothing is
installed: no SDK, no span processor, no interceptor; every function here
checks :data:`ENABLED` first and hands back a shared no-op, so the hot paths
pay one boolean test.

On, :func:`configure_tracing` installs the SDK's tracer provider (the
sampler of ``OTEL_TRACES_SAMPLER``) with a batch span processor and the
OTLP exporter (over HTTP, or gRPC when its package is installed), flushed
when the process exits. The trace context crosses every hop of jobplane's
own in W3C form (``traceparent``, ``tracestate``), through OpenTelemetry's
own propagator, never formatted by hand:

- gRPC metadata → the server span (:class:`ServerTracing`), read by the
  propagators ``OTEL_PROPAGATORS`` names (W3C's by default);
- the current span → the ``headers`` of the outbox row a transition writes,
  and the ``traceparent`` of its domain events (:func:`trace_binds`, read by
  the state machine's hooks inside the transition's statement, through
  :class:`TransitionTracing`, the observer the process registers);
- an outbox row's headers → the relay's ``outbox publish`` span → the AMQP
  message's headers (:func:`publish_span`);
- a delivered message's headers → the worker's ``job claim``, ``job run
  <type>`` and ``job outcome`` spans (:func:`delivered` and the rest).

A context that does not parse (garbage in a header, a row, metadata) is
dropped and a new trace starts: tracing never fails a call or a delivery.
Spans carry ids, types, queues, attempts and codes, never a payload, a

This module holds the switch (:data:`ENABLED`, the tracer, the sampler's
judgement) and what every hop shares; the parts that attach spans live
beside it and read the switch from here at each call, so turning tracing on
(or a test's tracer) reaches them all: :mod:`~jobplane.observe.trace_server`
(the server's interceptor), :mod:`~jobplane.observe.trace_worker` (the
worker's spans), :mod:`~jobplane.observe.trace_relay` (the relay's publish),
:mod:`~jobplane.observe.trace_context` (the context in rows, messages and
log lines) and :mod:`~jobplane.observe.trace_setup` (the SDK's provider,
exporters and propagators). Their public names are importable from here.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from jobplane import __version__
from jobplane.observe.trace_context import (
    ATTEMPT,
    CLAIM_STATUS,
    JOB_ID,
    JOB_TYPE,
    MAX_TRACESTATE,
    NO_HEADERS,
    NO_TRACE,
    PLAINLY_UNSAMPLED,
    PROPAGATOR,
    QUEUE,
    REDELIVERED,
    TENANT_ID,
    TRACEPARENT,
    TRACESTATE,
    TRANSITION,
    ZERO_SPAN,
    ZERO_TRACE,
    extract,
    inject,
    trace_id_of,
)
from jobplane.store import observers

if TYPE_CHECKING:
    from jobplane.config import Settings
    from jobplane.observe.trace_relay import RelayTracing, publish_span
    from jobplane.observe.trace_server import ServerTracing
    from jobplane.observe.trace_worker import (
        WorkerTracing,
        claim_span,
        claimed,
        delivered,
        end_run,
        outcome_span,
        progress_event,
        run_context,
        start_run,
    )
    from jobplane.store.machine import Transition

__all__ = [
    "ATTEMPT",
    "CLAIM_STATUS",
    "ENABLED",
    "JOB_ID",
    "JOB_TYPE",
    "MAX_TRACESTATE",
    "NO_HEADERS",
    "NO_TRACE",
    "QUEUE",
    "REDELIVERED",
    "TENANT_ID",
    "TRACEPARENT",
    "TRACESTATE",
    "TRANSITION",
    "RelayTracing",
    "ServerTracing",
    "TransitionTracing",
    "WorkerTracing",
    "applied",
    "claim_span",
    "claimed",
    "configure_tracing",
    "current_headers",
    "delivered",
    "end_run",
    "extract",
    "log_trace_ids",
    "outcome_span",
    "outgoing",
    "progress_event",
    "publish_span",
    "register_logs",
    "register_transitions",
    "run_context",
    "shutdown_tracing",
    "start_run",
    "trace_binds",
    "trace_id_of",
]

#: True once :func:`configure_tracing` installed the SDK. Read it as
#: ``tracing.ENABLED`` (an import of the name would copy False for good).
ENABLED = False


# What reads a caller's context from a call's metadata: OTEL_PROPAGATORS'
# (configure_tracing). Between jobplane's own hops (rows, messages) the
# context is always W3C's, through trace_context.PROPAGATOR.
_CALLERS: TextMapPropagator = PROPAGATOR
_TRACER: trace.Tracer = trace.NoOpTracer()
_PROVIDER: Any = None
_NULL: contextlib.nullcontext[None] = contextlib.nullcontext()
# Whether the sampler drops every child of a parent that was not sampled (the
# parent-based samplers do, the default among them): then a delivery or an
# outbox row whose context says "not sampled" makes no span at all, and only
# its context is carried on (see _unsampled).
_SKIP_UNSAMPLED = False
# The headers of the trace a worker's delivery continues, while it is one
# that makes no span (set by delivered()): every write of the delivery
# carries them without asking OpenTelemetry for the current span again.
_QUIET: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "jobplane_quiet_trace", default=None
)


def configure_tracing(service_name: str, settings: Settings | None = None) -> bool:
    """Install the SDK's tracer provider when ``settings`` (the environment's by
    default) ask for an exporter; True when tracing is on.

    ``service_name`` is the resource's ``service.name`` unless
    ``OTEL_SERVICE_NAME`` names one. The sampler is ``OTEL_TRACES_SAMPLER``'s
    (parent-based always-on by default), the batch processor's limits
    ``OTEL_BSP_*``'s and the exporter's endpoint, headers, timeout and
    compression ``OTEL_EXPORTER_OTLP_*``'s, as the SDK reads them. Spans
    still queued are exported when the process exits. The store's
    transitions are traced with it (:func:`register_transitions`) and its log
    lines name the trace (:func:`register_logs`). A second call changes nothing.
    """
    global ENABLED, _TRACER, _PROVIDER  # noqa: PLW0603 - the one switch the hot paths read
    if settings is None:
        from jobplane.config import Settings

        settings = Settings.from_env()
    if not settings.trace_exporters:
        return False
    if ENABLED:
        return True
    from jobplane.observe.trace_setup import drops_unsampled_children, propagator, tracer_provider

    provider = tracer_provider(service_name, settings)
    trace.set_tracer_provider(provider)
    _set_callers(propagator(settings.trace_propagators))
    _PROVIDER = provider
    _TRACER = provider.get_tracer("jobplane", __version__)
    _set_skip_unsampled(drops_unsampled_children(provider.sampler))
    # Here rather than by each caller: a process that turns tracing on (the
    # CLI, a Worker embedded in an application, a benchmark) would otherwise
    # trace its calls while its transitions and log lines carried no trace.
    register_transitions()
    register_logs()
    ENABLED = True
    return True


def _set_callers(propagator: TextMapPropagator) -> None:
    global _CALLERS  # noqa: PLW0603 - set with the provider, read by the server's calls
    _CALLERS = propagator


def _set_skip_unsampled(skip: bool) -> None:
    global _SKIP_UNSAMPLED  # noqa: PLW0603 - set with the provider, read on the hot paths
    _SKIP_UNSAMPLED = skip


def _unsampled(context: otel_context.Context | None = None) -> bool:
    """True when ``context`` (the current one by default) continues a trace that is
    not sampled, and the sampler would drop every span made under it."""
    if not _SKIP_UNSAMPLED:
        return False
    if context is None and _QUIET.get() is not None:
        return True
    found = trace.get_current_span(context).get_span_context()
    return found.is_valid and not found.trace_flags.sampled


def shutdown_tracing() -> None:
    """Export what is queued and stop (what the exit hook does); tracing is off after."""
    global ENABLED, _TRACER, _PROVIDER  # noqa: PLW0603 - the one switch the hot paths read
    provider, _PROVIDER = _PROVIDER, None
    ENABLED = False
    _TRACER = trace.NoOpTracer()
    _set_skip_unsampled(False)
    _set_callers(PROPAGATOR)
    if provider is not None:
        provider.shutdown()


def _passed_on(carrier: Mapping[str, Any] | None) -> Mapping[str, str] | None:
    """``carrier``'s trace context as it came, when it plainly continues a trace that
    is not sampled and the sampler drops every span under it; else None.

    The hops that make no span for such a trace (the relay's publish, the
    worker's writes) carry it on unchanged: parsing it into OpenTelemetry's
    context and formatting it back would give the same ``traceparent``. Only
    the plain form is taken (version 00, valid ids, no ``tracestate``);
    anything else goes through the propagator.
    """
    if not _SKIP_UNSAMPLED or not carrier or TRACESTATE in carrier:
        return None
    parent = carrier.get(TRACEPARENT)
    if isinstance(parent, bytes):
        parent = parent.decode("latin-1")
    if not isinstance(parent, str):
        return None
    found = PLAINLY_UNSAMPLED.fullmatch(parent)
    if found is None or found[1] == ZERO_TRACE or found[2] == ZERO_SPAN:
        return None
    return {TRACEPARENT: parent}


def current_headers() -> Mapping[str, str]:
    """``traceparent`` (and ``tracestate``) of the current span; empty when off or none."""
    if not ENABLED:
        return NO_HEADERS
    quiet = _QUIET.get()
    return inject() if quiet is None else quiet


def outgoing(traceparent: str | None, tracestate: str | None) -> tuple[str | None, str | None]:
    """The trace context to store with what a call publishes: the current span's
    when tracing is on, else the caller's (``traceparent``, ``tracestate``) as given."""
    if not ENABLED:
        return traceparent, tracestate
    carrier = _QUIET.get() or inject()
    if TRACEPARENT not in carrier:
        return traceparent, tracestate
    return carrier[TRACEPARENT], carrier.get(TRACESTATE)


def trace_binds() -> Mapping[str, Any]:
    """The binds of a transition's statement: the current span's context, for the
    outbox row and domain events it writes (:data:`NO_TRACE` when off).

    ``trace_inherit``: with no span here (the sweeper), a new dispatch copies
    the job's previous dispatch's context, so a repaired job stays in its trace.
    """
    if not ENABLED:
        return NO_TRACE
    carrier = _QUIET.get() or inject()
    parent = carrier.get(TRACEPARENT)
    if parent is None:
        return {"trace_parent": None, "trace_state": None, "trace_inherit": True}
    return {"trace_parent": parent, "trace_state": carrier.get(TRACESTATE), "trace_inherit": True}


def applied(transition: Transition) -> None:
    """Name ``transition`` on the current span (it applied under it)."""
    if _QUIET.get() is not None:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(TRANSITION, transition.value)


class TransitionTracing:
    """The store's :class:`~jobplane.store.observers.Observer` when tracing is on.

    Registered where tracing is turned on (:func:`configure_tracing` calls
    :func:`register_transitions`): the store imports no tracing, and with
    none registered calls nothing.
    """

    def binds(self) -> Mapping[str, Any]:
        """:func:`trace_binds`."""
        return trace_binds()

    def applied(self, transition: Transition) -> None:
        """:func:`applied`, while tracing is on."""
        if ENABLED:
            applied(transition)


def log_trace_ids(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> Any:
    """While tracing is on, a line logged inside a span names its ``trace_id`` and
    ``span_id`` (hex, as trace backends show them), so a trace's lines are found by
    its id. Registered with logging by :func:`register_logs`."""
    if ENABLED:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            event_dict.setdefault("trace_id", format(context.trace_id, "032x"))
            event_dict.setdefault("span_id", format(context.span_id, "016x"))
    return event_dict


def register_logs() -> None:
    """Name the current trace and span on every log line (:func:`log_trace_ids`)."""
    from jobplane import logs

    logs.register_trace_ids(log_trace_ids)


def register_transitions() -> None:
    """Trace the store's transitions: their dispatches and events carry the
    current span's context, and the span names the transition.

    :func:`configure_tracing` calls it; call it alone only where tracing is
    turned on by other means (a test's own tracer provider)."""
    observers.register(TransitionTracing())


def _span(name: str, kind: SpanKind, attributes: dict[str, Any]) -> _Current:
    """A current span for the block (see :class:`_Current`)."""
    return _Current(
        _TRACER.start_span(
            name,
            kind=kind,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        )
    )


class _Current:
    """``span`` current for the block and ended after it; an exception marks it failed
    by its type alone (the SDK's own recording would keep its message, which may
    quote a statement's values or tenant data).

    A class, not a generator: the hot paths enter one per span, and this is the
    SDK's ``use_span`` without its generator and its exception recording.
    """

    __slots__ = ("_mark", "_span", "_token")

    def __init__(self, span: Span, *, mark_errors: bool = True) -> None:
        self._span = span
        self._token: object = None
        # False: the caller sets the span's status itself (the server, by the call's code).
        self._mark = mark_errors

    def __enter__(self) -> Any:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        try:
            otel_context.detach(self._token)  # type: ignore[arg-type]
        finally:
            if error is not None and self._mark:
                _failed(self._span, error)
            self._span.end()


class _Publishing(_Current):
    """:class:`_Current`, giving the block the headers that carry the span on."""

    __slots__ = ()

    def __enter__(self) -> Mapping[str, str]:
        super().__enter__()
        return inject()


def _failed(span: Span, exc: BaseException) -> None:
    # The type only: an exception's message may quote tenant data.
    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))


# --- the parts' names, imported on first use ------------------------------------

# Each part reads this module's switch at each call, so it imports this module;
# its names are looked up here on first use rather than imported at the top.
_PARTS = {
    "ServerTracing": "trace_server",
    "RelayTracing": "trace_relay",
    "publish_span": "trace_relay",
    "WorkerTracing": "trace_worker",
    "claim_span": "trace_worker",
    "claimed": "trace_worker",
    "delivered": "trace_worker",
    "end_run": "trace_worker",
    "outcome_span": "trace_worker",
    "progress_event": "trace_worker",
    "run_context": "trace_worker",
    "start_run": "trace_worker",
}


def __getattr__(name: str) -> Any:
    """A part's name (:data:`_PARTS`), imported on its first use."""
    part = _PARTS.get(name)
    if part is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    found = getattr(importlib.import_module(f"jobplane.observe.{part}"), name)
    globals()[name] = found  # looked up once: a hot path's next lookup is a global's
    return found
