"""An OTLP/HTTP sink for benchmarks: accepts POST /v1/metrics, counts bytes, answers 200.

Runs as its own process so that receiving ~100 MB per export does not compete with the
benchmark's timing client for the GIL."""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    received = 0
    windows: list[tuple[float, float]] = []  # wall-clock (start, end) of each request

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        start = time.time()
        length = int(self.headers.get("Content-Length", "0"))
        remaining = length
        while remaining:
            remaining -= len(self.rfile.read(min(remaining, 1 << 20)))
        Sink.received += length
        Sink.windows.append((start, time.time()))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        data = Sink.windows if self.path == "/windows" else Sink.received
        body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Sink)
    server.serve_forever()
