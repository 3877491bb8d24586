"""A minimal OTLP receiver for tests: the real OTLP protocol (gRPC and HTTP/protobuf), decoded with
the official opentelemetry-proto messages, recording what it receives. (A real Collector is used
by the end-to-end tests; this keeps the exporter's own tests fast and self-contained.)"""

from __future__ import annotations

import gzip
import threading
import zlib
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.helpers import wait_until


class OtlpReceiver:
    def __init__(self) -> None:
        self.metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.traces: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._grpc_pool: futures.ThreadPoolExecutor | None = None
        self._http: ThreadingHTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self.grpc_port = 0
        self.http_port = 0

    # --- servers ------------------------------------------------------------------------------
    def start(self) -> OtlpReceiver:
        receiver = self

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):
                with receiver._lock:
                    receiver.metrics.append(request)
                return metrics_service_pb2.ExportMetricsServiceResponse()

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                with receiver._lock:
                    receiver.traces.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._grpc_pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-receiver-grpc")
        self._grpc = grpc.server(self._grpc_pool)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), self._grpc)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path == "/v1/metrics":
                    msg = metrics_service_pb2.ExportMetricsServiceRequest.FromString(body)
                    with receiver._lock:
                        receiver.metrics.append(msg)
                    reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                elif self.path == "/v1/traces":
                    tmsg = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                    with receiver._lock:
                        receiver.traces.append(tmsg)
                    reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="otlp-receiver-http", daemon=True)
        self._http_thread.start()
        return self

    def stop(self) -> None:
        """Stop both servers and wait for their threads (the gRPC server leaves its pool running)."""
        if self._grpc is not None:
            self._grpc.stop(0).wait(5)
        if self._grpc_pool is not None:
            self._grpc_pool.shutdown(wait=True, cancel_futures=True)
        if self._http is not None:
            self._http.shutdown()  # HTTP/1.0: each request's thread ends with its response
            self._http.server_close()
        if self._http_thread is not None:
            self._http_thread.join(5)

    # --- reading --------------------------------------------------------------------------------
    def metric_points(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The data points of the newest export of each metric: name -> [(attributes, value)]."""
        latest: dict[str, list[tuple[dict[str, str], float]]] = {}
        with self._lock:
            requests = list(self.metrics)
        for request in requests:
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        kind = metric.WhichOneof("data")
                        data = getattr(metric, kind)
                        points = []
                        for p in data.data_points:
                            attrs = {a.key: a.value.string_value for a in p.attributes}
                            if kind == "histogram":
                                value = float(p.count)
                            else:
                                value = p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)
                            points.append((attrs, value))
                        latest[metric.name] = points
        return latest

    def resource_attributes(self) -> dict[str, str]:
        with self._lock:
            for request in self.metrics:
                for rm in request.resource_metrics:
                    return {a.key: a.value.string_value for a in rm.resource.attributes}
        return {}

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> bool:
        """Whether ``predicate(self)`` came true within ``timeout`` (callers assert it with their
        own message)."""
        try:
            wait_until(lambda: predicate(self), timeout=timeout, what="the OTLP receiver")
        except AssertionError:
            return bool(predicate(self))
        return True
