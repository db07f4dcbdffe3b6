"""What :func:`jobplane.observe.tracing.configure_tracing` installs: the SDK's
tracer provider with its exporters, the propagators that read a caller's
context, and what the sampler does with a parent that is not sampled.

Apart from the switch so that the SDK (``opentelemetry.sdk``) and the
exporters are imported only where tracing is turned on.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.propagators.textmap import TextMapPropagator

from jobplane.observe.trace_context import PROPAGATOR

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from jobplane.config import Settings


def tracer_provider(service_name: str, settings: Settings) -> TracerProvider:
    """The SDK's provider, one batch span processor per exporter ``settings`` name.

    ``service_name`` is the resource's ``service.name`` unless
    ``OTEL_SERVICE_NAME`` names one; the sampler is ``OTEL_TRACES_SAMPLER``'s.
    """
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
    return provider


def propagator(names: tuple[str, ...]) -> TextMapPropagator:
    """The propagators ``names`` (OTEL_PROPAGATORS'), in order, as one."""
    if names == ("tracecontext",):
        return PROPAGATOR
    from importlib.metadata import entry_points

    from opentelemetry.propagators.composite import CompositePropagator

    return CompositePropagator(
        [
            next(iter(entry_points(group="opentelemetry_propagator", name=name))).load()()
            for name in names
        ]
    )


def drops_unsampled_children(sampler: Any) -> bool:
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
