"""Reads the OTLP JSON files back and prints what happened to the KV cache.

Works on any OTLP JSON lines file: the demo's own, or one written by the
collector's file exporter.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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


def _lines(path: Path) -> Iterator[dict]:
    if path.exists():
        with open(path) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


def kv_spans(traces_path: Path) -> list[dict]:
    """Every ``vllm.kv_cache.request`` span: its trace id, attributes and event names."""
    spans = []
    for request in _lines(traces_path):
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
    for request in _lines(metrics_path):
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


@dataclass
class PoolSummary:
    limit: int
    peak_used: int
    peak_cached: int
    evictions: int
    preemptions: int
    allocation_stalls: int


def pool_summary(metrics_path: Path) -> PoolSummary:
    blocks = metric_points(metrics_path, names.BLOCKS)

    def peak(state: str) -> int:
        return int(max((p["value"] for p in blocks if p["attributes"].get(names.BLOCK_STATE) == state), default=0))

    def counter_total(name: str) -> int:
        # Cumulative sums: the latest point of each engine is its total.
        latest: dict = {}
        for point in metric_points(metrics_path, name):
            engine = point["attributes"].get(names.ENGINE_INDEX)
            if engine not in latest or point["time"] >= latest[engine]["time"]:
                latest[engine] = point
        return int(sum(p["value"] for p in latest.values()))

    limits = metric_points(metrics_path, names.BLOCKS_LIMIT)
    return PoolSummary(
        limit=int(max((p["value"] for p in limits), default=0)),
        peak_used=peak(names.BLOCK_STATE_USED),
        peak_cached=peak(names.BLOCK_STATE_CACHED),
        evictions=counter_total(names.EVICTIONS),
        preemptions=counter_total(names.PREEMPTIONS),
        allocation_stalls=counter_total(names.ALLOCATION_STALLS),
    )


TABLE_COLUMNS = ("request id", "scenario", "prompt", "prefix hit", "peak blocks", "preempted", "finish")


def request_rows(spans: list[dict], scenario_by_trace: dict[str, str] | None = None) -> list[tuple]:
    rows = []
    for span in spans:
        a = span["attributes"]
        rows.append(
            (
                a[names.REQUEST_ID],
                (scenario_by_trace or {}).get(span["trace_id"], "-"),
                a[names.INPUT_TOKENS],
                a[names.CACHE_READ_INPUT_TOKENS],
                a[names.BLOCKS_PEAK],
                a[names.PREEMPTIONS],
                a[names.FINISH_REASON],
            )
        )
    return rows


def format_table(rows: list[tuple], columns: tuple = TABLE_COLUMNS) -> str:
    cells = [tuple(str(c) for c in columns)] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_summary(summary: PoolSummary) -> str:
    return "\n".join(
        [
            f"pool: {summary.limit} blocks",
            f"  peak used blocks      {summary.peak_used}",
            f"  peak cached blocks    {summary.peak_cached}",
            f"  evictions             {summary.evictions}",
            f"  preemptions           {summary.preemptions}",
            f"  allocation stalls     {summary.allocation_stalls}",
        ]
    )
