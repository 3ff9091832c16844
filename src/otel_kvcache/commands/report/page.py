"""The report as one HTML file that opens anywhere: no network, no CDN.

Vega, Vega-Lite and vega-embed are inlined once (vl-convert's bundle, about
0.9 MB), each chart's spec and data sit in a ``<script type="application/json">``
block, and the summary in ``<script type="application/json" id="summary">``, so
tools and tests read the numbers back without scraping the cards. When every
chart has rendered, ``<body data-rendered="true">``; a chart that fails sets it
to ``"error"`` and logs the error to the console.
"""

from __future__ import annotations

import html
import json
from functools import lru_cache

from otel_kvcache.commands.report.chart_style import Figure
from otel_kvcache.commands.report.summary import Summary

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px 32px; color: #222; background: #fff; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 2px; }
.source, .note { color: #666; font-size: 12px; margin: 0 0 8px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; margin: 16px 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 14px; min-width: 110px; }
.card b { display: block; font-size: 20px; } .card span { color: #666; font-size: 12px; }
.card.PASS b { color: #2b8a3e; } .card.FAIL b { color: #c92a2a; } .card.NO.DATA b { color: #888; }
.problems { color: #c92a2a; font-size: 12px; margin: 0; }
#trace-id { font: 12px monospace; width: 34em; }
"""

GLUE = """
const figures = [...document.querySelectorAll('script[type="application/json"][data-chart]')];
function copyTraceId(event, item) {
  const id = item && item.datum && item.datum.trace_id;
  if (!id) return;
  const box = document.getElementById('trace-id');
  box.value = id; box.select();
  if (navigator.clipboard) navigator.clipboard.writeText(id).catch(() => {});
}
Promise.all(figures.map(block =>
  vegaEmbed('#' + block.dataset.chart, JSON.parse(block.textContent), {actions: false, renderer: 'canvas'})
    .then(result => result.view.addEventListener('click', copyTraceId))
)).then(() => { document.body.dataset.rendered = 'true'; },
        error => { document.body.dataset.rendered = 'error'; console.error('report: a chart failed', error); });
"""


@lru_cache(maxsize=1)
def vega_bundle() -> str:
    """Vega, Vega-Lite (the version Altair writes: v6.4.1 is vl-convert's ``v6_4``) and
    vega-embed, as one script. About a second: vl-convert bundles it on each call."""
    import altair
    import vl_convert

    return vl_convert.javascript_bundle(vl_version="_".join(altair.SCHEMA_VERSION.split(".")[:2]))


def _json_block(value, **attributes) -> str:
    """A JSON script block; ``</`` escaped so no string in the data can close it."""
    text = json.dumps(value, separators=(",", ":")).replace("</", "<\\/")
    attrs = "".join(f' {key.replace("_", "-")}="{html.escape(str(v))}"' for key, v in attributes.items())
    return f'<script type="application/json"{attrs}>{text}</script>'


def _requests(count: int) -> str:
    return "1 request" if count == 1 else f"{count} requests"


def _percent(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.0%}"


def cards(summary: Summary) -> str:
    items = [
        (summary.requests, "requests"),
        (summary.preemptions, f"preemptions ({_requests(summary.preempted_requests)})"),
        (summary.allocation_stalls, "allocation stalls"),
        (summary.evictions, "evictions"),
        (summary.leak_findings, "leak findings"),
        (_percent(summary.prefix_cache_hit_ratio), "prefix-cache hit ratio"),
        (f"{summary.peak_used_blocks} / {summary.pool_blocks}", "peak used / pool blocks"),
        (summary.peak_cached_blocks, "peak cached blocks"),
    ]
    body = "".join(
        f'<div class="card"><b>{html.escape(str(value))}</b><span>{html.escape(what)}</span></div>'
        for value, what in items
    )
    verdict = html.escape(summary.leak_gate)
    problems = "".join(f"<p class='problems'>{html.escape(p)}</p>" for p in summary.leak_gate_problems)
    gate = f'<div class="card {verdict}"><b>{verdict}</b><span>leak gate</span>{problems}</div>'
    return f'<div class="cards">{body}{gate}</div>'


def section(figure: Figure) -> str:
    extra = ""
    if figure.key == "timeline":
        extra = '<p class="note">trace id <input id="trace-id" readonly placeholder="click a request"></p>'
    return (
        f"<h2>{html.escape(figure.title)}</h2><p class='note'>{html.escape(figure.note)}</p>{extra}"
        f'<div class="chart" id="chart-{figure.key}"></div>'
        + _json_block(figure.spec(), data_chart=f"chart-{figure.key}", id=f"spec-{figure.key}")
    )


def render(summary: Summary, figures: list[Figure], source: str, notes: list[str]) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>otel-kvcache report</title>",
        f"<style>{STYLE}</style>",
        f"<script>{vega_bundle()}</script>",
        "</head><body>",
        "<h1>What the KV cache did</h1>",
        f'<p class="source">{html.escape(source)}</p>',
        cards(summary),
        "".join(f'<p class="note">{html.escape(note)}</p>' for note in notes),
        _json_block(summary.as_dict(), id="summary"),
        *(section(figure) for figure in figures),
        f"<script>{GLUE}</script>",
        "</body></html>",
    ]
    return "\n".join(parts)
