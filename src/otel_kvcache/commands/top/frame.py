"""One frame of ``otel-kvcache top``: the JSON frame (``docs/top.md``) and its drawing.

The frame is the engines' snapshots as published (or as fleet mode reads them from
Prometheus), each with its age and whether it is stale, and the host's GPUs as NVML
sees them: the device's memory beside the KV pool vLLM reserved inside it. It is drawn
with Rich, which colours only on a terminal (and never under ``NO_COLOR``).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from otel_kvcache import names
from otel_kvcache.commands import prometheus_names
from otel_kvcache.engine.snapshot_files import Published
from otel_kvcache.gpu.nvml import NVMLSource

SORT_KEYS = ("blocks", "age_s", "preemptions")
"""What the requests can be sorted by (largest first); the ``s`` key cycles them."""
BAR_WIDTH = 40
STATE_STYLES = {
    names.LIVE_STATE_RUNNING: "green",
    names.LIVE_STATE_PREEMPTED: "yellow",
    names.LIVE_STATE_WAITING_FOR_REMOTE_KV: "cyan",
    names.LIVE_STATE_HELD_FOR_SEND: "cyan",
    names.LIVE_STATE_ZOMBIE: "bold red",
}


@dataclass
class View:
    """How the requests are shown: sorted by one of ``SORT_KEYS``, and filtered."""

    sort: str = "blocks"
    filter: str = ""
    """Shown only the requests and holders whose model or baggage value contains it."""

    def next_sort(self) -> None:
        self.sort = SORT_KEYS[(SORT_KEYS.index(self.sort) + 1) % len(SORT_KEYS)]


def device_readings(nvml: NVMLSource | None) -> list[dict[str, Any]]:
    """The host's GPUs, as NVML reports them (none without a driver)."""
    if nvml is None:
        return []
    return [
        {
            "index": index,
            "name": reading.name,
            "uuid": reading.uuid,
            "memory_used": reading.memory_used,
            "memory_total": reading.memory_total,
            "process_memory": {str(pid): used for pid, used in reading.process_memory.items()},
        }
        for index, reading in enumerate(nvml.read())
    ]


def json_frame(published: list[Published], devices: list[dict[str, Any]], source: str) -> dict[str, Any]:
    """The frame ``--json`` prints: the host, its GPUs, and each engine's snapshot with its age."""
    engines = [{**p.snapshot, "age_s": p.age, "stale": p.stale} for p in published]
    engines.sort(key=lambda e: (e.get("host", ""), str(e.get("replica", "")), e.get("pid", 0), e.get("engine", 0)))
    return {"host": socket.gethostname(), "time": time.time(), "source": source, "devices": devices, "engines": engines}


def render(frame: dict[str, Any], view: View) -> RenderableType:
    parts: list[RenderableType] = [_title(frame, view)]
    parts += [_device_line(device) for device in frame["devices"]]
    if not frame["devices"] and frame["source"] == "snapshots":
        parts.append(Text("GPU  no NVML device on this host", style="dim"))
    if not frame["engines"]:
        parts.append(Text("\nNo instrumented engine found. " + _where_to_look(frame), style="yellow"))
    for engine in frame["engines"]:
        parts.append(Text(""))
        parts += _engine(engine, frame["devices"], view)
    return Group(*parts)


def _where_to_look(frame: dict[str, Any]) -> str:
    if frame["source"] == "snapshots":
        return (
            "Engines publish their snapshots when vLLM runs instrumented by otel-kvcache, "
            "as this user, with OTEL_KVCACHE_TOP_SNAPSHOT=on (the default)."
        )
    return f"Prometheus has no {prometheus_names.metric(names.BLOCKS)} series."


def _title(frame: dict[str, Any], view: View) -> Text:
    title = Text("otel-kvcache top", style="bold")
    source = "from local snapshots" if frame["source"] == "snapshots" else f"from {frame['source']}"
    title.append(f"  {frame['host']}  {time.strftime('%H:%M:%S', time.localtime(frame['time']))}  ")
    title.append(f"{len(frame['engines'])} engine(s) {source}  sorted by {view.sort.removesuffix('_s')}")
    if view.filter:
        title.append(f"  filter: {view.filter!r}", style="bold magenta")
    return title


def _device_line(device: dict[str, Any]) -> Text:
    line = Text(f"GPU{device['index']} {device['name']}  ", style="bold")
    used, total = device.get("memory_used"), device.get("memory_total")
    if used is not None and total:
        line.append(f"memory {_bytes(used)} of {_bytes(total)} in use (NVML)", style="")
    else:
        line.append("memory not reported by NVML", style="dim")
    return line


def _engine(engine: dict[str, Any], devices: list[dict[str, Any]], view: View) -> list[RenderableType]:
    heading = Text(f"engine {engine.get('engine', 0)}", style="bold cyan")
    for label, value in (("", engine.get("model")), ("vLLM ", engine.get("vllm")), ("pid ", engine.get("pid"))):
        if value is not None:
            heading.append(f"  {label}{value}")
    if "replica" in engine:
        heading.append("  " + " ".join(f"{k}={v}" for k, v in sorted(engine["replica"].items())))
    if engine.get("stale"):
        heading.append(f"  STALE: no snapshot for {engine['age_s']:.0f} s", style="bold red")
    lines: list[RenderableType] = [heading, _pool_line(engine["pool"]), _memory_line(engine, devices)]
    if engine.get("offload"):
        lines.append(_tier_line(engine["offload"]))
    lines.append(_rates_line(engine.get("last_minute")))
    lines.append(_leaks_line(engine.get("leaks"), engine.get("connector")))
    whatif = _whatif_line(engine.get("whatif"))
    if whatif is not None:
        lines.append(whatif)
    if not engine.get("detailed", True):
        lines.append(Text("  holders and requests: published while top watches, within a second or two", style="dim"))
        return lines
    lines.append(_holders_line(engine.get("holders", []), engine.get("holders_other", 0.0), view))
    if "replica" not in engine:
        lines.append(_requests_table(engine, view))
    return lines


def _pool_line(pool: dict[str, Any]) -> Text:
    used, cached, free, limit = pool["used"], pool["cached"], pool["free"], pool["limit"]
    line = Text("  pool  ")
    if limit:
        widths = [round(BAR_WIDTH * count / limit) for count in (used, cached)]
        line.append("█" * widths[0], style="red")
        line.append("▒" * widths[1], style="blue")
        line.append("░" * max(BAR_WIDTH - sum(widths), 0), style="dim")
    line.append(f"  used {used}  cached {cached}  free {free}  of {limit} blocks")
    if limit:
        line.append(f"  ({100 * used / limit:.0f} % in use)")
    return line


def _memory_line(engine: dict[str, Any], devices: list[dict[str, Any]]) -> Text:
    pool, per_block = engine["pool"], engine["pool"].get("bytes_per_block") or 0
    line = Text("  KV    ")
    if not per_block:
        return line.append("bytes unknown", style="dim")
    line.append(f"{_bytes(pool['used'] * per_block)} in use of {_bytes(pool['limit'] * per_block)} reserved")
    pid = str(engine.get("pid"))
    on_device = [(d, d["process_memory"][pid]) for d in devices if pid in d.get("process_memory", {})]
    for device, used in on_device:
        line.append(f"; this process holds {_bytes(used)} on GPU{device['index']} (NVML)", style="dim")
    return line


def _tier_line(tier: dict[str, Any]) -> Text:
    used, free, per_block = tier["used"], tier["free"], tier.get("bytes_per_block") or 0
    line = Text(f"  tier  {tier['medium']}: used {used}  free {free}  of {used + free} blocks")
    if per_block:
        line.append(f" ({_bytes(used * per_block)} of {_bytes((used + free) * per_block)})")
    line.append(f"  stores {tier['stores']}  loads {tier['loads']}  evictions {tier['evictions']}, ")
    line.append(f"{tier['evicted_unused']} never loaded back", style="bold yellow" if tier["evicted_unused"] else "")
    ratios = tier.get("projected_hit_ratio") or {}
    if "1" in ratios and "2" in ratios:
        line.append(f"  what-if 2x the tier: hit ratio {ratios['1']:.2f} → {ratios['2']:.2f}")
    return line


def _rates_line(minute: dict[str, Any] | None) -> Text:
    line = Text("  last ")
    if not minute:
        return line.append("minute: no rates", style="dim")
    line.append(f"{minute.get('seconds', 60):.0f} s  ")
    ratio = minute.get("prefix_hit_ratio")
    line.append("prefix hits " + ("-" if ratio is None else f"{100 * ratio:.0f} %"))
    for label, key in (("preemptions", "preemptions_per_s"), ("evictions", "evictions_per_s"), ("stalls", "stalls_per_s")):
        rate = minute.get(key) or 0.0
        line.append(f"  {label} {rate:.2f}/s", style="yellow" if rate and label != "evictions" else "")
    age = minute.get("evicted_age_mean_s")
    if age is not None:
        line.append(f"  evicted at {age:.0f} s of age")
    return line


def _leaks_line(leaks: dict[str, Any] | None, connector: dict[str, Any] | None) -> Text:
    line = Text("  leaks ")
    findings = []
    if leaks:
        if leaks.get("zombie_requests"):
            findings.append(f"{leaks['zombie_requests']} zombie request(s) holding {leaks['zombie_blocks']} blocks")
        if leaks.get("orphaned_blocks"):
            findings.append(f"{leaks['orphaned_blocks']} orphaned blocks")
        if leaks.get("stuck_requests"):
            findings.append(f"{leaks['stuck_requests']} stuck request(s)")
    if findings:
        line.append(";  ".join(findings), style="bold red")
    else:
        line.append("none found", style="green")
    if connector and connector.get("held_requests"):
        line.append(
            f"  connector holds {connector['held_blocks']} blocks of {connector['held_requests']} finished "
            f"request(s), oldest {connector['held_age_max_s']:.0f} s"
        )
    return line


def _whatif_line(whatif: dict[str, Any] | None) -> Text | None:
    if whatif is None:
        return None
    ratios = whatif.get("hit_ratio") or {}
    if "1" in ratios and "2" in ratios:
        line = Text(f"  what-if  2x the pool: hit ratio {ratios['1']:.2f} → {ratios['2']:.2f}")
    else:  # idle, or prefix caching off
        line = Text("  what-if  no prefix lookups in the last 10 min")
    scale = whatif.get("preemption_free_scale")
    if not scale:
        line.append("  no demand yet")
    elif scale >= 0.01:
        line.append(f"  peak demand fits {scale:.2f}x the pool")
    else:  # a light load on a large pool
        line.append(f"  peak demand used {100 * scale:.2g} % of the pool")
    first_tier = whatif.get("first_tier_hit_ratio") or {}
    if "1" in first_tier:  # an engine with no offload tier
        line.append(f"  an offload tier the pool's size: hit ratio {first_tier['1']:.2f}")
    return line


def _matches(view: View, *values: Any) -> bool:
    """Whether one of ``values`` (a model, a tenant...) contains the view's filter."""
    if not view.filter:
        return True
    wanted = view.filter.lower()
    return any(wanted in str(value).lower() for value in values if value is not None)


def _holders_line(holders: list[dict[str, Any]], other: float, view: View) -> Text:
    line = Text("  holders ")
    shown = [h for h in holders if _matches(view, *h["attributes"].values())]
    if not shown:
        return line.append("none", style="dim")
    for holder in shown:
        label = " / ".join(str(value) for value in holder["attributes"].values()) or "(unattributed)"
        line.append(f" {label} ", style="bold")
        line.append(f"{holder['blocks']:.1f}")
    if other and not view.filter:
        line.append(f"  others {other:.1f}", style="dim")
    return line


def _requests_table(engine: dict[str, Any], view: View) -> Table:
    rows = [r for r in engine["requests"] if _matches(view, r.get("model"), *(r.get("baggage") or {}).values())]
    rows.sort(key=lambda r: r.get(view.sort) or 0, reverse=True)
    keys = sorted({key for row in rows for key in (row.get("baggage") or {})})
    holding = engine.get("holding_requests", len(engine["requests"]))
    table = Table(
        title=f"{holding} request(s) holding blocks; the {len(engine['requests'])} holding the most",
        title_justify="left", title_style="", box=None, pad_edge=False, header_style="bold",
    )  # fmt: skip
    for column in ("request", "session", "model", *keys):
        table.add_column(column, overflow="ellipsis", max_width=28, no_wrap=True)
    for column in ("blocks", "age s", "preempted"):
        table.add_column(column, justify="right")
    table.add_column("state")
    for row in rows:
        baggage = row.get("baggage") or {}
        age = row.get("age_s")
        table.add_row(
            row["id"], row.get("session") or "", row.get("model") or "", *(baggage.get(k, "") for k in keys),
            str(row["blocks"]), "" if age is None else f"{age:.1f}", str(row.get("preemptions", 0)),
            Text(row["state"], style=STATE_STYLES.get(row["state"], "")),
        )  # fmt: skip
    return table


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{count:.0f} B"
        count /= 1024
    return f"{count:.1f} GiB"
