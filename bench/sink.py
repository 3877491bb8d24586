"""An OTLP/HTTP sink for benchmarks: accepts POST /v1/metrics and /v1/traces, counts bytes,
answers 200.

Runs as its own process so that receiving ~100 MB per export does not compete with the
benchmark's timing client for the GIL. From traces of the example kubelet plugin it also keeps,
per prepared claim, the driver's time after reading the claim (``GET /driver`` hands them over
and forgets them): see :func:`driver_seconds`."""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def driver_seconds(body: bytes) -> list[float]:
    """Per freshly prepared claim in an OTLP trace export: from the end of its claim read (the
    GET child span) to the end of its ``prepare claim`` span, i.e. what upstream's histogram
    times. Claims answered from the checkpoint have no GET and are skipped."""
    request = ExportTraceServiceRequest.FromString(body)
    spans = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    claims = {s.span_id: s for s in spans if s.name == "prepare claim"}
    return [
        (claims[s.parent_span_id].end_time_unix_nano - s.end_time_unix_nano) / 1e9
        for s in spans
        if s.name.startswith("GET ") and s.parent_span_id in claims
    ]


def span_seconds(body: bytes) -> dict[str, list[float]]:
    """Durations of the spans in an OTLP trace export, by span name."""
    request = ExportTraceServiceRequest.FromString(body)
    out: dict[str, list[float]] = {}
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.setdefault(s.name, []).append((s.end_time_unix_nano - s.start_time_unix_nano) / 1e9)
    return out


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    received = 0
    windows: list[tuple[float, float]] = []  # wall-clock (start, end) of each request
    driver: list[float] = []  # see driver_seconds
    spans: dict[str, list[float]] = {}  # see span_seconds

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        start = time.time()
        length = int(self.headers.get("Content-Length", "0"))
        remaining = length
        chunks = []
        while remaining:
            chunk = self.rfile.read(min(remaining, 1 << 20))
            remaining -= len(chunk)
            if self.path == "/v1/traces":
                chunks.append(chunk)
        if chunks:
            Sink.driver += driver_seconds(b"".join(chunks))
            for name, seconds in span_seconds(b"".join(chunks)).items():
                Sink.spans.setdefault(name, []).extend(seconds)
        Sink.received += length
        Sink.windows.append((start, time.time()))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        data: Any = Sink.received
        if self.path == "/windows":
            data = Sink.windows
        elif self.path == "/driver":
            data, Sink.driver = Sink.driver, []
        elif self.path == "/spans":
            data, Sink.spans = Sink.spans, {}
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink)
    server.serve_forever()
