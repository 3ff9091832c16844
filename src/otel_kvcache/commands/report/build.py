"""From an OTLP directory to the report's HTML: read each file once, then draw.

Memory does not grow with the files: each is read a line (one export request)
at a time and folded into aggregates of fixed size (``trace_digest``,
``metric_digest``). What the report holds is what those aggregates hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from otel_kvcache import names
from otel_kvcache.commands.report import holder_charts, page, pool_charts, request_charts
from otel_kvcache.commands.report.chart_style import TimeBase
from otel_kvcache.commands.report.metric_digest import read_metrics
from otel_kvcache.commands.report.summary import Summary, summarize
from otel_kvcache.commands.report.trace_digest import read_traces

TRACES, METRICS = "traces.jsonl", "metrics.jsonl"


class NothingToReport(Exception):
    """The directory holds no otel-kvcache telemetry; the message says what it holds."""


@dataclass
class Report:
    html: str
    summary: Summary


def _size(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.1f} MB" if path.is_file() else "absent"


def build(otlp_dir: Path) -> Report:
    otlp_dir = Path(otlp_dir)
    if not otlp_dir.is_dir():
        raise NothingToReport(f"{otlp_dir} is not a directory")
    traces_path, metrics_path = otlp_dir / TRACES, otlp_dir / METRICS
    if not traces_path.is_file() and not metrics_path.is_file():
        raise NothingToReport(
            f"{otlp_dir} has neither {TRACES} nor {METRICS} (OTLP JSON lines, as scripts/demo.sh "
            "or the collector's file exporter in collector-config/local-files.yaml write them)"
        )
    traces, metrics = read_traces(traces_path), read_metrics(metrics_path)
    if not traces.requests and not metrics.ours:
        held = traces.lines.requests + metrics.lines.requests
        raise NothingToReport(
            f"{otlp_dir} holds no otel-kvcache telemetry: {held} OTLP export requests, "
            f"{traces.lines.skipped + metrics.lines.skipped} lines that are not OTLP JSON, "
            f"no {names.KV_REQUEST_SPAN} span and no metric of the {names.METER_SCOPE} meter"
        )
    times = [t for r in (traces.times, metrics.times) for t in (r.first, r.last) if t]
    base = TimeBase(min(times), max(times))
    figures = [
        pool_charts.composition(metrics, traces, base),
        pool_charts.device_memory(metrics, base),
        pool_charts.offload_tier(metrics, base),
        holder_charts.holders(metrics, base),
        request_charts.timeline(traces, base),
        holder_charts.session_gaps(traces),
        request_charts.distributions(traces),
        pool_charts.what_if(metrics.projected),
        pool_charts.tier_what_if(metrics),
    ]
    summary = summarize(metrics, traces)
    source = f"{otlp_dir}: {TRACES} {_size(traces_path)}, {METRICS} {_size(metrics_path)}"
    notes = []
    skipped = traces.lines.skipped + metrics.lines.skipped
    if skipped:
        notes.append(f"{skipped} lines were not OTLP JSON and were skipped (a file cut mid-write ends in one).")
    html = page.render(summary, [f for f in figures if f is not None], source, notes)
    return Report(html, summary)


def write(otlp_dir: Path, output: Path) -> Report:
    """Builds the report and writes it to ``output`` (its folder made if need be)."""
    report = build(otlp_dir)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report.html, encoding="utf-8")
    return report
