"""A real OTLP/HTTP trace receiver for tests: an http.server thread on 127.0.0.1 that decodes
`ExportTraceServiceRequest` protobuf bodies (gzip or plain) with opentelemetry-proto and keeps
the spans, flattened, for assertions. `fail_with(503)` makes it answer errors until reset."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_time_unix_nano: int
    end_time_unix_nano: int
    status_code: int
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    scope: str
    # the span's events: (name, time_unix_nano, attributes), as sent
    events: list[tuple[str, int, dict[str, Any]]] = field(default_factory=list)


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


@dataclass
class OTLPReceiver:
    host: str = "127.0.0.1"
    port: int = 0
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    fail_status: int | None = None
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        """The base URL, as OTEL_EXPORTER_OTLP_ENDPOINT would hold it."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> OTLPReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver._lock:
                    receiver.requests += 1
                    status = receiver.fail_status
                if self.path != "/v1/traces":
                    self._answer(404, b"")
                    return
                if status is not None:
                    self._answer(status, b"")
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver._collect(request)
                self._answer(200, ExportTraceServiceResponse().SerializeToString())

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        return self

    def _collect(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_time_unix_nano=s.start_time_unix_nano,
                            end_time_unix_nano=s.end_time_unix_nano,
                            status_code=s.status.code,
                            status_message=s.status.message,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            resource=resource,
                            scope=ss.scope.name,
                            events=[
                                (e.name, e.time_unix_nano, {kv.key: _value(kv.value) for kv in e.attributes})
                                for e in s.events
                            ],
                        )
                    )
        with self._lock:
            self.spans.extend(got)

    def fail_with(self, status: int | None) -> None:
        with self._lock:
            self.fail_status = status

    def wait_for(self, count: int, timeout_s: float = 5.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.01)
        raise AssertionError(f"OTLP receiver got {len(self.spans)} spans, expected {count}")

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
