"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with a protobuf body.

It decodes each export with OpenTelemetry's own protobuf classes (what a collector
does) and keeps the spans, so a test sees what a collector would have received, not
what an in-process exporter was handed.
"""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the receiver decoded it (ids as lower-case hex)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: str  # SPAN_KIND_SERVER, SPAN_KIND_INTERNAL, ...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]]
    error: str | None  # the status message of an error span, None otherwise
    service: str


class Receiver:
    """What the server has received so far (read it after the pool has shut down)."""

    def __init__(self) -> None:
        self.url = ""
        self.exports = 0
        self.bodies_rejected = 0
        # The headers of each export (names in lower case), to see the exporter's settings.
        self.headers: list[dict[str, str]] = []
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def take(self, body: bytes) -> None:
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        received = []
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    error = span.status.code == Status.STATUS_CODE_ERROR
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=Span.SpanKind.Name(span.kind),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=[(e.name, e.time_unix_nano) for e in span.events],
                            error=span.status.message if error else None,
                            service=str(resource.get("service.name")),
                        )
                    )
        with self._lock:
            self._spans.extend(received)
            self.exports += 1


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """Serve an OTLP/HTTP receiver on 127.0.0.1 (a free port) in a thread."""
    receiver = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
            encoding = self.headers.get("content-encoding", "")
            if encoding == "gzip":
                body = gzip.decompress(body)
            elif encoding == "deflate":
                body = zlib.decompress(body)
            if self.path != "/v1/traces":
                receiver.bodies_rejected += 1
                self.send_response(404)
                self.end_headers()
                return
            receiver.take(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: the test reads what was received

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
