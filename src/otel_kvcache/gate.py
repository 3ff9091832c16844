"""The leak gate for CI and load tests: fail when the exported telemetry shows KV leaks.

    otel-kvcache-gate --otlp-dir out/otlp            # OTLP JSON lines (metrics.jsonl, traces.jsonl)
    otel-kvcache-gate --prometheus http://host:9464/metrics

Exits 1, naming the leak, when an engine's last reading shows more orphaned
blocks or zombie requests than tolerated, or a larger tail-slack ratio; 0 otherwise.
"""

from __future__ import annotations

import argparse
import re
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from otel_kvcache import names
from otel_kvcache.otlp_json import latest_per_engine, metric_points, span_events

CHECKED = (names.ORPHANED_BLOCKS, names.ZOMBIE_REQUESTS, names.TAIL_SLACK_RATIO)


@dataclass
class Tolerances:
    orphaned_blocks: int = 0
    zombie_requests: int = 0
    tail_slack_ratio: float = 0.5


def readings_from_otlp(directory: Path) -> dict[str, dict]:
    """metric -> {engine index: last value}."""
    metrics = directory / "metrics.jsonl"
    return {
        name: {engine: point["value"] for engine, point in latest_per_engine(metric_points(metrics, name)).items()}
        for name in CHECKED
    }


def prometheus_name(name: str) -> str:
    """The name the OpenTelemetry Prometheus exporter gives a metric (annotation units drop)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def readings_from_prometheus(text: str) -> dict[str, dict]:
    readings: dict[str, dict] = {name: {} for name in CHECKED}
    wanted = {prometheus_name(name): name for name in CHECKED}
    engine_label = prometheus_name(names.ENGINE_INDEX)
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not match or match.group(1) not in wanted:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        readings[wanted[match.group(1)]][labels.get(engine_label, "0")] = float(match.group(3))
    return readings


def named_leaks(traces: Path) -> list[str]:
    """Request ids the findings named, with what was found."""
    found = span_events(traces, {names.EVENT_LEAK, names.EVENT_ZOMBIE})
    described = {f"{a.get(names.REQUEST_ID, '?')} ({event}, {a.get(names.BLOCKS, '?')} blocks)" for event, a in found}
    return sorted(described)


def evaluate(readings: dict[str, dict], tolerances: Tolerances) -> list[str]:
    problems = []
    for name, tolerance, what in (
        (names.ORPHANED_BLOCKS, tolerances.orphaned_blocks, "orphaned blocks"),
        (names.ZOMBIE_REQUESTS, tolerances.zombie_requests, "zombie requests"),
        (names.TAIL_SLACK_RATIO, tolerances.tail_slack_ratio, "tail slack ratio"),
    ):
        for engine, value in sorted(readings.get(name, {}).items(), key=lambda item: str(item[0])):
            if value > tolerance:
                problems.append(f"engine {engine}: {what} {value:g} > tolerance {tolerance:g}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="otel-kvcache-gate", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--otlp-dir", type=Path, help="directory with metrics.jsonl (and traces.jsonl)")
    source.add_argument("--prometheus", help="URL of a Prometheus exposition of these metrics")
    parser.add_argument("--max-orphaned-blocks", type=int, default=0)
    parser.add_argument("--max-zombie-requests", type=int, default=0)
    parser.add_argument("--max-tail-slack-ratio", type=float, default=0.5)
    args = parser.parse_args(argv)
    tolerances = Tolerances(args.max_orphaned_blocks, args.max_zombie_requests, args.max_tail_slack_ratio)

    if args.otlp_dir:
        readings = readings_from_otlp(args.otlp_dir)
    else:
        with urllib.request.urlopen(args.prometheus, timeout=30) as response:
            readings = readings_from_prometheus(response.read().decode())
    if not any(readings.values()):
        print("otel-kvcache gate: FAIL: no otel-kvcache leak metrics found in the telemetry", file=sys.stderr)
        return 2
    problems = evaluate(readings, tolerances)
    if not problems:
        print("otel-kvcache gate: PASS: no orphaned blocks or zombie requests beyond tolerance")
        return 0
    print("otel-kvcache gate: FAIL: KV-cache leak", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    if args.otlp_dir:
        for leak in named_leaks(args.otlp_dir / "traces.jsonl"):
            print(f"  request {leak}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
