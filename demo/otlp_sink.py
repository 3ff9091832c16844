"""A local OTLP/gRPC receiver that keeps what it receives and writes it as OTLP JSON.

Built on the official ``opentelemetry-proto`` service definitions. Each export
request becomes one line of OTLP JSON (the encoding of the collector's file
exporter and its ``otlpjsonfile`` receiver: lowerCamelCase fields, trace and
span ids in hex), in ``traces.jsonl``, ``metrics.jsonl`` and ``logs.jsonl``.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf.json_format import MessageToDict
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2, logs_service_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

_ID_FIELDS = {"traceId", "spanId", "parentSpanId"}


def _hex_ids(value):
    """protobuf's JSON mapping writes bytes as base64; OTLP JSON wants hex ids."""
    if isinstance(value, dict):
        return {
            k: (base64.b64decode(v).hex() if k in _ID_FIELDS and isinstance(v, str) else _hex_ids(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_hex_ids(v) for v in value]
    return value


def to_otlp_json(message) -> dict:
    return _hex_ids(MessageToDict(message, preserving_proto_field_name=False))


class OTLPSink:
    """Receives traces, metrics and logs on ``127.0.0.1:<port>``."""

    def __init__(
        self,
        directory: str | Path | None = None,
        port: int = 0,
        refuse: bool = False,
        trace_delay: float = 0.0,
        max_message_bytes: int | None = None,
    ) -> None:
        self.directory = Path(directory) if directory else None
        self.trace_delay = trace_delay
        """Seconds each trace export takes to answer (a slow or distant collector)."""
        self.refuse = refuse
        """Answer every export with PERMISSION_DENIED (not retried), keeping nothing."""
        self.refused = 0
        """Spans refused so far."""
        self._lock = threading.Lock()
        self.requests: dict[str, list] = {kind: [] for kind, *_ in _SERVICES}
        # gRPC's default limit, and the Collector's, is 4 MiB: larger requests are refused
        # as RESOURCE_EXHAUSTED before they reach a servicer.
        options = [("grpc.max_receive_message_length", max_message_bytes)] if max_message_bytes else []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
        for kind, base, response, add_to_server in _SERVICES:
            add_to_server(_servicer(base, kind, response)(self), self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        if self.directory:
            self.directory.mkdir(parents=True, exist_ok=True)
            for kind in self.requests:
                (self.directory / f"{kind}.jsonl").write_text("")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OTLPSink:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=1).wait()

    def _keep(self, kind: str, request) -> None:
        with self._lock:
            self.requests[kind].append(request)
            if self.directory:
                with open(self.directory / f"{kind}.jsonl", "a") as f:
                    f.write(json.dumps(to_otlp_json(request), separators=(",", ":")) + "\n")

    def _refused(self, request) -> None:
        with self._lock:
            for resource_spans in getattr(request, "resource_spans", ()):
                self.refused += sum(len(scope_spans.spans) for scope_spans in resource_spans.scope_spans)

    # --- what the tests read ---------------------------------------------------------

    def spans(self):
        """(resource attributes, span) for every span received."""
        with self._lock:
            requests = list(self.requests["traces"])
        for request in requests:
            for resource_spans in request.resource_spans:
                resource = attributes_of(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        yield resource, span

    def metrics(self, name: str | None = None):
        """(resource attributes, metric) for every metric received, optionally of one name."""
        with self._lock:
            requests = list(self.requests["metrics"])
        for request in requests:
            for resource_metrics in request.resource_metrics:
                resource = attributes_of(resource_metrics.resource.attributes)
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        if name is None or metric.name == name:
                            yield resource, metric


def attributes_of(key_values) -> dict:
    """OTLP KeyValue list -> plain dict."""
    result = {}
    for kv in key_values:
        value = kv.value
        kind = value.WhichOneof("value")
        result[kv.key] = getattr(value, kind) if kind else None
    return result


def _servicer(base: type, kind: str, response: type) -> type:
    """A gRPC servicer for one signal that hands every export request to the sink."""

    class Servicer(base):
        def __init__(self, sink: OTLPSink) -> None:
            self.sink = sink

        def Export(self, request, context):  # noqa: N802 - the gRPC method name
            if kind == "traces" and self.sink.trace_delay:
                time.sleep(self.sink.trace_delay)
            if self.sink.refuse:
                self.sink._refused(request)
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "this sink refuses everything")
            self.sink._keep(kind, request)
            return response()

    return Servicer


_SERVICES = (
    ("traces", trace_service_pb2_grpc.TraceServiceServicer, trace_service_pb2.ExportTraceServiceResponse,
     trace_service_pb2_grpc.add_TraceServiceServicer_to_server),
    ("metrics", metrics_service_pb2_grpc.MetricsServiceServicer, metrics_service_pb2.ExportMetricsServiceResponse,
     metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server),
    ("logs", logs_service_pb2_grpc.LogsServiceServicer, logs_service_pb2.ExportLogsServiceResponse,
     logs_service_pb2_grpc.add_LogsServiceServicer_to_server),
)  # fmt: skip
