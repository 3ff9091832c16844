"""The instrumented side of every benchmark, set up as ``opentelemetry-instrument`` sets it up.

``instrument`` is what the benchmarks measure; ``unhook`` and ``empty`` take
parts of it away again, for ``benchmarks.overhead --take-apart`` and
``benchmarks.specialization`` (diagnostics only: without those parts the
telemetry is wrong).
"""

from __future__ import annotations

import os

# What --take-apart and ``benchmarks.instructions --without`` empty, by part: the
# methods the hooks call into, each with what it returns emptied.
EMPTIED_METHODS = {
    "mirror": {
        "PoolTracker": dict.fromkeys(
            ("note_pops", "before_prepending", "on_appending", "on_touching", "before_unpinning", "catch_up")
        ),
    },
    "records": {
        "EngineTelemetry": dict.fromkeys(("on_prefix_cache_lookup", "on_scheduled", "before_release", "on_released")),
    },
    "whatif": {"PrefixReuse": {"on_freed": None, "on_lookup": None, "on_demand": None, "on_entries_freed": None,
                               "on_entries_held": None}},
    "misses": {"MissesForTheHelper": {"freed": None, "missed": None, "entries_freed": None}},
    # A hybrid model's own: its peaks, and where its hits can end (``vllm_compat.layouts``).
    "hybrid": {"EngineTelemetry": {"_read_peaks": None, "_entries_freed": None, "_entries_cached": None}},
    "attribution": {"Attribution": {"request_ended": (None, 0)}, "SessionTable": {"turn_gap_ns": -1}},
    "handover": {"HelperPipe": {"queue_pending": None}},
    # An offload tier's (``churn/offload``): its stores, loads and evictions, and the
    # connector's admissions and outputs.
    "tier": {"OffloadTier": dict.fromkeys(("on_store_prepared", "on_load_prepared", "on_store_completed"))},
    "connector": {"ConnectorTelemetry": {"on_allocated": None, "after_schedule": None, "before_output": None}},
    "tier-watch": {"ConnectorTelemetry": {"watch_offload_tier": None}},  # no tier seen: none of its hooks
}


def instrument(export_interval_millis: int = 5_000, helper_exports: bool = True):
    """As under ``opentelemetry-instrument``: spans and request histograms built by
    the helper process, whose SDK comes from the environment (spans exported a
    frame at a time and a periodic metric reader, into console exporters, whose
    output the helper discards); the engine process keeps the observable instruments, read
    by a periodic reader into an exporter that discards."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )

    from otel_kvcache import VLLMKVCacheInstrumentor

    class DiscardMetrics(MetricExporter):
        def __init__(self):
            super().__init__()

        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    reader = PeriodicExportingMetricReader(DiscardMetrics(), export_interval_millis=export_interval_millis)
    meter_provider = MeterProvider(metric_readers=[reader])
    os.environ.update(
        OTEL_KVCACHE_EXPORTER_PROCESS="on",
        OTEL_TRACES_EXPORTER="console" if helper_exports else "none",
        OTEL_METRICS_EXPORTER="console" if helper_exports else "none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_METRIC_EXPORT_INTERVAL=str(export_interval_millis),
    )
    VLLMKVCacheInstrumentor().instrument(meter_provider=meter_provider)
    return meter_provider


def unhook() -> None:
    """vLLM's own methods back on its classes; the engine's telemetry objects stay."""
    from otel_kvcache import VLLMKVCacheInstrumentor

    VLLMKVCacheInstrumentor().uninstrument()


def empty(parts: str) -> None:
    """Leaves the named parts of the instrumentation's work out (``EMPTIED_METHODS``)."""
    from otel_kvcache.engine.attribution import Attribution, SessionTable
    from otel_kvcache.engine.connectors import ConnectorTelemetry
    from otel_kvcache.engine.offload_tier import OffloadTier
    from otel_kvcache.engine.pool import PoolTracker
    from otel_kvcache.engine.telemetry import EngineTelemetry
    from otel_kvcache.engine.whatif import PrefixReuse
    from otel_kvcache.export.helper_pipe import HelperPipe
    from otel_kvcache.handover.miss_reasons import MissesForTheHelper

    owners = {
        owner.__name__: owner
        for owner in (
            Attribution, ConnectorTelemetry, EngineTelemetry, HelperPipe, MissesForTheHelper, OffloadTier, PoolTracker,
            PrefixReuse, SessionTable,
        )
    }  # fmt: skip
    for part in parts.split(","):
        for owner_name, methods in EMPTIED_METHODS[part].items():
            owner = owners[owner_name]
            for method, returned in methods.items():
                getattr(owner, method)  # renamed since? then fail here, not measure nothing
                setattr(owner, method, lambda *args, _returned=returned, **kwargs: _returned)
