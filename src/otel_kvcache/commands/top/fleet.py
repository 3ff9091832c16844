"""Fleet mode, ``otel-kvcache top --prometheus URL``: every replica's and engine's pool
lines, read from the Prometheus that scrapes them (directly, or through a collector).

Per-request rows stay on each host; Prometheus has the pool and attribution series.
An engine is one label set of ``vllm_kv_cache_blocks`` without its block state: the
scrape's ``job`` and ``instance`` (a collector's exporter sets them from
``service.name`` and ``service.instance.id``), ``vllm_engine_index``, and whatever
else the user's relabelling adds. Rates are over the last minute, as on the host.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any

from otel_kvcache import names
from otel_kvcache.commands import prometheus_names
from otel_kvcache.engine.snapshot_files import Published

ENGINE_LABEL = prometheus_names.label(names.ENGINE_INDEX)
STATE_LABEL = prometheus_names.label(names.BLOCK_STATE)
MODEL_LABEL = prometheus_names.label(names.MODEL)
SCALE_LABEL = prometheus_names.label(names.POOL_SCALE)
SERIES_LABELS = ("__name__", STATE_LABEL, SCALE_LABEL)
"""Labels that tell one engine's series apart, not one engine from another (with the
instrumentation scope's, ``otel_scope_*``, that exporters add)."""


def _of_a_series(label: str) -> bool:
    return label in SERIES_LABELS or label.startswith("otel_scope_")


def _rate(counter: str) -> str:
    return f"rate({prometheus_names.metric(counter, counter=True)}[1m])"


# Older Python Prometheus exporters kept a unit's symbol (`_s_total`), a collector's
# exporter spells it out (`_seconds_total`): a name that has a unit is matched either way.
QUERIES = {
    "blocks": prometheus_names.metric(names.BLOCKS),
    "limit": prometheus_names.metric(names.BLOCKS_LIMIT),
    "bytes": prometheus_names.metric(names.KV_MEMORY_USAGE, unit="By"),
    "hits": _rate(names.PREFIX_CACHE_HITS),
    "queries": _rate(names.PREFIX_CACHE_QUERIES),
    "preemptions": _rate(names.PREEMPTIONS),
    "evictions": _rate(names.EVICTIONS),
    "stalls": _rate(names.ALLOCATION_STALLS),
    "evicted_age": f'rate({{__name__=~"{prometheus_names.metric(names.EVICTION_AGE)}(_s|_seconds)?_total"}}[1m])',
    "orphaned_blocks": prometheus_names.metric(names.ORPHANED_BLOCKS),
    "zombie_requests": prometheus_names.metric(names.ZOMBIE_REQUESTS),
    "zombie_blocks": prometheus_names.metric(names.ZOMBIE_BLOCKS),
    "stuck_requests": prometheus_names.metric(names.STUCK_REQUESTS),
    "hit_ratio": prometheus_names.metric(names.PROJECTED_HIT_RATIO),
    "preemption_free_scale": prometheus_names.metric(names.PROJECTED_PREEMPTION_FREE_SCALE),
    # The GPU pool's holders: an offload tier's rows carry its medium.
    "held": f'{prometheus_names.metric(names.HELD_BLOCKS)}{{{prometheus_names.label(names.OFFLOAD_MEDIUM)}=""}}',
}


class PrometheusError(Exception):
    """Prometheus could not be reached or did not answer a query."""


def query(url: str, promql: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """An instant query's vector: ``[{"metric": labels, "value": [time, "number"]}, ...]``."""
    address = f"{url.rstrip('/')}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(address, timeout=timeout) as response:
            answer = json.loads(response.read())
    except (OSError, ValueError) as exc:
        raise PrometheusError(f"{url}: {exc}") from exc
    if answer.get("status") != "success":
        raise PrometheusError(f"{url}: {answer.get('error', 'query failed')} ({promql})")
    return answer["data"]["result"]


def read_fleet(url: str) -> list[Published]:
    """Every engine Prometheus has pool series of, as the snapshots a host would publish
    (no requests; fresh, since Prometheus keeps only what it scraped)."""
    answers = {name: query(url, promql) for name, promql in QUERIES.items()}
    # The labels that name an engine: those of its pool series, less the block state.
    engine_labels = {k for sample in answers["blocks"] for k in sample["metric"] if not _of_a_series(k)}

    def engine_key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((k, v) for k, v in labels.items() if k in engine_labels))

    engines: dict[tuple, dict[str, Any]] = {}
    for sample in answers["blocks"]:
        labels = sample["metric"]
        engine = engines.setdefault(engine_key(labels), _blank(labels))
        engine["pool"][labels.get(STATE_LABEL, "used")] = int(float(sample["value"][1]))

    def each(name: str):
        for sample in answers[name]:
            engine = engines.get(engine_key(sample["metric"]))
            if engine is not None:
                yield engine, sample["metric"], float(sample["value"][1])

    for engine, _, value in each("limit"):
        engine["pool"]["limit"] = int(value)
    for engine, labels, value in each("bytes"):
        if labels.get(STATE_LABEL) == "used" and engine["pool"]["used"]:
            engine["pool"]["bytes_per_block"] = round(value / engine["pool"]["used"])
    rates: dict[int, dict[str, float]] = {}
    for name in ("hits", "queries", "preemptions", "evictions", "stalls", "evicted_age"):
        for engine, _, value in each(name):
            rates.setdefault(id(engine), {})[name] = value
    for name in ("orphaned_blocks", "zombie_requests", "zombie_blocks", "stuck_requests"):
        for engine, _, value in each(name):
            engine["leaks"][name] = int(value)
    for engine, labels, value in each("hit_ratio"):
        engine["whatif"]["hit_ratio"][f"{float(labels[SCALE_LABEL]):g}"] = value
    for engine, _, value in each("preemption_free_scale"):
        engine["whatif"]["preemption_free_scale"] = value
    for engine, labels, value in each("held"):
        attributes = {k: v for k, v in labels.items() if k not in engine_labels and not _of_a_series(k)}
        engine["holders"].append({"attributes": attributes, "blocks": value})
    for engine in engines.values():
        engine["last_minute"] = _last_minute(rates.get(id(engine), {}))
        engine["holders"].sort(key=lambda h: -h["blocks"])
        models = [h["attributes"][MODEL_LABEL] for h in engine["holders"] if MODEL_LABEL in h["attributes"]]
        engine["model"] = ", ".join(dict.fromkeys(models)) or None
    return [Published(engine, 0.0, False) for engine in engines.values()]


def _blank(labels: dict[str, str]) -> dict[str, Any]:
    replica = {k: v for k, v in labels.items() if not _of_a_series(k) and k != ENGINE_LABEL}
    return {
        "replica": replica,
        "engine": int(labels.get(ENGINE_LABEL, 0)),
        "pool": {"used": 0, "cached": 0, "free": 0, "limit": 0, "bytes_per_block": 0},
        "leaks": {},
        "whatif": {"hit_ratio": {}, "preemption_free_scale": None},
        "holders": [],
        "holders_other": 0.0,
        "requests": [],
    }


def _last_minute(rates: dict[str, float]) -> dict[str, Any]:
    queries, evictions = rates.get("queries", 0.0), rates.get("evictions", 0.0)
    return {
        "seconds": 60.0,
        "prefix_hit_ratio": rates.get("hits", 0.0) / queries if queries else None,
        "preemptions_per_s": rates.get("preemptions", 0.0),
        "evictions_per_s": evictions,
        "stalls_per_s": rates.get("stalls", 0.0),
        "evicted_age_mean_s": rates.get("evicted_age", 0.0) / evictions if evictions else None,
    }
