"""The metric instruments, created once per ``instrument()`` call."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel_kvcache import names
from otel_kvcache.errors import telemetry_dropped_counter

if TYPE_CHECKING:
    from otel_kvcache.engine.connectors import ConnectorTelemetry
    from otel_kvcache.engine.offload_tier import OffloadTier
    from otel_kvcache.engine.telemetry import EngineTelemetry


# Cumulative counts the engine thread keeps, as (counter, unit, description, where it is).
_COUNTERS = (
    (names.PREEMPTIONS, "{preemption}", "Requests preempted to free KV blocks.", "preemptions"),
    (names.EVICTIONS, "{block}", "Prefix-cache blocks evicted for reuse.", "pool.evictions"),
    (names.PREFIX_CACHE_QUERIES, "{token}", "Tokens looked up in the prefix cache.", "prefix_cache_queries"),
    (names.PREFIX_CACHE_HITS, "{token}", "Tokens found in the prefix cache.", "prefix_cache_hits"),
    (
        names.ALLOCATION_STALLS,
        "{stall}",
        "Request-steps in which a scheduled request got no KV blocks.",
        "allocation_stalls",
    ),
    (names.EVICTION_AGE, "s", "Summed age of evicted prefix-cache blocks.", "pool.eviction_age_sum"),
    (names.COMPUTED_TOKENS, "{token}", "Tokens finished requests computed.", "computed_tokens"),
    (names.RECOMPUTED_TOKENS, "{token}", "Computed tokens thrown away by preemptions.", "recomputed_tokens"),
)

# The reconciler's findings, as (gauge, unit, description, reading of its last report).
_FINDING_GAUGES = (
    (names.ORPHANED_BLOCKS, "{block}", "Block references no live request accounts for.", "orphaned_blocks"),
    (names.ZOMBIE_REQUESTS, "{request}", "Finished requests still holding blocks past the grace period.", "zombie_requests"),
    (names.ZOMBIE_BLOCKS, "{block}", "Blocks held by zombie requests.", "zombie_blocks"),
    (names.STUCK_REQUESTS, "{request}", "Running requests that made no progress for many steps.", "stuck_requests"),
    (names.TAIL_SLACK, "{token}", "Token slots allocated to running requests, not yet filled.", "tail_slack_tokens"),
    (names.TAIL_SLACK_RATIO, "1", "Tail slack over the token slots of the used blocks.", "tail_slack_ratio"),
    (
        names.CACHED_BLOCKS_HIT_AGAIN,
        "{block}",
        "Evictable cached blocks that a prefix hit reused.",
        "cached_blocks_hit_again",
    ),
)


class KVCacheInstruments:
    """The counters and pool gauges the metric reader's thread observes (the
    per-request histograms are recorded where spans are built: ``export/spans.py``).

    Observable instruments read integers the engine thread keeps, and the free
    queue's length (one integer of vLLM's), never walk vLLM's structures; the what-if
    curve and the miss reasons' counters first take in the events the engine thread
    left them (``whatif.PrefixReuse.catch_up``).
    """

    def __init__(self, meter: Meter) -> None:
        self.engines: weakref.WeakSet[EngineTelemetry] = weakref.WeakSet()
        for name, unit, description, where in _COUNTERS:
            meter.create_observable_counter(
                name, callbacks=[self._engine_callback(attrgetter(where))], unit=unit, description=description
            )
        self.errors = meter.create_counter(
            names.INSTRUMENTATION_ERRORS,
            unit="{error}",
            description="Errors inside otel-kvcache; vLLM kept running.",
        )
        self.telemetry_dropped = telemetry_dropped_counter(meter)
        # The pool's state, as each engine's tracker counts it now.
        for name, unit, description, callback in (
            (names.BLOCKS, "{block}", "KV-cache blocks by state: used, cached (evictable prefix), free.",
             self._observe_blocks),
            (names.BLOCKS_LIMIT, "{block}", "Usable KV-cache blocks in the pool.", self._observe_limit),
            (names.UTILIZATION, "1", "Share of the pool referenced by requests; evictable cached blocks count as free.",
             self._observe_utilization),
            (names.KV_MEMORY_USAGE, "By", "KV-cache bytes by block state: used, cached (evictable prefix), free.",
             self._observe_kv_memory),
            (names.KV_MEMORY_LIMIT, "By", "Bytes of the usable KV-cache pool.", self._observe_kv_memory_limit),
            (names.EVICTION_AGE_MAX, "s", "Oldest prefix-cache block evicted since the previous collection.",
             self._observe_eviction_age_max),
            (names.HELD_BLOCKS, "{block}", "Blocks live requests hold now, a block shared by k requests counting 1/k "
             "to each; with vllm.kv_cache.offload.medium, the offload tier's blocks by who stored them.",
             self._observe_held_blocks),
        ):  # fmt: skip
            meter.create_observable_gauge(name, callbacks=[callback], unit=unit, description=description)
        meter.create_observable_counter(
            names.PREFIX_CACHE_MISSES,
            callbacks=[self._observe_misses],
            unit="{token}",
            description="Looked-up tokens the prefix cache did not serve, by reason: evicted, cold, uncacheable.",
        )
        meter.create_observable_gauge(
            names.PROJECTED_HIT_RATIO,
            callbacks=[self._observe_projected_hit_ratio],
            unit="1",
            description="Share of the last ten minutes' looked-up tokens a pool of each scale would have hit.",
        )
        meter.create_observable_gauge(
            names.PROJECTED_PREEMPTION_FREE_SCALE,
            callbacks=[self._observe_preemption_free_scale],
            unit="1",
            description="Smallest pool, as a multiple of this one, that the last ten minutes' peak demand fits.",
        )
        for name, unit, description, reading in (
            (names.CONNECTOR_HELD_BLOCKS, "{block}", "Blocks of finished requests a KV connector holds for a transfer.", 0),
            (names.CONNECTOR_HELD_REQUESTS, "{request}", "Finished requests whose blocks a KV connector holds.", 1),
            (names.CONNECTOR_HELD_AGE_MAX, "s", "Time since the oldest of them finished.", 2),
        ):  # fmt: skip
            meter.create_observable_gauge(
                name, callbacks=[self._connector_callback(lambda c, i=reading: c.held_readings()[i])],
                unit=unit, description=description,
            )  # fmt: skip
        for name, unit, description, where in (
            (names.CONNECTOR_LOAD_FAILURES, "{block}", "Blocks whose load through the KV connector failed.",
             "load_failure_blocks"),
            (names.CONNECTOR_HIT_TOKENS, "{token}", "Prompt tokens loaded through the KV connector.", "hit_tokens"),
        ):  # fmt: skip
            meter.create_observable_counter(
                name, callbacks=[self._connector_callback(attrgetter(where))], unit=unit, description=description
            )
        # The offload tier, on engines whose connector keeps one (offload_tier.py): its pool, by medium.
        meter.create_observable_gauge(
            names.OFFLOAD_BLOCKS, callbacks=[self._observe_tier_blocks], unit="{block}",
            description="Offload-tier blocks by state: used (stores in flight included), free.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.OFFLOAD_MEMORY_USAGE, callbacks=[self._observe_tier_memory], unit="By",
            description="Bytes of the offload tier's used blocks.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.OFFLOAD_MEMORY_LIMIT, callbacks=[self._observe_tier_memory_limit], unit="By",
            description="Bytes of the offload tier's blocks.",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.OFFLOAD_PROJECTED_HIT_RATIO, callbacks=[self._observe_tier_projection], unit="1",
            description="Share of the last ten minutes' looked-up tokens the GPU pool and an offload tier of each "
            "scale would have served (on an engine with no tier, scales of the GPU pool's bytes).",
        )  # fmt: skip
        meter.create_observable_gauge(
            names.OFFLOAD_PROJECTED_SIZE, callbacks=[self._observe_tier_projected_size], unit="By",
            description="Bytes of the offload tier each scale of the projected hit ratio stands for.",
        )  # fmt: skip
        for name, description, where in (
            (names.OFFLOAD_STORES, "Blocks the offload tier accepted for storing.", "stores"),
            (names.OFFLOAD_LOADS, "Blocks loaded from the offload tier into the GPU pool.", "loads"),
            (names.OFFLOAD_EVICTIONS, "Blocks the offload tier evicted to make room for stores.", "evictions"),
            (names.OFFLOAD_EVICTED_UNUSED, "Blocks the offload tier evicted without loading them back once.",
             "evicted_unused"),
        ):  # fmt: skip
            meter.create_observable_counter(
                name, callbacks=[self._tier_callback(attrgetter(where))], unit="{block}", description=description
            )
        # Who holds the pool, by the attribution series (attribution.py).
        meter.create_observable_counter(
            names.OCCUPANCY, callbacks=[self._observe_occupancy], unit="{block}.s",
            description="Block-seconds held by requests, live ones included up to each collection; with "
            "vllm.kv_cache.offload.medium, the offload tier's.",
        )  # fmt: skip
        for name, unit, description, field in _FINDING_GAUGES:
            read = attrgetter(f"reconciler.report.{field}")
            meter.create_observable_gauge(
                name, callbacks=[self._engine_callback(read)], unit=unit, description=description
            )

    def _observe_held_blocks(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine in list(self.engines):
            for attributes, blocks in engine.attribution.held_blocks(engine.type_managers, engine.scheduler_requests):
                yield Observation(blocks, attributes)
            for attributes, blocks in self._tier_series(engine, blocks=True):
                yield Observation(blocks, attributes)

    def _observe_occupancy(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine in list(self.engines):
            attribution = engine.attribution
            for attributes, seconds in attribution.occupancy_seconds(engine.requests, engine.scheduler_requests):
                yield Observation(seconds, attributes)
            for attributes, seconds in self._tier_series(engine, blocks=False):
                yield Observation(seconds, attributes)

    @staticmethod
    def _tier_series(engine: EngineTelemetry, blocks: bool) -> list[tuple[dict, float]]:
        """The blocks the engine's offload tier holds now (or their block-seconds), by series."""
        tier = engine.offload_tier
        if tier is None:
            return []
        attributes_of, medium = engine.attribution.attributes_of, {names.OFFLOAD_MEDIUM: tier.medium}
        return [
            ({**attributes_of(series), **medium}, held if blocks else seconds)
            for series, held, seconds in tier.holdings()
        ]

    def _observe_eviction_age_max(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine in list(self.engines):
            yield Observation(engine.pool.take_eviction_age_max(), engine.attributes)

    def _engine_callback(self, read: Callable[[EngineTelemetry], float]):
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for engine in list(self.engines):
                yield Observation(read(engine), engine.attributes)

        return observe

    def _connector_callback(self, read: Callable[[ConnectorTelemetry], float]):
        """Observes the engines that have a KV connector."""

        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for engine in list(self.engines):
                if engine.connectors is not None:
                    yield Observation(read(engine.connectors), engine.attributes)

        return observe

    def _tiers(self) -> Iterable[tuple[dict[str, Any], OffloadTier]]:
        """The engines' offload tiers, each with its metric attributes."""
        for engine in list(self.engines):
            tier = engine.offload_tier
            if tier is not None:
                yield {**engine.attributes, names.OFFLOAD_MEDIUM: tier.medium}, tier

    def _tier_callback(self, read: Callable[[OffloadTier], float]):
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            for attributes, tier in self._tiers():
                yield Observation(read(tier), attributes)

        return observe

    def _observe_tier_blocks(self, options: CallbackOptions) -> Iterable[Observation]:
        for attributes, tier in self._tiers():
            for state, blocks in zip((names.BLOCK_STATE_USED, names.BLOCK_STATE_FREE), tier.blocks()):
                yield Observation(blocks, {**attributes, names.BLOCK_STATE: state})

    def _observe_tier_memory(self, options: CallbackOptions) -> Iterable[Observation]:
        for attributes, tier in self._tiers():
            if tier.bytes_per_block:
                yield Observation(tier.blocks()[0] * tier.bytes_per_block, attributes)

    def _observe_tier_memory_limit(self, options: CallbackOptions) -> Iterable[Observation]:
        for attributes, tier in self._tiers():
            if tier.bytes_per_block:
                yield Observation(sum(tier.blocks()) * tier.bytes_per_block, attributes)

    def _tier_scales(self) -> Iterable[tuple[Any, dict[str, Any], int | None]]:
        """Each engine whose tier is projected (``tier_whatif.py``), the attributes its projection
        goes with, and the bytes of scale 1: its tier's, or where it has none, its GPU pool's."""
        for engine in list(self.engines):
            if engine.reuse.tier is None:
                continue
            tier = engine.offload_tier
            if tier is not None:
                per_block, blocks = tier.bytes_per_block, sum(tier.blocks())
                attributes = {**engine.attributes, names.OFFLOAD_MEDIUM: tier.medium}
            else:
                per_block, blocks, attributes = engine.bytes_per_block, engine.pool_counts.limit, engine.attributes
            yield engine, attributes, per_block * blocks if per_block else None

    def _observe_tier_projection(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine, attributes, _ in self._tier_scales():
            for scale, ratio in engine.reuse.projected_tier_hit_ratios().items():
                yield Observation(ratio, {**attributes, names.OFFLOAD_SCALE: scale})

    def _observe_tier_projected_size(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine, attributes, scale_bytes in self._tier_scales():
            if scale_bytes is not None:
                for scale in engine.reuse.tier.scales:
                    yield Observation(round(scale * scale_bytes), {**attributes, names.OFFLOAD_SCALE: scale})

    def _observe_misses(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine in list(self.engines):
            missed = engine.reuse.missed_tokens()
            for reason, tokens in zip((names.MISS_EVICTED, names.MISS_COLD, names.MISS_UNCACHEABLE), missed):
                yield Observation(tokens, {**engine.attributes, names.MISS_REASON: reason})

    def _observe_projected_hit_ratio(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine in list(self.engines):
            for scale, ratio in engine.reuse.projected_hit_ratios().items():
                yield Observation(ratio, {**engine.attributes, names.POOL_SCALE: scale})

    def _observe_preemption_free_scale(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine in list(self.engines):
            scale = engine.reuse.preemption_free_scale()
            if scale is not None:
                yield Observation(scale, engine.attributes)

    def _observe_kv_memory(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine in list(self.engines):
            counts, per_block = engine.pool_counts, engine.bytes_per_block
            if per_block:
                for state, blocks in zip(names.BLOCK_STATES, (counts.used, counts.cached, counts.free)):
                    yield Observation(blocks * per_block, {**engine.attributes, names.BLOCK_STATE: state})

    def _observe_kv_memory_limit(self, options: CallbackOptions) -> Iterable[Observation]:
        for engine in list(self.engines):
            if engine.bytes_per_block:
                yield Observation(engine.pool_counts.limit * engine.bytes_per_block, engine.attributes)

    def _pool_counts(self):
        for engine in list(self.engines):
            yield engine.attributes, engine.pool_counts

    def _observe_blocks(self, options: CallbackOptions) -> Iterable[Observation]:
        for attributes, counts in self._pool_counts():
            for state, value in zip(names.BLOCK_STATES, (counts.used, counts.cached, counts.free)):
                yield Observation(value, {**attributes, names.BLOCK_STATE: state})

    def _observe_limit(self, options: CallbackOptions) -> Iterable[Observation]:
        for attributes, counts in self._pool_counts():
            yield Observation(counts.limit, attributes)

    def _observe_utilization(self, options: CallbackOptions) -> Iterable[Observation]:
        for attributes, counts in self._pool_counts():
            yield Observation(counts.utilization, attributes)
