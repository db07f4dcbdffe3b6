"""The relay's and the sweeper's spans: ``outbox publish``, a producer span child
of the context an outbox row carries, whose context goes on to the message.

Reads the switch of :mod:`jobplane.observe.tracing` at each call; imported
through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import SpanKind

from jobplane.observe import tracing
from jobplane.observe.trace_context import JOB_ID, TENANT_ID, extract, inject, trace_id_of

if TYPE_CHECKING:
    from jobplane.workers.sweeper import SweepReport


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
    passed = tracing._passed_on(row_headers)
    if passed is not None:
        return contextlib.nullcontext(passed)
    parent = extract(row_headers)
    if tracing._unsampled(parent):
        return contextlib.nullcontext(inject(parent))
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
    span = tracing._TRACER.start_span(
        "outbox publish",
        context=parent,
        kind=SpanKind.PRODUCER,
        attributes=attributes,
        record_exception=False,
        set_status_on_exception=False,
    )
    return tracing._Publishing(span)


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
