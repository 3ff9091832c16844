"""The leak gate for CI and load tests: fail when the exported telemetry shows KV leaks.

    otel-kvcache-gate --otlp-dir out/otlp            # OTLP JSON lines (metrics.jsonl, traces.jsonl)
    otel-kvcache-gate --prometheus http://host:9464/metrics

Exits 1, naming the leak, when an engine's last reading shows more orphaned
blocks or zombie requests than tolerated, or a larger tail-slack ratio; 0 otherwise.
With ``--min-projected-hit-gain X`` it also fails a load test whose pool is too
small for its traffic: when doubling the pool would have raised the prefix-cache
hit ratio by more than X (0.05: five points), by the what-if curve.
"""

from __future__ import annotations

import http.client
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from otel_kvcache import names
from otel_kvcache.commands import prometheus_names
from otel_kvcache.commands.command_line import CommandLine, existing_directory, http_url
from otel_kvcache.commands.otlp_json import latest_per_engine, metric_points, span_events

CHECKED = (names.ORPHANED_BLOCKS, names.ZOMBIE_REQUESTS, names.TAIL_SLACK_RATIO)


@dataclass
class Tolerances:
    orphaned_blocks: int = 0
    zombie_requests: int = 0
    tail_slack_ratio: float = 0.5
    projected_hit_gain: float | None = None
    """The most that doubling the pool may add to the hit ratio; None: not checked."""


def readings_from_otlp(directory: Path) -> dict[str, dict]:
    """metric -> {engine index: last value}."""
    metrics = directory / "metrics.jsonl"
    return {
        name: {engine: point["value"] for engine, point in latest_per_engine(metric_points(metrics, name)).items()}
        for name in CHECKED
    }


def prometheus_samples(text: str) -> Iterator[Sample]:
    """Every sample of a Prometheus text exposition, its label values unescaped."""
    for family in text_string_to_metric_families(text):
        yield from family.samples


def readings_from_prometheus(text: str) -> dict[str, dict]:
    readings: dict[str, dict] = {name: {} for name in CHECKED}
    wanted = {prometheus_names.metric(name): name for name in CHECKED}
    engine_label = prometheus_names.label(names.ENGINE_INDEX)
    for sample in prometheus_samples(text):
        if sample.name in wanted:
            readings[wanted[sample.name]][sample.labels.get(engine_label, "0")] = sample.value
    return readings


def hit_gains(latest_ratios: dict[tuple[str, float], float]) -> dict[str, float]:
    """Engine -> what doubling its pool would add to its hit ratio, from the last
    ``PROJECTED_HIT_RATIO`` reading at each (engine, scale)."""
    return {
        engine: latest_ratios[engine, 2.0] - latest_ratios[engine, 1.0]
        for engine, scale in latest_ratios
        if scale == 1.0 and (engine, 2.0) in latest_ratios
    }


def hit_gains_from_otlp(directory: Path) -> dict[str, float]:
    latest: dict[tuple[str, float], dict] = {}
    for point in metric_points(directory / "metrics.jsonl", names.PROJECTED_HIT_RATIO):
        key = (str(point["attributes"].get(names.ENGINE_INDEX)), float(point["attributes"][names.POOL_SCALE]))
        if key not in latest or point["time"] >= latest[key]["time"]:
            latest[key] = point
    return hit_gains({key: point["value"] for key, point in latest.items()})


def hit_gains_from_prometheus(text: str) -> dict[str, float]:
    wanted, latest = prometheus_names.metric(names.PROJECTED_HIT_RATIO), {}
    engine_label, scale_label = prometheus_names.label(names.ENGINE_INDEX), prometheus_names.label(names.POOL_SCALE)
    for sample in prometheus_samples(text):
        if sample.name == wanted:
            latest[sample.labels.get(engine_label, "0"), float(sample.labels[scale_label])] = sample.value
    return hit_gains(latest)


def named_leaks(traces: Path) -> list[str]:
    """Request ids the findings named, with what was found."""
    found = span_events(traces, {names.EVENT_LEAK, names.EVENT_ZOMBIE})
    described = {f"{a.get(names.REQUEST_ID, '?')} ({event}, {a.get(names.BLOCKS, '?')} blocks)" for event, a in found}
    return sorted(described)


def evaluate(readings: dict[str, dict], tolerances: Tolerances, gains: dict[str, float] | None = None) -> list[str]:
    problems = []
    for name, tolerance, what in (
        (names.ORPHANED_BLOCKS, tolerances.orphaned_blocks, "orphaned blocks"),
        (names.ZOMBIE_REQUESTS, tolerances.zombie_requests, "zombie requests"),
        (names.TAIL_SLACK_RATIO, tolerances.tail_slack_ratio, "tail slack ratio"),
    ):
        for engine, value in sorted(readings.get(name, {}).items(), key=lambda item: str(item[0])):
            if value > tolerance:
                problems.append(f"engine {engine}: {what} {value:g} > tolerance {tolerance:g}")
    if tolerances.projected_hit_gain is not None:
        for engine, gain in sorted((gains or {}).items()):
            if gain > tolerances.projected_hit_gain:
                problems.append(
                    f"engine {engine}: doubling the pool would gain {gain:.3f} of hit ratio "
                    f"> tolerance {tolerances.projected_hit_gain:g} (the pool is too small for this traffic)"
                )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = CommandLine(prog="otel-kvcache-gate", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--otlp-dir", type=existing_directory, help="directory with metrics.jsonl (and traces.jsonl)")
    source.add_argument("--prometheus", type=http_url, help="URL of a Prometheus exposition of these metrics")
    parser.add_argument("--max-orphaned-blocks", type=int, default=0)
    parser.add_argument("--max-zombie-requests", type=int, default=0)
    parser.add_argument("--max-tail-slack-ratio", type=float, default=0.5)
    parser.add_argument(
        "--min-projected-hit-gain",
        type=float,
        metavar="X",
        help="fail if doubling the pool would raise the prefix-cache hit ratio by more than X (0.05: 5 points)",
    )
    args = parser.parse_args(argv)
    tolerances = Tolerances(
        args.max_orphaned_blocks, args.max_zombie_requests, args.max_tail_slack_ratio, args.min_projected_hit_gain
    )

    if args.otlp_dir:
        readings, gains = readings_from_otlp(args.otlp_dir), hit_gains_from_otlp(args.otlp_dir)
    else:
        try:
            with urllib.request.urlopen(args.prometheus, timeout=30) as response:
                text = response.read().decode()
            readings, gains = readings_from_prometheus(text), hit_gains_from_prometheus(text)
        # Unreachable, refused, not a URL, not a Prometheus exposition.
        except (OSError, ValueError, http.client.HTTPException) as exc:
            print(f"otel-kvcache gate: FAIL: cannot read {args.prometheus}: {exc}", file=sys.stderr)
            return 2
    if not any(readings.values()):
        print("otel-kvcache gate: FAIL: no otel-kvcache leak metrics found in the telemetry", file=sys.stderr)
        return 2
    if tolerances.projected_hit_gain is not None and not gains:
        print("otel-kvcache gate: FAIL: no projected hit ratios (vllm.kv_cache.prefix_cache.projected_hit_ratio) "
              "found for --min-projected-hit-gain", file=sys.stderr)  # fmt: skip
        return 2
    problems = evaluate(readings, tolerances, gains)
    if not problems:
        print("otel-kvcache gate: PASS: no orphaned blocks or zombie requests beyond tolerance")
        return 0
    leaks = [problem for problem in problems if "doubling the pool" not in problem]
    verdict = "KV-cache leak" if leaks else "the KV pool is too small for this traffic"
    print(f"otel-kvcache gate: FAIL: {verdict}", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    if args.otlp_dir:
        for leak in named_leaks(args.otlp_dir / "traces.jsonl"):
            print(f"  request {leak}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
