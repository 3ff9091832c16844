"""The pool over time: its composition, what happened to it, and the device beside it.

The stacked area is ``vllm.kv_cache.blocks`` by state, read about once a
second (less often when the engine is too busy to export; dots mark the
readings). The black line is the used blocks each KV event saw (admissions,
preemptions, releases), which fills in between those readings. Below it, on
the same axis, the moments of preemptions, allocation stalls and leak
findings; then NVML's device memory, the "flat nvidia-smi line" that says
nothing of the pool filling up.
"""

from __future__ import annotations

import altair as alt

from otel_kvcache import names
from otel_kvcache.commands.report.chart_style import (
    MARK_COLOURS,
    STATE_COLOURS,
    WIDTH,
    Figure,
    TimeBase,
    time_title,
    y_axis,
)
from otel_kvcache.commands.report.metric_digest import MARK_STALLS, MetricDigest, PoolReading
from otel_kvcache.commands.report.trace_digest import TraceDigest

GIB = 2**30


def combined_readings(metrics: MetricDigest) -> list[PoolReading]:
    """The pools of all engines summed, each engine's last reading carried forward."""
    series = [[reading for _, _, reading in buckets] for buckets in metrics.pool.values()]
    if len(series) == 1:
        return series[0]
    latest: dict[int, PoolReading] = {}
    combined = []
    for engine, reading in sorted(
        ((engine, reading) for engine, readings in enumerate(series) for reading in readings),
        key=lambda item: item[1].time,
    ):
        latest[engine] = reading
        combined.append(
            PoolReading(
                reading.time,
                used=sum(r.used for r in latest.values()),
                cached=sum(r.cached for r in latest.values()),
                free=sum(r.free for r in latest.values()),
            )
        )
    return combined


def pool_rows(metrics: MetricDigest, base: TimeBase) -> list[dict]:
    """Long form for the stacked area: one row per reading and state, used at the bottom."""
    return [
        {"t": base.seconds(reading.time), "state": state, "order": order, "blocks": getattr(reading, state)}
        for reading in combined_readings(metrics)
        for order, state in enumerate(names.BLOCK_STATES)
    ]


def event_rows(traces: TraceDigest, base: TimeBase) -> list[dict]:
    """Used blocks at each KV event; one engine only (the engines' events do not add up)."""
    if len(traces.used_at_events) != 1:
        return []
    [buckets] = traces.used_at_events.values()
    return [{"t": base.seconds(time), "used": used, "free": free} for _, _, (time, used, free) in buckets]


def mark_rows(metrics: MetricDigest, traces: TraceDigest, base: TimeBase) -> list[dict]:
    """Each bucket with preemptions, stalls or leak findings: when, what, how many."""
    series = dict(traces.marks)
    if len(metrics.stalls):
        series[MARK_STALLS] = metrics.stalls
    return [
        {
            "t": base.seconds((start + end) // 2),
            "from": base.seconds(start),
            "to": base.seconds(end),
            "kind": kind,
            "count": int(count),
        }
        for kind, buckets in series.items()
        for start, end, count in buckets
    ]


def _x(base: TimeBase, title: str | None = None) -> alt.X:
    return alt.X("t:Q", scale=alt.Scale(domain=base.domain, nice=False), title=title)


def _mark_colour(legend: bool = True) -> alt.Color:
    return alt.Color(
        "kind:N",
        scale=alt.Scale(domain=list(MARK_COLOURS), range=list(MARK_COLOURS.values())),
        legend=alt.Legend(title=None, orient="bottom") if legend else None,
    )


def composition(metrics: MetricDigest, traces: TraceDigest, base: TimeBase) -> Figure | None:
    pool, events, marks = pool_rows(metrics, base), event_rows(traces, base), mark_rows(metrics, traces, base)
    if not pool and not events:
        return None
    layers = []
    if pool:
        layers.append(
            alt.Chart(alt.NamedData("pool"))
            .mark_area(interpolate="step-after", opacity=1, point=alt.OverlayMarkDef(size=12, filled=True, opacity=1))
            .encode(
                x=_x(base, None if marks else time_title(base)),
                y=alt.Y("blocks:Q", stack="zero", title="blocks", axis=alt.Axis(**y_axis())),
                color=alt.Color(
                    "state:N",
                    scale=alt.Scale(domain=list(STATE_COLOURS), range=list(STATE_COLOURS.values())),
                    legend=alt.Legend(title="pool", orient="right"),
                ),
                order=alt.Order("order:Q"),
                tooltip=[alt.Tooltip("t:Q", title="s"), "state:N", "blocks:Q"],
            )
        )
    if events:
        layers.append(
            alt.Chart(alt.NamedData("events"))
            .mark_line(interpolate="step-after", color="black", strokeWidth=1, point=alt.OverlayMarkDef(size=8))
            .encode(
                x=_x(base),
                y=alt.Y("used:Q", title="blocks", axis=alt.Axis(**y_axis())),
                tooltip=[alt.Tooltip("t:Q", title="s"), alt.Tooltip("used:Q", title="used at a KV event"), "free:Q"],
            )
        )
    if marks:
        layers.append(
            alt.Chart(alt.NamedData("marks"))
            .mark_rule(opacity=0.6, strokeWidth=1.5)
            .encode(x=_x(base), color=_mark_colour(legend=False))
        )
    pool_chart = alt.layer(*layers).resolve_scale(color="independent").properties(width=WIDTH, height=260)
    chart = pool_chart
    if marks:
        strip = (
            alt.Chart(alt.NamedData("marks"))
            .mark_circle(opacity=0.8)
            .encode(
                x=_x(base, time_title(base)),
                y=alt.Y("kind:N", title=None, sort=list(MARK_COLOURS), axis=alt.Axis(**y_axis())),
                size=alt.Size("count:Q", legend=None, scale=alt.Scale(type="sqrt", zero=False, range=[30, 400])),
                color=_mark_colour(),
                tooltip=["kind:N", "count:Q", alt.Tooltip("from:Q", title="from s"), alt.Tooltip("to:Q", title="to s")],
            )
            .properties(width=WIDTH, height=80)
        )
        chart = alt.vconcat(pool_chart, strip, spacing=4).resolve_scale(x="shared", color="independent")
    engines = len(metrics.pool)
    note = (
        f"Stacked: {names.BLOCKS} by state (dots: its readings, held until the next)"
        + (f", {engines} engines summed" if engines > 1 else "")
        + ("; black line: used blocks at each KV event" if events else "")
        + ("; below: when preemptions, allocation stalls and leak findings happened" if marks else "")
        + "."
    )
    return Figure("pool", "The pool over time", note, chart, {"pool": pool, "events": events, "marks": marks})


def device_memory(metrics: MetricDigest, base: TimeBase) -> Figure | None:
    rows = [
        {"t": base.seconds(time), "gpu": device, "GiB": round(value / GIB, 3), "what": "in use"}
        for device, buckets in metrics.device_memory.items()
        for _, _, (time, value) in buckets
    ]
    if not rows:
        return None
    limits = [{"gpu": device, "GiB": round(value / GIB, 3)} for device, value in metrics.device_limit.items()]
    lines = (
        alt.Chart(alt.NamedData("device"))
        .mark_line(interpolate="step-after")
        .encode(
            x=_x(base, time_title(base)),
            y=alt.Y("GiB:Q", title="GiB (NVML)", axis=alt.Axis(**y_axis())),
            color=alt.Color("gpu:N", legend=alt.Legend(orient="right", title="hw.id")),
            tooltip=[alt.Tooltip("t:Q", title="s"), "gpu:N", "GiB:Q"],
        )
    )
    layers = [lines]
    if limits:
        layers.append(
            alt.Chart(alt.NamedData("device_limit"))
            .mark_rule(strokeDash=[4, 3])
            .encode(y="GiB:Q", color="gpu:N", tooltip=["gpu:N", alt.Tooltip("GiB:Q", title="limit GiB")])
        )
    chart = alt.layer(*layers).properties(width=WIDTH, height=140)
    note = f"{names.GPU_MEMORY_USAGE} per GPU (dashed: {names.GPU_MEMORY_LIMIT}): what nvidia-smi shows."
    return Figure("device", "Device memory beside it", note, chart, {"device": rows, "device_limit": limits})


def offload_tier(metrics: MetricDigest, base: TimeBase) -> Figure | None:
    """The offload tier's blocks over time, used and free, per engine and medium."""
    engines = {engine for engine, _, _ in metrics.tier}
    rows = [
        {"t": base.seconds(time), "tier": medium if len(engines) == 1 else f"engine {engine} {medium}",
         "state": state, "blocks": value}
        for (engine, medium, state), buckets in sorted(metrics.tier.items(), key=lambda item: str(item[0]))
        for _, _, (time, value) in buckets
    ]  # fmt: skip
    if not rows:
        return None
    chart = (
        alt.Chart(alt.NamedData("tier"))
        .mark_line(interpolate="step-after", point=True)
        .encode(
            x=_x(base, time_title(base)),
            y=alt.Y("blocks:Q", title="offload-tier blocks", axis=alt.Axis(**y_axis())),
            color=alt.Color("state:N", legend=alt.Legend(orient="right", title="state"), scale=alt.Scale(
                domain=[names.BLOCK_STATE_USED, names.BLOCK_STATE_FREE], range=[STATE_COLOURS["used"], "#8c8c8c"])),
            strokeDash=alt.StrokeDash("tier:N", legend=alt.Legend(orient="right", title="tier")),
            tooltip=[alt.Tooltip("t:Q", title="s"), "tier:N", "state:N", "blocks:Q"],
        )
        .properties(width=WIDTH, height=140)
    )  # fmt: skip
    note = (
        f"{names.OFFLOAD_BLOCKS} by state and {names.OFFLOAD_MEDIUM}: the host-memory tier of an offloading "
        "connector, its stores in flight counted as used."
    )
    return Figure("tier", "The offload tier over time", note, chart, {"tier": rows})


def what_if(projected: dict[tuple, tuple]) -> Figure | None:
    """The capacity what-if curve: the prefix-cache hit ratio a pool ``scale`` times as large would have had."""
    rows = [
        {"scale": scale, "ratio": value, "engine": str(engine)}
        for (engine, scale), (_, value) in sorted(projected.items(), key=lambda item: (str(item[0][0]), item[0][1]))
    ]
    if not rows:
        return None
    engines = len({r["engine"] for r in rows})
    curve = (
        alt.Chart(alt.NamedData("projected"))
        .mark_line(point=True)
        .encode(
            x=alt.X("scale:Q", scale=alt.Scale(type="log", base=2), title="pool size, times today's"),
            y=alt.Y("ratio:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%"), title="prefix-cache hits"),
            color=alt.Color("engine:N", legend=alt.Legend(title="engine") if engines > 1 else None),
            tooltip=["engine:N", alt.Tooltip("scale:Q", title="pool ×"), alt.Tooltip("ratio:Q", format=".1%")],
        )
    )
    today = alt.Chart(alt.NamedData("today")).mark_rule(strokeDash=[4, 3], color="#666").encode(x="scale:Q")
    chart = alt.layer(curve, today).properties(width=480, height=220)
    note = f"{names.PROJECTED_HIT_RATIO} by {names.POOL_SCALE}, each engine's latest reading; dashed: today's pool."
    data = {"projected": rows, "today": [{"scale": 1}]}
    return Figure("whatif", "What a bigger pool would have bought", note, chart, data)


def tier_what_if(metrics: MetricDigest) -> Figure | None:
    """The offload tier's what-if curve, in bytes: the hit ratio the GPU pool and a tier that large
    would have had together; on an engine with no tier, a first tier's."""
    engines = {engine for engine, _, _ in metrics.tier_projected}

    def label(engine: object, medium: str) -> str:
        tier = f"{medium} tier" if medium else "a first tier"
        return tier if len(engines) == 1 else f"engine {engine}, {tier}"

    rows, alone, today = [], [], []
    for (engine, medium, scale), (_, ratio) in sorted(metrics.tier_projected.items(), key=lambda item: str(item[0])):
        size = metrics.tier_projected_size.get((engine, medium, scale))
        if scale == 0.0:  # no tier: the GPU pool alone
            alone.append({"ratio": ratio, "tier": label(engine, medium)})
        elif size:
            rows.append({"GiB": size / 2**30, "ratio": ratio, "tier": label(engine, medium), "scale": scale})
            if scale == 1.0 and medium:
                today.append({"GiB": size / 2**30})
    if not rows:
        return None
    colour = alt.Color("tier:N", legend=alt.Legend(orient="right", title=None))
    curve = (
        alt.Chart(alt.NamedData("tier_projected"))
        .mark_line(point=True)
        .encode(
            x=alt.X("GiB:Q", scale=alt.Scale(type="log", base=2), title="offload tier, GiB"),
            y=alt.Y("ratio:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%"),
                    title="hits, GPU pool and tier"),
            color=colour,
            tooltip=["tier:N", alt.Tooltip("GiB:Q", format=".3~f"), alt.Tooltip("scale:Q", title="scale"),
                     alt.Tooltip("ratio:Q", format=".1%")],
        )
    )  # fmt: skip
    layers = [curve]
    if today:  # an engine with a tier (a rule of no data is an empty extent, which Vega warns of)
        layers.append(
            alt.Chart(alt.NamedData("tier_today")).mark_rule(strokeDash=[4, 3], color="#666").encode(x="GiB:Q")
        )
    if alone:
        layers.append(
            alt.Chart(alt.NamedData("tier_none")).mark_rule(strokeDash=[2, 2]).encode(y="ratio:Q", color=colour)
        )
    chart = alt.layer(*layers).properties(width=480, height=220)
    note = (
        f"{names.OFFLOAD_PROJECTED_HIT_RATIO} against {names.OFFLOAD_PROJECTED_SIZE}, each engine's latest reading; "
        "dashed across: the GPU pool alone; dashed up: today's tier. An engine with no tier shows a first tier's, "
        "in multiples of its GPU pool's bytes."
    )
    data = {"tier_projected": rows, "tier_today": today, "tier_none": alone}
    return Figure("tierwhatif", "What an offload tier of another size would have bought", note, chart, data)
