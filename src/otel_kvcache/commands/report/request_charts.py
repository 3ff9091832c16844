"""The requests: one row each on the time axis, and how they were distributed.

A row is a request's ``vllm.kv_cache.request`` span cut at its events: waiting
for its first blocks (grey), holding blocks (coloured by finish reason),
preempted with none (red, dashed) until it resumed. Hovering shows its blocks,
prefix-hit tokens and trace id; clicking puts the trace id in the box above
the chart, selected, to paste into a trace viewer.
"""

from __future__ import annotations

import altair as alt

from otel_kvcache import names
from otel_kvcache.commands.report.chart_style import MARK_COLOURS, WIDTH, Figure, TimeBase, finish_scale, time_title, y_axis
from otel_kvcache.commands.report.trace_digest import RequestRow, TraceDigest

WAITING, HOLDING, PREEMPTED = "waiting for blocks", "holding blocks", "preempted"
LABELLED_ROWS = 60
"""Above this many rows, request ids no longer fit beside them: they stay in the tooltips."""


def phases(row: RequestRow) -> list[tuple[str, int, int, int | None, int | None]]:
    """(phase, start, end, blocks, prefix-hit tokens) of a request, cut at its KV events."""
    cut: list[tuple[str, int, int, int | None, int | None]] = []
    phase, since, blocks, hit = WAITING, row.start, None, None
    for event in row.events:
        if event.name in (names.EVENT_ADMITTED, names.EVENT_RESUMED):
            cut.append((phase, since, event.time, blocks, hit))
            phase, since, blocks, hit = HOLDING, event.time, event.blocks, event.prefix_hit_tokens
        elif event.name == names.EVENT_PREEMPTED:
            cut.append((phase, since, event.time, blocks, hit))
            phase, since, blocks, hit = PREEMPTED, event.time, event.blocks, None
        elif event.name == names.EVENT_RELEASED:
            cut.append((phase, since, event.time, blocks, hit))
            phase, since = None, event.time
    if phase is not None and row.end > since:
        cut.append((phase, since, row.end, blocks, hit))
    return [segment for segment in cut if segment[2] > segment[1] or segment[0] != WAITING]


def timeline_rows(traces: TraceDigest, base: TimeBase) -> list[dict]:
    rows = sorted(traces.sample.rows(), key=lambda r: (r.start, r.request_id))
    return [
        {
            "row": index,
            "request": row.request_id,
            "trace_id": row.trace_id,
            "finish": row.finish,
            "phase": phase,
            "from": base.seconds(start),
            "to": base.seconds(end),
            "seconds": round((end - start) / 1e9, 4),
            "blocks": blocks,
            "prefix_hit_tokens": hit,
            "prompt_tokens": row.input_tokens,
            "cached_tokens": row.cached_tokens,
            "peak_blocks": row.peak_blocks,
            "preemptions": row.preemptions,
            "stalls": row.stalls,
        }
        for index, row in enumerate(rows)
        for phase, start, end, blocks, hit in phases(row)
    ]


TOOLTIP = [
    alt.Tooltip("request:N", title="request id"),
    alt.Tooltip("trace_id:N", title="trace id (click to copy)"),
    "phase:N",
    alt.Tooltip("from:Q", title="from s"),
    alt.Tooltip("seconds:Q", title="for s"),
    alt.Tooltip("blocks:Q", title="blocks"),
    alt.Tooltip("prefix_hit_tokens:Q", title="prefix-hit tokens (this admission)"),
    alt.Tooltip("prompt_tokens:Q", title="prompt tokens"),
    alt.Tooltip("cached_tokens:Q", title="prefix-hit tokens (all admissions)"),
    alt.Tooltip("peak_blocks:Q", title="peak blocks"),
    "preemptions:Q",
    alt.Tooltip("stalls:Q", title="allocation stalls"),
    "finish:N",
]


def timeline(traces: TraceDigest, base: TimeBase) -> Figure | None:
    rows = timeline_rows(traces, base)
    if not rows:
        return None
    count = len({r["row"] for r in rows})
    step = max(3, min(16, 720 // count))
    labelled = count <= LABELLED_ROWS
    y = alt.Y(
        "request:N",
        sort=alt.EncodingSortField("row", op="min"),
        title=f"{count} requests, by arrival",
        axis=alt.Axis(**y_axis(labels=labelled, ticks=labelled, labelLimit=190, labelFontSize=10)),
    )
    x = alt.X("from:Q", scale=alt.Scale(domain=base.domain, nice=False), title=time_title(base))
    domain, colours = finish_scale(r["finish"] for r in rows)
    base_chart = alt.Chart(alt.NamedData("requests")).encode(x=x, x2="to:Q", y=y, tooltip=TOOLTIP)
    waiting = base_chart.transform_filter(alt.datum.phase == WAITING).mark_rule(color="#9a9a9a", strokeWidth=1)
    holding = base_chart.transform_filter(alt.datum.phase == HOLDING).mark_bar(height={"band": 0.8}).encode(
        color=alt.Color(
            "finish:N", scale=alt.Scale(domain=domain, range=colours), legend=alt.Legend(title="finish", orient="top")
        )
    )
    preempted = base_chart.transform_filter(alt.datum.phase == PREEMPTED).mark_rule(
        color=MARK_COLOURS["preemptions"], strokeWidth=2, strokeDash=[3, 2]
    )
    chart = alt.layer(waiting, holding, preempted).properties(width=WIDTH, height=alt.Step(step))
    note = (
        f"Rows: {traces.sample.rule()}, sorted by arrival. Grey: waiting for first blocks; coloured: holding "
        "blocks (by finish reason); red dashes: preempted, holding none."
    )
    return Figure("timeline", "Requests", note, chart, {"requests": rows})


def _histogram(name: str, title: str, x_title: str, bin_spec: alt.Bin, whole: bool = True) -> alt.Chart:
    return (
        alt.Chart(alt.NamedData(name), title=title)
        .mark_bar(color="#4c78a8")
        .encode(
            x=alt.X("value:Q", bin=bin_spec, title=x_title, axis=alt.Axis(format="d" if whole else ".0%")),
            y=alt.Y("sum(count):Q", title="requests"),
            tooltip=[
                alt.Tooltip("value:Q", bin=bin_spec, title=x_title),
                alt.Tooltip("sum(count):Q", title="requests"),
            ],
        )
        .properties(width=290, height=180)
    )


def _counts(counter, scale: float = 1.0) -> list[dict]:
    return [{"value": value * scale, "count": count} for value, count in sorted(counter.items())]


def distributions(traces: TraceDigest) -> Figure | None:
    if not traces.requests:
        return None
    peaks, hits, preemptions = (
        _counts(traces.peak_blocks),
        _counts(traces.hit_ratio_percent, 0.01),
        _counts(traces.preemptions),
    )
    top = max(traces.preemptions)
    chart = alt.hconcat(
        _histogram("peak_blocks", "Peak blocks per request", "blocks", alt.Bin(maxbins=30, minstep=1)),
        _histogram("prefix_hit_ratio", "Prefix-hit ratio", "hit tokens / prompt tokens",
                   alt.Bin(extent=[0, 1.05], step=0.05), whole=False),
        _histogram("preemptions", "Preemptions per request", "preemptions",
                   alt.Bin(step=max(1, (top + 1) // 20), extent=[0, top + 1])),
    )  # fmt: skip
    note = f"Every request span ({traces.requests}), not only the timeline's rows."
    return Figure(
        "distributions", "Distributions", note, chart,
        {"peak_blocks": peaks, "prefix_hit_ratio": hits, "preemptions": preemptions},
    )  # fmt: skip
