"""The metric instruments, created once per ``instrument()`` call."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_kvcache import names

if TYPE_CHECKING:
    from otel_kvcache.engine import EngineTelemetry


class KVCacheInstruments:
    """Counters and histograms the engine thread records into, and the pool
    gauges the metric reader's thread observes.

    The gauges read the snapshot each engine published at the end of its last
    step, never vLLM's live structures.
    """

    def __init__(self, meter: Meter) -> None:
        self.engines: weakref.WeakSet[EngineTelemetry] = weakref.WeakSet()
        self.preemptions = meter.create_counter(
            names.PREEMPTIONS, unit="{preemption}", description="Requests preempted to free KV blocks."
        )
        self.evictions = meter.create_counter(
            names.EVICTIONS, unit="{block}", description="Prefix-cache blocks evicted for reuse."
        )
        self.prefix_cache_queries = meter.create_counter(
            names.PREFIX_CACHE_QUERIES, unit="{token}", description="Tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = meter.create_counter(
            names.PREFIX_CACHE_HITS, unit="{token}", description="Tokens found in the prefix cache."
        )
        self.allocation_stalls = meter.create_counter(
            names.ALLOCATION_STALLS,
            unit="{stall}",
            description="Request-steps in which a scheduled request got no KV blocks.",
        )
        self.request_blocks = meter.create_histogram(
            names.REQUEST_BLOCKS,
            unit="{block}",
            description="Peak KV blocks held per finished request.",
            explicit_bucket_boundaries_advisory=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
        )
        self.request_prefix_hit_ratio = meter.create_histogram(
            names.REQUEST_PREFIX_HIT_RATIO,
            unit="1",
            description="Prefix-cache hit tokens over prompt tokens per finished request.",
            explicit_bucket_boundaries_advisory=[0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0],
        )
        self.request_preemptions = meter.create_histogram(
            names.REQUEST_PREEMPTIONS,
            unit="{preemption}",
            description="Preemptions per finished request.",
            explicit_bucket_boundaries_advisory=[0, 1, 2, 4, 8, 16, 32],
        )
        self.errors = meter.create_counter(
            names.INSTRUMENTATION_ERRORS,
            unit="{error}",
            description="Errors inside otel-kvcache; vLLM kept running.",
        )
        meter.create_observable_gauge(
            names.BLOCKS,
            callbacks=[self._observe_blocks],
            unit="{block}",
            description="KV-cache blocks by state: used, cached (evictable prefix), free.",
        )
        meter.create_observable_gauge(
            names.BLOCKS_LIMIT,
            callbacks=[self._observe_limit],
            unit="{block}",
            description="Usable KV-cache blocks in the pool.",
        )
        meter.create_observable_gauge(
            names.UTILIZATION,
            callbacks=[self._observe_utilization],
            unit="1",
            description="Share of the pool referenced by requests; evictable cached blocks count as free.",
        )

    def _snapshots(self):
        for engine in list(self.engines):
            snapshot = engine.snapshot
            if snapshot is not None:
                yield engine.attributes, snapshot

    def _observe_blocks(self, options: CallbackOptions) -> Iterable[Observation]:
        for attributes, snapshot in self._snapshots():
            for state, value in zip(names.BLOCK_STATES, (snapshot.used, snapshot.cached, snapshot.free)):
                yield Observation(value, {**attributes, names.BLOCK_STATE: state})

    def _observe_limit(self, options: CallbackOptions) -> Iterable[Observation]:
        for attributes, snapshot in self._snapshots():
            yield Observation(snapshot.limit, attributes)

    def _observe_utilization(self, options: CallbackOptions) -> Iterable[Observation]:
        for attributes, snapshot in self._snapshots():
            yield Observation(snapshot.utilization, attributes)
