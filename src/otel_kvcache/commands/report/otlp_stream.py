"""OTLP JSON lines read one export request at a time, as flat records.

A report may be built from a collector's file exporter after a long load test,
with files of gigabytes: nothing here keeps more than the line being read.
``otlp_json.kv_spans`` and ``metric_points`` build lists for the gate and the
demo's table; the report folds each record into bounded aggregates instead.

A line that is not OTLP JSON (a collector killed mid-write leaves half a line)
is counted and skipped: the rest of the file still tells what happened.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from otel_kvcache.commands.otlp_json import attributes


@dataclass
class LineCount:
    """What a file held: export requests read, and lines that were not OTLP JSON."""

    requests: int = 0
    skipped: int = 0


def _requests(path: Path, key: str, count: LineCount) -> Iterator[dict]:
    """Each export request in the file whose top-level list is ``key``."""
    if not path.is_file():
        return
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except ValueError:
                count.skipped += 1
                continue
            if not isinstance(request, dict) or not isinstance(request.get(key), list):
                count.skipped += 1
                continue
            count.requests += 1
            yield request


def spans(path: Path, count: LineCount) -> Iterator[tuple[dict, str, dict]]:
    """(resource attributes, scope name, span) for every span in a traces file."""
    for request in _requests(path, "resourceSpans", count):
        for resource_spans in request["resourceSpans"]:
            resource = attributes(resource_spans.get("resource", {}).get("attributes", []))
            for scope_spans in resource_spans.get("scopeSpans", []):
                scope = scope_spans.get("scope", {}).get("name", "")
                for span in scope_spans.get("spans", []):
                    yield resource, scope, span


@dataclass
class Point:
    """One number of a gauge or a sum, flattened out of its export request."""

    metric: str
    scope: str
    time: int
    start: int
    value: float
    attributes: dict
    delta: bool
    """A sum exported with delta temporality: each point counts since the previous one."""


def points(path: Path, count: LineCount) -> Iterator[Point]:
    """Every gauge and sum data point in a metrics file (histograms are left out)."""
    for request in _requests(path, "resourceMetrics", count):
        for resource_metrics in request["resourceMetrics"]:
            for scope_metrics in resource_metrics.get("scopeMetrics", []):
                scope = scope_metrics.get("scope", {}).get("name", "")
                for metric in scope_metrics.get("metrics", []):
                    data = metric.get("gauge") or metric.get("sum")
                    if not data:
                        continue
                    delta = data.get("aggregationTemporality") == "AGGREGATION_TEMPORALITY_DELTA"
                    for point in data.get("dataPoints", []):
                        value = point.get("asInt", point.get("asDouble"))
                        if value is None:
                            continue
                        yield Point(
                            metric=metric.get("name", ""),
                            scope=scope,
                            time=int(point.get("timeUnixNano", 0)),
                            start=int(point.get("startTimeUnixNano", 0)),
                            value=float(value),
                            attributes=attributes(point.get("attributes", [])),
                            delta=delta,
                        )
