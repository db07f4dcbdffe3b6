"""Trace context in messages and rows: the W3C ``traceparent``/``tracestate``
carried by outbox rows, AMQP headers and log lines (docs/tracing.md).

What reads and writes a carrier, with nothing of the tracing switch: the
propagation is OpenTelemetry's own W3C propagator, never formatted by hand,
and what does not parse is a new trace, never an error. The span attribute
names are here too, for every part that sets them. Imported through
:mod:`jobplane.observe.tracing`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from jobplane.store import observers

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
#: A tracestate longer than this is dropped, not carried: the W3C
#: recommendation asks for at least 512 characters to be kept, and a longer
#: one could make an AMQP header frame too large to publish.
MAX_TRACESTATE = 512
# A traceparent is 55 characters (version 00); a longer value from a future
# version is cut to its first 55 by the propagator, but nothing that long is read.
MAX_TRACEPARENT = 512

#: What a transition's statement binds when there is no trace context (the
#: store's own, for when nothing observes its transitions).
NO_TRACE: Mapping[str, Any] = observers.NO_TRACE
#: Message headers when there is nothing to carry.
NO_HEADERS: Mapping[str, str] = {}

#: The propagator between jobplane's own hops (rows, messages): always W3C's.
PROPAGATOR = TraceContextTextMapPropagator()

# Attribute names (docs/tracing.md lists them).
JOB_ID = "jobplane.job.id"
JOB_TYPE = "jobplane.job.type"
QUEUE = "jobplane.queue"
ATTEMPT = "jobplane.attempt"
TENANT_ID = "jobplane.tenant.id"
TRANSITION = "jobplane.transition"
CLAIM_STATUS = "jobplane.claim.status"
REDELIVERED = "jobplane.redelivered"


class _StringGetter(Getter[Mapping[str, Any]]):
    """Reads only string values of a sane length: AMQP headers may hold anything."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if not isinstance(value, str) or len(value) > MAX_TRACEPARENT:
            return None
        return [value]

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return [str(k) for k in carrier]


GETTER = _StringGetter()


#: A version-00 traceparent whose sampled flag (bit 0 of the flags) is clear:
#: the form jobplane itself writes for a trace that is not sampled.
PLAINLY_UNSAMPLED = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f][02468ace]")
ZERO_TRACE = "0" * 32
ZERO_SPAN = "0" * 16


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
        or found[2] == ZERO_TRACE
        or found[3] == ZERO_SPAN
        or found[1] == "ff"
        or (found[1] == "00" and found[4] is not None)
    ):
        return None
    return found[2]


def remote(parent: str) -> otel_context.Context:
    """The context of a traceparent the short path took (so known to be well formed
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
        return PROPAGATOR.extract(carrier, context=otel_context.Context(), getter=GETTER)
    except Exception:  # a propagator must never fail a call; be sure of it
        return otel_context.Context()


def inject(context: otel_context.Context | None = None) -> dict[str, str]:
    """The headers that carry ``context`` (the current one by default) on; a
    ``tracestate`` longer than :data:`MAX_TRACESTATE` is left off."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=context)
    state = carrier.get(TRACESTATE)
    if state is not None and len(state) > MAX_TRACESTATE:
        del carrier[TRACESTATE]
    return carrier
