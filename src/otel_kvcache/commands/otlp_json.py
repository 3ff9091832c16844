"""Reading OTLP JSON lines files: the collector's file exporter format, and the demo's.

Each line is one export request in the OTLP JSON encoding, read into
``opentelemetry-proto``'s messages by protobuf's JSON mapping, so every field and
value type is read as OpenTelemetry defines it. OTLP JSON differs from that mapping
in one way: trace and span ids are hex strings, not base64 ("JSON Protobuf Encoding"
in the OTLP specification).

Shared by the leak gate (``otel-kvcache-gate``), the report and the demo's table.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from otel_kvcache import names

Request = TypeVar("Request", bound=Message)

_ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"})
"""Fields that hold a trace or span id (of spans, links, exemplars and log records), under
their JSON and proto names, both of which OTLP JSON receivers accept."""

Value = str | bool | int | float | bytes | list | dict | None


@dataclass
class LineCount:
    """What a file held: export requests read, and lines that were not OTLP JSON."""

    requests: int = 0
    skipped: int = 0


def _hex_ids_as_base64(node):
    """The JSON tree, its hex ids as base64 (protobuf's JSON for bytes)."""
    if isinstance(node, dict):
        return {
            key: _base64(value) if key in _ID_FIELDS and isinstance(value, str) else _hex_ids_as_base64(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_hex_ids_as_base64(value) for value in node]
    return node


def _base64(hex_id: str) -> str:
    return base64.b64encode(bytes.fromhex(hex_id)).decode("ascii")


def parse(line: str | bytes, request_type: type[Request]) -> Request:
    """One line of OTLP JSON as an export request; ValueError when it is not one.

    Fields newer than this ``opentelemetry-proto`` are left out, not refused.
    """
    tree = json.loads(line)
    top = request_type.DESCRIPTOR.fields[0]  # resource_spans, resource_metrics, resource_logs
    if not isinstance(tree, dict) or not isinstance(tree.get(top.json_name, tree.get(top.name)), list):
        raise ValueError(f"not an OTLP JSON {request_type.DESCRIPTOR.name}")
    try:
        return json_format.ParseDict(_hex_ids_as_base64(tree), request_type(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise ValueError(str(exc)) from exc


def requests(path: Path, request_type: type[Request], count: LineCount | None = None) -> Iterator[Request]:
    """Each export request of an OTLP JSON lines file, one line in memory at a time; a line that
    is not one (a collector killed mid-write leaves half a line) is counted and skipped."""
    count = count if count is not None else LineCount()
    if not path.is_file():
        return
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                request = parse(line, request_type)
            except ValueError:  # json.JSONDecodeError, a bad id, a message that does not fit
                count.skipped += 1
                continue
            count.requests += 1
            yield request


def value(any_value: AnyValue) -> Value:
    """An attribute's value as Python's: arrays as lists, key-value lists as dicts; None if unset."""
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return attributes(any_value.kvlist_value.values)
    return getattr(any_value, kind) if kind else None


def attributes(key_values: Iterable[KeyValue]) -> dict[str, Value]:
    return {kv.key: value(kv.value) for kv in key_values}


def spans(path: Path, count: LineCount | None = None) -> Iterator[tuple[dict[str, Value], str, Span]]:
    """(resource attributes, scope name, span) for every span in a traces file."""
    for request in requests(path, ExportTraceServiceRequest, count):
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    yield resource, scope_spans.scope.name, span


def metrics(path: Path, count: LineCount | None = None) -> Iterator[tuple[str, Metric]]:
    """(scope name, metric) for every metric in a metrics file."""
    for request in requests(path, ExportMetricsServiceRequest, count):
        for resource_metrics in request.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    yield scope_metrics.scope.name, metric


def kv_spans(traces_path: Path) -> list[dict]:
    """Every ``vllm.kv_cache.request`` span: its trace id, attributes and event names."""
    found = [
        {
            "trace_id": span.trace_id.hex(),
            "start": span.start_time_unix_nano,
            "attributes": attributes(span.attributes),
            "events": [e.name for e in span.events],
        }
        for _, _, span in spans(traces_path)
        if span.name == names.KV_REQUEST_SPAN
    ]
    return sorted(found, key=lambda s: s["start"])


def metric_points(metrics_path: Path, name: str) -> list[dict]:
    """Data points of one metric, gauge or sum, with their attributes."""
    points = []
    for _, metric in metrics(metrics_path):
        if metric.name != name or metric.WhichOneof("data") not in ("gauge", "sum"):
            continue
        for point in getattr(metric, metric.WhichOneof("data")).data_points:
            points.append(
                {
                    "time": point.time_unix_nano,
                    "value": float(number(point) or 0),
                    "attributes": attributes(point.attributes),
                }
            )
    return points


def number(point) -> int | float | None:
    """A gauge's or sum's data point's value; None if it has none."""
    kind = point.WhichOneof("value")  # as_int, as_double
    return getattr(point, kind) if kind else None


def latest_per_engine(points: list[dict]) -> dict:
    """The newest point of each engine (``vllm.engine.index``): a gauge's last reading,
    a cumulative counter's total."""
    latest: dict = {}
    for point in points:
        engine = point["attributes"].get(names.ENGINE_INDEX)
        if engine not in latest or point["time"] >= latest[engine]["time"]:
            latest[engine] = point
    return latest


def span_events(traces_path: Path, event_names: set[str]) -> list[tuple[str, dict]]:
    """(event name, event attributes) of the named events, on any span."""
    return [
        (event.name, attributes(event.attributes))
        for _, _, span in spans(traces_path)
        for event in span.events
        if event.name in event_names
    ]
