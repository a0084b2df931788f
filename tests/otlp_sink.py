"""A real OTLP/gRPC receiver for tests: stores every export it is sent.

Tests start it on 127.0.0.1 with an ephemeral port and stop it when done; it is a
plain grpcio server speaking the OTLP TraceService and MetricsService, so the
OpenTelemetry SDK's own OTLP exporters talk to it exactly as they would to a
production collector.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Callable

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


class OtlpSink(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        #: the gRPC metadata of every export, in arrival order
        self.metadata: list[dict[str, str]] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    # --- OTLP services ---------------------------------------------------------
    def Export(self, request, context):  # noqa: N802 - grpc naming
        with self._changed:
            self.metadata.append(dict(context.invocation_metadata()))
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                self.trace_requests.append(request)
                self._changed.notify_all()
                return trace_service_pb2.ExportTraceServiceResponse()
            self.metric_requests.append(request)
            self._changed.notify_all()
            return metrics_service_pb2.ExportMetricsServiceResponse()

    # --- test helpers ------------------------------------------------------------
    def start(self) -> "OtlpSink":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None).wait()

    def spans(self) -> list[tuple[dict, trace_pb2.Span]]:
        """Every span received, with its resource attributes as a dict."""
        out = []
        with self._lock:
            requests = list(self.trace_requests)
        for req in requests:
            for rs in req.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((resource, span) for span in ss.spans)
        return out

    def wait_for(self, predicate: Callable[["OtlpSink"], bool], timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self):
                return True
            with self._changed:
                self._changed.wait(timeout=0.2)
        return predicate(self)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def attributes(span: trace_pb2.Span) -> dict:
    return {kv.key: _value(kv.value) for kv in span.attributes}
