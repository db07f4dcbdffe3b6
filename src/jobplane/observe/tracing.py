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
result, an error message or a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import inspect
import re
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    MutableMapping,
)
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter, TextMapPropagator
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from jobplane import __version__
from jobplane.store import observers

if TYPE_CHECKING:
    from aio_pika.abc import AbstractIncomingMessage

    from jobplane.config import Settings
    from jobplane.envelope import Envelope
    from jobplane.store.attempts import Attempt, ClaimResult
    from jobplane.store.machine import Transition
    from jobplane.topology import Topology
    from jobplane.workers.sweeper import SweepReport

__all__ = [
    "ENABLED",
    "ServerTracing",
    "configure_tracing",
    "current_headers",
    "extract",
]

#: True once :func:`configure_tracing` installed the SDK. Read it as
#: ``tracing.ENABLED`` (an import of the name would copy False for good).
ENABLED = False

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
#: A tracestate longer than this is dropped, not carried: the W3C
#: recommendation asks for at least 512 characters to be kept, and a longer
#: one could make an AMQP header frame too large to publish.
MAX_TRACESTATE = 512
# A traceparent is 55 characters (version 00); a longer value from a future
# version is cut to its first 55 by the propagator, but nothing that long is read.
_MAX_TRACEPARENT = 512

#: What a transition's statement binds when there is no trace context (the
#: store's own, for when nothing observes its transitions).
NO_TRACE: Mapping[str, Any] = observers.NO_TRACE
#: Message headers when there is nothing to carry.
NO_HEADERS: Mapping[str, str] = {}

_PROPAGATOR = TraceContextTextMapPropagator()
# What reads a caller's context from a call's metadata: OTEL_PROPAGATORS'
# (configure_tracing). Between jobplane's own hops (rows, messages) the
# context is always W3C's, through _PROPAGATOR.
_CALLERS: TextMapPropagator = _PROPAGATOR
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

# Attribute names (docs/tracing.md lists them).
JOB_ID = "jobplane.job.id"
JOB_TYPE = "jobplane.job.type"
QUEUE = "jobplane.queue"
ATTEMPT = "jobplane.attempt"
TENANT_ID = "jobplane.tenant.id"
TRANSITION = "jobplane.transition"
CLAIM_STATUS = "jobplane.claim.status"
REDELIVERED = "jobplane.redelivered"

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


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
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SpanExporter,
    )

    resource = Resource.create({} if settings.trace_service_name else {SERVICE_NAME: service_name})
    # Sampler from OTEL_TRACES_SAMPLER; shut down (flushed) at exit.
    provider = TracerProvider(resource=resource, shutdown_on_exit=True)
    for name in settings.trace_exporters:
        exporter: SpanExporter
        if name == "otlp" and settings.trace_protocol == "grpc":
            # Installed apart (the settings checked it is): imported by name.
            grpc_exporter: Any = importlib.import_module(
                "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"
            )
            exporter = grpc_exporter.OTLPSpanExporter()
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter(service_name=service_name)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _set_callers(_propagator(settings.trace_propagators))
    _PROVIDER = provider
    _TRACER = provider.get_tracer("jobplane", __version__)
    _set_skip_unsampled(_drops_unsampled_children(provider.sampler))
    # Here rather than by each caller: a process that turns tracing on (the
    # CLI, a Worker embedded in an application, a benchmark) would otherwise
    # trace its calls while its transitions and log lines carried no trace.
    register_transitions()
    register_logs()
    ENABLED = True
    return True


def _propagator(names: tuple[str, ...]) -> TextMapPropagator:
    """The propagators ``names`` (OTEL_PROPAGATORS'), in order, as one."""
    if names == ("tracecontext",):
        return _PROPAGATOR
    from importlib.metadata import entry_points

    from opentelemetry.propagators.composite import CompositePropagator

    return CompositePropagator(
        [
            next(iter(entry_points(group="opentelemetry_propagator", name=name))).load()()
            for name in names
        ]
    )


def _set_callers(propagator: TextMapPropagator) -> None:
    global _CALLERS  # noqa: PLW0603 - set with the provider, read by the server's calls
    _CALLERS = propagator


def _set_skip_unsampled(skip: bool) -> None:
    global _SKIP_UNSAMPLED  # noqa: PLW0603 - set with the provider, read on the hot paths
    _SKIP_UNSAMPLED = skip


def _drops_unsampled_children(sampler: Any) -> bool:
    """Whether ``sampler`` drops a span whose parent, remote or local, was not sampled:
    asked of the sampler itself, so any sampler of OTEL_TRACES_SAMPLER is judged
    by what it does."""
    from opentelemetry.sdk.trace.sampling import Decision

    for remote in (True, False):
        parent = trace.SpanContext(
            trace_id=1, span_id=1, is_remote=remote, trace_flags=trace.TraceFlags(0)
        )
        context = trace.set_span_in_context(trace.NonRecordingSpan(parent))
        try:
            decision = sampler.should_sample(context, 1, "jobplane probe").decision
        except Exception:
            return False
        if decision is not Decision.DROP:
            return False
    return True


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
    _set_callers(_PROPAGATOR)
    if provider is not None:
        provider.shutdown()


# --- propagation -------------------------------------------------------------


class _StringGetter(Getter[Mapping[str, Any]]):
    """Reads only string values of a sane length: AMQP headers may hold anything."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if not isinstance(value, str) or len(value) > _MAX_TRACEPARENT:
            return None
        return [value]

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return [str(k) for k in carrier]


_GETTER = _StringGetter()


# A version-00 traceparent whose sampled flag (bit 0 of the flags) is clear:
# the form jobplane itself writes for a trace that is not sampled.
_PLAINLY_UNSAMPLED = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f][02468ace]")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


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
    found = _PLAINLY_UNSAMPLED.fullmatch(parent)
    if found is None or found[1] == _ZERO_TRACE or found[2] == _ZERO_SPAN:
        return None
    return {TRACEPARENT: parent}


# What a log line reads of a stored traceparent: its trace id. The form the
# propagator accepts: version 00's four fields, a later version's may go on.
_TRACE_ID = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?")


def trace_id_of(headers: Mapping[str, Any] | None) -> str | None:
    """The trace id (32 hex digits) of ``headers``' ``traceparent``; None when it has
    none or it is not well formed.

    For a log line about a row or message whose span is not current (the relay
    logs a dispatch after its batch is confirmed): read from the string as it
    was stored, without the propagator's parse, as the short path carries it.
    """
    if not headers:
        return None
    parent = headers.get(TRACEPARENT)
    if not isinstance(parent, str):
        return None
    found = _TRACE_ID.fullmatch(parent)
    if (
        found is None
        or found[2] == _ZERO_TRACE
        or found[3] == _ZERO_SPAN
        or found[1] == "ff"
        or (found[1] == "00" and found[4] is not None)
    ):
        return None
    return found[2]


def _remote(parent: str) -> otel_context.Context:
    """The context of a traceparent :func:`_passed_on` took (so known to be well formed
    and not sampled): what the propagator's extract makes of it, without its checks."""
    span = trace.NonRecordingSpan(
        trace.SpanContext(
            trace_id=int(parent[3:35], 16),
            span_id=int(parent[36:52], 16),
            is_remote=True,
            trace_flags=trace.TraceFlags(int(parent[53:55], 16)),
        )
    )
    return trace.set_span_in_context(span, otel_context.Context())


def extract(carrier: Mapping[str, Any] | None) -> otel_context.Context:
    """The trace context in ``carrier``'s ``traceparent``/``tracestate``; an empty
    context (a new trace) for anything missing or malformed."""
    if not carrier:
        return otel_context.Context()
    try:
        return _PROPAGATOR.extract(carrier, context=otel_context.Context(), getter=_GETTER)
    except Exception:  # a propagator must never fail a call; be sure of it
        return otel_context.Context()


def _inject(context: otel_context.Context | None = None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    state = carrier.get(TRACESTATE)
    if state is not None and len(state) > MAX_TRACESTATE:
        del carrier[TRACESTATE]
    return carrier


def current_headers() -> Mapping[str, str]:
    """``traceparent`` (and ``tracestate``) of the current span; empty when off or none."""
    if not ENABLED:
        return NO_HEADERS
    quiet = _QUIET.get()
    return _inject() if quiet is None else quiet


def outgoing(traceparent: str | None, tracestate: str | None) -> tuple[str | None, str | None]:
    """The trace context to store with what a call publishes: the current span's
    when tracing is on, else the caller's (``traceparent``, ``tracestate``) as given."""
    if not ENABLED:
        return traceparent, tracestate
    carrier = _QUIET.get() or _inject()
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
    carrier = _QUIET.get() or _inject()
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


# --- the relay ---------------------------------------------------------------


def publish_span(
    row_headers: Mapping[str, str],
    *,
    exchange: str,
    routing_key: str,
    message_id: object,
    job_id: object,
    tenant_id: object,
) -> contextlib.AbstractContextManager[Mapping[str, str]]:
    """``outbox publish``: a producer span, child of the context the outbox row
    carries; the block gets the headers that carry it on to the message.
    ``message_id``, ``job_id`` and ``tenant_id`` are made strings only for a span.

    A row of a trace that is not sampled makes no span: its context goes on
    to the message as it came.
    """
    passed = _passed_on(row_headers)
    if passed is not None:
        return contextlib.nullcontext(passed)
    parent = extract(row_headers)
    if _unsampled(parent):
        return contextlib.nullcontext(_inject(parent))
    attributes = {
        "messaging.system": "rabbitmq",
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.destination.name": exchange,
        "messaging.rabbitmq.destination.routing_key": routing_key,
        "messaging.message.id": str(message_id),
        JOB_ID: str(job_id),
        TENANT_ID: str(tenant_id),
    }
    span = _TRACER.start_span(
        "outbox publish",
        context=parent,
        kind=SpanKind.PRODUCER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    )
    return _Publishing(span)


class RelayTracing:
    """A relay's and a sweeper's :class:`~jobplane.workers.interceptors.RelayInterceptor`
    that traces: the ``outbox publish`` span, and the trace ids of their lines.

    Handed to them by the process that turned tracing on (the CLI); the relay
    and the sweeper import no tracing.
    """

    def publish(
        self,
        row_headers: Mapping[str, str],
        *,
        exchange: str,
        routing_key: str,
        message_id: object,
        job_id: object,
        tenant_id: object,
    ) -> contextlib.AbstractContextManager[Mapping[str, str]]:
        """The :func:`publish_span` of the dispatch."""
        return publish_span(
            row_headers,
            exchange=exchange,
            routing_key=routing_key,
            message_id=message_id,
            job_id=job_id,
            tenant_id=tenant_id,
        )

    def trace_id(self, headers: Mapping[str, Any] | None) -> str | None:
        """The :func:`trace_id_of` the stored context."""
        return trace_id_of(headers)

    def relayed(self, kind: str, outcome: str, count: int) -> None:
        """Not traced."""

    def confirmed(self, seconds: float) -> None:
        """Not traced (each publish has its span)."""

    def batched(self, seconds: float) -> None:
        """Not traced."""

    def repaired(self, report: SweepReport) -> None:
        """Not traced (each republished dispatch's line names its trace)."""


# --- the worker --------------------------------------------------------------


def delivered(headers: Mapping[str, Any] | None) -> contextlib.AbstractContextManager[object]:
    """The context of a delivered message, current for the block (its spans' parent)."""
    if not ENABLED:
        return _NULL
    passed = _passed_on(headers)
    if passed is not None:
        # Current for the handler (its own calls out carry the trace on), and
        # carried on as it came by the delivery's writes.
        return _attached(_remote(passed[TRACEPARENT]), passed)
    context = extract(headers)
    return _attached(context, _inject(context) if _unsampled(context) else None)


@contextlib.contextmanager
def _attached(context: otel_context.Context, quiet: Mapping[str, str] | None) -> Iterator[object]:
    token = otel_context.attach(context)
    marked = _QUIET.set(quiet)
    try:
        yield None
    finally:
        _QUIET.reset(marked)
        otel_context.detach(token)


def claim_span(
    envelope: Envelope, message: AbstractIncomingMessage
) -> contextlib.AbstractContextManager[Span | None]:
    """``job claim``: the consumer span of a delivery, around the fenced claim
    (none for a delivery of a trace that is not sampled)."""
    if not ENABLED or _unsampled():
        return _NULL
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
    return _span("job claim", SpanKind.CONSUMER, attributes)


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
    if not ENABLED or _unsampled():
        return None
    return _TRACER.start_span(
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
        _failed(span, error)
    span.end()


def progress_event(progress: float) -> None:
    """A progress report, as an event on the handler's span (the current one)."""
    if not ENABLED:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event("progress", {"jobplane.progress": progress})


def outcome_span(attempt: Attempt) -> contextlib.AbstractContextManager[Span | None]:
    """``job outcome``: the span of the attempt's outcome write (its transition named;
    none for a trace that is not sampled)."""
    if not ENABLED or _unsampled():
        return _NULL
    attributes = {JOB_ID: str(attempt.job_id), JOB_TYPE: attempt.type, ATTEMPT: attempt.attempt}
    return _span("job outcome", SpanKind.INTERNAL, attributes)


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
        message: AbstractIncomingMessage,
        claim: Callable[[], Awaitable[ClaimResult]],
    ) -> ClaimResult:
        """The claim inside :func:`claim_span`, what it found on the span."""
        with claim_span(envelope, message) as span:
            found = await claim()
            claimed(span, found)
        return found

    def applied(self, transition: Transition) -> None:
        """:func:`applied`, while tracing is on."""
        if ENABLED:
            applied(transition)

    def grouped(self, kind: str, size: int) -> None:
        """A group is not traced (each of its deliveries names its transition)."""

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
        return _inject()


def _failed(span: Span, exc: BaseException) -> None:
    # The type only: an exception's message may quote tenant data.
    span.set_attribute("error.type", type(exc).__qualname__)
    span.set_status(Status(StatusCode.ERROR, type(exc).__qualname__))


# --- the server ----------------------------------------------------------------

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
            if name == key and isinstance(value, str) and len(value) <= _MAX_TRACEPARENT:
                return [value]
        return None

    def keys(self, carrier: Iterable[tuple[str, Any]]) -> list[str]:
        return [name for name, _ in carrier]


_METADATA = _MetadataGetter()


def _from_metadata(metadata: Any) -> otel_context.Context:
    try:
        return _CALLERS.extract(
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
    name = method.lstrip("/")
    service, _, rpc = name.partition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc}

    def start(context: Context) -> _Current:
        # The span made current by _Current (no generator, no exception
        # recording): most calls' spans are not sampled, and cost only this.
        return _Current(
            _TRACER.start_span(
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
    if handler.unary_stream is not None:
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
    if handler.stream_unary is not None:
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
    return handler


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
