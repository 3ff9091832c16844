"""The numbers at the top of the report, and the leak gate's verdict on the same files.

The pool's totals are defined as the main job's printed table defines them
(``demo/report.py``: the largest limit and peaks seen, each counter's last
value summed over engines), so the two agree on the same files; the verdict is
``gate.evaluate`` on the readings ``gate.readings_from_otlp`` would take.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from otel_kvcache import names
from otel_kvcache.commands import gate
from otel_kvcache.commands.report.metric_digest import MetricDigest
from otel_kvcache.commands.report.trace_digest import TraceDigest


@dataclass
class Summary:
    requests: int
    preempted_requests: int
    preemptions: int
    allocation_stalls: int
    evictions: int
    leak_findings: int
    prefix_cache_hit_ratio: float | None
    """Hit tokens over looked-up tokens (``vllm.kv_cache.prefix_cache.hits`` / ``queries``)."""
    pool_blocks: int
    peak_used_blocks: int
    peak_cached_blocks: int
    finish_reasons: dict[str, int]
    leak_gate: str
    """PASS, FAIL, or NO DATA when the metrics hold no leak gauges."""
    leak_gate_problems: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def leak_gate(metrics: MetricDigest) -> tuple[str, list[str]]:
    """The gate's verdict with its default tolerances, as ``otel-kvcache-gate`` gives it."""
    if not any(metrics.gate_readings.values()):
        return "NO DATA", ["no otel-kvcache leak metrics found in the telemetry"]
    problems = gate.evaluate(metrics.gate_readings, gate.Tolerances())
    return ("FAIL" if problems else "PASS"), problems


def _counted(metrics: MetricDigest, counter: str, on_spans: int) -> int:
    """The counter's total; without the counter (a traces-only directory), the spans' sum."""
    return int(metrics.total(counter)) if counter in metrics.counters else on_spans


def summarize(metrics: MetricDigest, traces: TraceDigest) -> Summary:
    queries = metrics.total(names.PREFIX_CACHE_QUERIES)
    verdict, problems = leak_gate(metrics)
    return Summary(
        requests=traces.requests,
        preempted_requests=traces.preempted_requests,
        preemptions=_counted(metrics, names.PREEMPTIONS, traces.preemptions_on_spans),
        allocation_stalls=_counted(metrics, names.ALLOCATION_STALLS, traces.stalls_on_spans),
        evictions=int(metrics.total(names.EVICTIONS)),
        leak_findings=traces.leak_findings,
        prefix_cache_hit_ratio=metrics.total(names.PREFIX_CACHE_HITS) / queries if queries else None,
        pool_blocks=int(metrics.limit),
        peak_used_blocks=int(metrics.peak_used),
        peak_cached_blocks=int(metrics.peak_cached),
        finish_reasons=dict(sorted(traces.finish_reasons.items())),
        leak_gate=verdict,
        leak_gate_problems=problems,
    )
