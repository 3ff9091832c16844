"""Reads the OTLP JSON files back and prints what happened to the KV cache.

Works on any OTLP JSON lines file: the demo's own, or one written by the
collector's file exporter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from otel_kvcache import names
from otel_kvcache.commands.otlp_json import kv_spans, latest_per_engine, metric_points
from otel_kvcache.commands.report.metric_digest import read_metrics

TENANT = "tenant.id"
"""The baggage entry the main job's clients name their tenant by (``demo/load.py``)."""

__all__ = [
    "kv_spans",
    "pool_summary",
    "request_rows",
    "format_table",
    "format_summary",
    "projected_curve",
    "format_curve",
    "holders_summary",
    "format_holders",
]


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
        return int(sum(p["value"] for p in latest_per_engine(metric_points(metrics_path, name)).values()))

    limits = metric_points(metrics_path, names.BLOCKS_LIMIT)
    return PoolSummary(
        limit=int(max((p["value"] for p in limits), default=0)),
        peak_used=peak(names.BLOCK_STATE_USED),
        peak_cached=peak(names.BLOCK_STATE_CACHED),
        evictions=counter_total(names.EVICTIONS),
        preemptions=counter_total(names.PREEMPTIONS),
        allocation_stalls=counter_total(names.ALLOCATION_STALLS),
    )


TABLE_COLUMNS = ("request id", "scenario", "model", "tenant", "session", "gap s", "prompt",
                 "prefix hit (all admissions)", "peak blocks", "block-s", "preempted", "finish")  # fmt: skip


def request_rows(spans: list[dict], scenario_by_trace: dict[str, str] | None = None) -> list[tuple]:
    rows = []
    for span in sorted(spans, key=lambda span: span["start"]):
        a = span["attributes"]
        gap = a.get(names.SESSION_TURN_GAP)
        rows.append(
            (
                a[names.REQUEST_ID],
                (scenario_by_trace or {}).get(span["trace_id"], "-"),
                a.get(names.MODEL, "-"),
                a.get(TENANT, "-"),
                a.get(names.SESSION_ID, "-"),
                "-" if gap is None else f"{gap:.1f}",
                a[names.INPUT_TOKENS],
                a[names.CACHE_READ_INPUT_TOKENS],
                a[names.BLOCKS_PEAK],
                f"{a.get(names.OCCUPANCY, 0):.1f}",
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


@dataclass
class Holder:
    label: str
    block_seconds: float
    peak_held: float


@dataclass
class HoldersSummary:
    holders: list[Holder]
    labelled_by: str
    """The attributes each holder's label gives the values of."""
    returning: int
    """Requests of a session seen before on their engine."""
    kept: int
    """Of those, the ones none of whose prompt had been evicted from the prefix cache."""
    gaps: list[float]


def holders_summary(metrics_path: Path, spans: list[dict]) -> HoldersSummary:
    """Block-seconds and peak blocks held by attribution series, as the report reads them
    (``metric_digest``); sessions' turn gaps."""
    digest = read_metrics(metrics_path)
    seconds = digest.occupancy_totals()
    peaks = {label: max(blocks for _, _, (_, blocks) in buckets) for label, buckets in digest.held.items()}
    returning = [s["attributes"] for s in spans if names.SESSION_TURN_GAP in s["attributes"]]
    return HoldersSummary(
        holders=[Holder(label, seconds.get(label, 0.0), peaks.get(label, 0.0))
                 for label in sorted(set(seconds) | set(peaks), key=lambda label: -seconds.get(label, 0.0))],
        labelled_by=digest.holder_names,
        returning=len(returning),
        kept=sum(1 for a in returning if not a.get(names.PREFIX_EVICTED_TOKENS)),
        gaps=sorted(a[names.SESSION_TURN_GAP] for a in returning),
    )  # fmt: skip


def format_holders(summary: HoldersSummary) -> str:
    lines = ["who holds the KV cache (vllm.kv_cache.occupancy, vllm.kv_cache.held_blocks):"]
    title = f"{summary.labelled_by or 'holder'}"
    width = max([len(title), *(len(h.label) for h in summary.holders)])
    lines.append(f"  {title.ljust(width)}  block-seconds  peak blocks held")
    for h in summary.holders:
        lines.append(f"  {h.label.ljust(width)}  {h.block_seconds:13.1f}  {h.peak_held:16.1f}")
    if summary.returning:
        gaps = summary.gaps
        lines.append(
            f"sessions: {summary.returning} requests came back to a session "
            f"({gaps[0]:.1f}-{gaps[-1]:.1f} s after its previous turn); "
            f"{summary.kept} found their prefix still cached"
        )
    return "\n".join(lines)


def projected_curve(metrics_path: Path) -> tuple[dict[float, float], float | None]:
    """The last what-if reading: scale -> projected hit ratio, and the pool scale that
    fits the peak demand."""
    latest: dict[float, dict] = {}
    for point in metric_points(metrics_path, names.PROJECTED_HIT_RATIO):
        scale = float(point["attributes"][names.POOL_SCALE])
        if scale not in latest or point["time"] >= latest[scale]["time"]:
            latest[scale] = point
    fits = latest_per_engine(metric_points(metrics_path, names.PROJECTED_PREEMPTION_FREE_SCALE))
    free_scale = max((p["value"] for p in fits.values()), default=None)
    return {scale: point["value"] for scale, point in sorted(latest.items())}, free_scale


def format_curve(curve: dict[float, float], free_scale: float | None, measured: float | None) -> str:
    """``measured``: vLLM's own hit ratio (its /metrics), beside the projection at 1x, which
    also counts the lookups of preempted requests coming back (vLLM's ``PrefixCacheStats``
    keeps those apart, and its /metrics leaves them out)."""
    if not curve:
        return "what if the pool were larger: no prefix lookups were counted"
    lines = ["what if the pool were larger (vllm.kv_cache.prefix_cache.projected_hit_ratio, last 10 min):"]
    lines.append("  pool scale  projected hit ratio")
    for scale, ratio in curve.items():
        note = f"   (vLLM's /metrics, first admissions only: {measured:.3f})" if scale == 1.0 and measured else ""
        lines.append(f"  {scale:>9g}x  {ratio:.3f}{note}")
    if free_scale is not None:
        lines.append(f"  a pool {free_scale:.2f}x this one would have held the peak demand without preemptions")
    return "\n".join(lines)
