"""Who holds the KV cache, and whether sessions find their context again.

The first figure answers the article's second question by the attribution
series (``OTEL_KVCACHE_ATTRIBUTION``: model or adapter, priority, tenant): the
blocks each held over time (``vllm.kv_cache.held_blocks``, a shared block split
between its holders, so the areas stack up to the used blocks) and what each
cost over the run (``vllm.kv_cache.occupancy``, block-seconds). The second
draws each returning session request's gap since its previous turn, coloured by
whether its prefix was still cached, from the spans: where the colours change
is the gap beyond which sessions lose their context.
"""

from __future__ import annotations

import math

import altair as alt

from otel_kvcache.commands.report.chart_style import WIDTH, Figure, TimeBase, time_title, y_axis
from otel_kvcache.commands.report.metric_digest import MetricDigest
from otel_kvcache.commands.report.trace_digest import GAP_BOUNDS, TraceDigest

KEPT_COLOURS = {"prefix kept": "#54a24b", "prefix evicted": "#d62728"}


def held_rows(metrics: MetricDigest, base: TimeBase) -> list[dict]:
    """Each series at each reading of the pool or of any series: 0 where it held nothing
    (a gauge series without live requests has no point then)."""
    readings = {label: {time: blocks for _, _, (time, blocks) in buckets} for label, buckets in metrics.held.items()}
    times = {time for series in readings.values() for time in series}
    times |= {reading.time for buckets in metrics.pool.values() for _, _, reading in buckets}
    return [
        {"t": base.seconds(time), "holder": label, "blocks": series.get(time, 0)}
        for label, series in sorted(readings.items())
        for time in sorted(times)
    ]


def occupancy_rows(metrics: MetricDigest) -> list[dict]:
    totals = metrics.occupancy_totals()
    return [{"holder": label, "block_seconds": round(seconds, 3)} for label, seconds in sorted(totals.items())]


def holders(metrics: MetricDigest, base: TimeBase) -> Figure | None:
    held, cost = held_rows(metrics, base), occupancy_rows(metrics)
    if not held and not cost:
        return None
    colour = alt.Color("holder:N", legend=alt.Legend(title=metrics.holder_names or None, orient="top", labelLimit=400, titleLimit=400))
    over_time = (
        alt.Chart(alt.NamedData("held"), title="Blocks held now (a shared block split between its holders)")
        .mark_area(interpolate="step-after", opacity=0.85)
        .encode(
            x=alt.X("t:Q", scale=alt.Scale(domain=base.domain, nice=False), title=time_title(base)),
            y=alt.Y("blocks:Q", stack="zero", title="blocks", axis=alt.Axis(**y_axis())),
            color=colour,
            tooltip=["holder:N", "t:Q", alt.Tooltip("blocks:Q", format=".2f")],
        )
        .properties(width=WIDTH, height=200)
    )
    totals = (
        alt.Chart(alt.NamedData("occupancy"), title="What each held over the run (block-seconds)")
        .mark_bar()
        .encode(
            y=alt.Y("holder:N", title=None, axis=alt.Axis(**y_axis(labelLimit=190))),
            x=alt.X("block_seconds:Q", title="block-seconds"),
            color=colour,
            tooltip=["holder:N", alt.Tooltip("block_seconds:Q", format=".1f")],
        )
        .properties(width=WIDTH, height=alt.Step(18))
    )
    note = (
        "By vllm.kv_cache.held_blocks and vllm.kv_cache.occupancy, broken down as OTEL_KVCACHE_ATTRIBUTION "
        "says (default: gen_ai.request.model, the model or LoRA adapter)."
    )
    return Figure("holders", "Who holds the KV cache", note, alt.vconcat(over_time, totals),
                  {"held": held, "occupancy": cost})  # fmt: skip


def gap_rows(traces: TraceDigest) -> list[dict]:
    labels = {bound: f"≤ {bound:g} s" for bound in GAP_BOUNDS} | {math.inf: f"> {GAP_BOUNDS[-1]:g} s"}
    order = {bound: index for index, bound in enumerate((*GAP_BOUNDS, math.inf))}
    return [
        {"gap": labels[bound], "order": order[bound], "kept": "prefix kept" if kept else "prefix evicted",
         "requests": count}
        for (bound, kept), count in sorted(traces.turn_gaps.items(), key=lambda item: order[item[0][0]])
    ]  # fmt: skip


def session_gaps(traces: TraceDigest) -> Figure | None:
    rows = gap_rows(traces)
    if not rows:
        return None
    chart = (
        alt.Chart(alt.NamedData("turn_gaps"))
        .mark_bar()
        .encode(
            x=alt.X("gap:O", sort=alt.EncodingSortField("order"), title="gap since the session's previous turn",
                    axis=alt.Axis(labelAngle=0)),
            y=alt.Y("requests:Q", stack="zero", title="returning session requests"),
            color=alt.Color("kept:N", scale=alt.Scale(domain=list(KEPT_COLOURS), range=list(KEPT_COLOURS.values())),
                            legend=alt.Legend(title=None, orient="top")),
            tooltip=["gap:O", "kept:N", "requests:Q"],
        )
        .properties(width=WIDTH // 2, height=200)
    )  # fmt: skip
    note = (
        "Each request of a session this engine had seen (session.id), by vllm.kv_cache.session.turn_gap; "
        "red: some of its prompt had been evicted from the prefix cache in between."
    )
    return Figure("session_gaps", "Do sessions find their context again?", note, chart, {"turn_gaps": rows})
