"""A small OTLP/HTTP trace receiver on loopback, for the tracing tests and bench.

It keeps each ``ExportTraceServiceRequest`` (opentelemetry-proto) as the SDK's
exporter sent it and decodes the spans when they are asked for, as a collector
would receive them. Decoding later keeps the receiver's own work (a
collector's, elsewhere in a deployment) out of the process it runs in while
spans arrive: the benchmark's clients share that process.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """One span as exported: ids in hex, attributes as plain values."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: int
    links: list[tuple[str, str]] = field(default_factory=list)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attributes(items: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in items}


class Receiver:
    """``with Receiver.running() as receiver:``; its ``endpoint`` is OTEL_EXPORTER_OTLP_ENDPOINT."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._bodies: list[bytes] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._lock:
                    receiver.requests += 1
                    receiver._bodies.append(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True

    @property
    def endpoint(self) -> str:
        """The base URL (the exporter appends /v1/traces)."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def _decode(self, body: bytes) -> list[ReceivedSpan]:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        spans = []
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name"))
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    spans.append(
                        ReceivedSpan(
                            service=service,
                            name=s.name,
                            kind=s.kind,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes=_attributes(s.attributes),
                            events=[(e.name, _attributes(e.attributes)) for e in s.events],
                            status=s.status.code,
                            links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                        )
                    )
        return spans

    def snapshot(self) -> list[ReceivedSpan]:
        """The spans received so far."""
        with self._lock:
            bodies, self._bodies = self._bodies, []
            for body in bodies:
                self.spans.extend(self._decode(body))
            return list(self.spans)

    @classmethod
    @contextmanager
    def running(cls) -> Iterator[Receiver]:
        """A receiver serving in a thread for the block."""
        receiver = cls()
        thread = threading.Thread(target=receiver._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield receiver
        finally:
            receiver._server.shutdown()
            receiver._server.server_close()
            thread.join(5)
