"""OTLP JSON metrics read one export request at a time, as flat records (spans: ``otlp_json.spans``).

A report may be built from a collector's file exporter after a long load test,
with files of gigabytes: nothing here keeps more than the line being read.
``otlp_json.kv_spans`` and ``metric_points`` build lists for the gate and the
demo's table; the report folds each record into bounded aggregates instead.
``otlp_json.requests`` counts and skips a line that is not OTLP JSON: the rest of
the file still tells what happened.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.proto.metrics.v1.metrics_pb2 import AGGREGATION_TEMPORALITY_DELTA

from otel_kvcache.commands.otlp_json import LineCount, attributes, metrics, number


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
    for scope, metric in metrics(path, count):
        kind = metric.WhichOneof("data")
        if kind not in ("gauge", "sum"):
            continue
        data = getattr(metric, kind)
        delta = kind == "sum" and data.aggregation_temporality == AGGREGATION_TEMPORALITY_DELTA
        for point in data.data_points:
            value = number(point)
            if value is None:
                continue
            yield Point(
                metric=metric.name,
                scope=scope,
                time=point.time_unix_nano,
                start=point.start_time_unix_nano,
                value=float(value),
                attributes=attributes(point.attributes),
                delta=delta,
            )
