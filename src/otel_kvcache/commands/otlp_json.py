"""Reading OTLP JSON lines files: the collector's file exporter format, and the demo's.

Shared by the leak gate (``otel-kvcache-gate``) and the demo's report.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from otel_kvcache import names


def _value(any_value: dict):
    for kind in ("stringValue", "boolValue", "doubleValue"):
        if kind in any_value:
            return any_value[kind]
    if "intValue" in any_value:
        return int(any_value["intValue"])  # int64 is a string in OTLP JSON
    return None


def attributes(key_values: Iterable[dict]) -> dict:
    return {kv["key"]: _value(kv.get("value", {})) for kv in key_values}


def lines(path: Path) -> Iterator[dict]:
    if path.exists():
        with open(path) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def kv_spans(traces_path: Path) -> list[dict]:
    """Every ``vllm.kv_cache.request`` span: its trace id, attributes and event names."""
    spans = []
    for request in lines(traces_path):
        for resource_spans in request.get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    if span["name"] == names.KV_REQUEST_SPAN:
                        spans.append(
                            {
                                "trace_id": span["traceId"],
                                "start": int(span["startTimeUnixNano"]),
                                "attributes": attributes(span.get("attributes", [])),
                                "events": [e["name"] for e in span.get("events", [])],
                            }
                        )
    return sorted(spans, key=lambda s: s["start"])


def metric_points(metrics_path: Path, name: str) -> list[dict]:
    """Data points of one metric, gauge or sum, with their attributes."""
    points = []
    for request in lines(metrics_path):
        for resource_metrics in request.get("resourceMetrics", []):
            for scope_metrics in resource_metrics.get("scopeMetrics", []):
                for metric in scope_metrics.get("metrics", []):
                    if metric["name"] != name:
                        continue
                    data = metric.get("gauge") or metric.get("sum") or {}
                    for point in data.get("dataPoints", []):
                        value = point.get("asInt", point.get("asDouble", 0))
                        points.append(
                            {
                                "time": int(point.get("timeUnixNano", 0)),
                                "value": float(value),
                                "attributes": attributes(point.get("attributes", [])),
                            }
                        )
    return points


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
    found = []
    for request in lines(traces_path):
        for resource_spans in request.get("resourceSpans", []):
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    for event in span.get("events", []):
                        if event["name"] in event_names:
                            found.append((event["name"], attributes(event.get("attributes", []))))
    return found
