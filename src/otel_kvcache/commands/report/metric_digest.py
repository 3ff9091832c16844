"""What the metrics file says about the pool, folded in one pass.

Gauges become bounded time series (``buckets.py``): each bucket keeps the
reading with the most used blocks, so the pool's fullest moments survive any
coarsening. Counters become totals as the demo's table and the leak gate read
them (an engine's last cumulative value; delta points summed), and their
increments between exports mark allocation stalls on the time axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from otel_kvcache import names
from otel_kvcache.commands import gate
from otel_kvcache.commands.report.buckets import TimeBuckets, TimeRange
from otel_kvcache.commands.otlp_json import LineCount
from otel_kvcache.commands.report.otlp_stream import Point, points

COUNTERS = (
    names.EVICTIONS,
    names.PREEMPTIONS,
    names.ALLOCATION_STALLS,
    names.PREFIX_CACHE_HITS,
    names.PREFIX_CACHE_QUERIES,
)

MARK_STALLS = "allocation stalls"


@dataclass
class PoolReading:
    time: int
    used: float = 0
    cached: float = 0
    free: float = 0

    def set(self, state: str, value: float) -> None:
        if state in names.BLOCK_STATES:
            setattr(self, state, value)


def _fuller(a, b):
    """Of two readings in one bucket, the one with more used (the later on a tie)."""
    return max(a, b, key=lambda reading: (reading.used, reading.time))


@dataclass
class CounterSeries:
    """One engine's counter: its total and where it grew."""

    total: float = 0
    last_time: int = -1
    last_value: float = 0
    last_start: int = 0

    def add(self, point: Point) -> tuple[float, int]:
        """Folds a point in; returns by how much the counter grew since the previous
        reading, and the middle of that interval (when, about, it grew)."""
        if point.delta:
            self.total += point.value
            return point.value, (point.start + point.time) // 2 if point.start else point.time
        if point.time < self.last_time:
            return 0.0, point.time  # an older reading arriving late: the total already covers it
        restarted = point.start != self.last_start or point.value < self.last_value
        grew = point.value if restarted else point.value - self.last_value
        since = (point.start if restarted else self.last_time) or point.time
        self.last_time, self.last_value, self.last_start = point.time, point.value, point.start
        self.total = point.value
        return grew, (since + point.time) // 2


@dataclass
class MetricDigest:
    lines: LineCount = field(default_factory=LineCount)
    ours: int = 0
    """Points from otel-kvcache's meter scope."""
    pool: dict[object, TimeBuckets[PoolReading]] = field(default_factory=dict)
    limit: float = 0
    limit_by_engine: dict[object, float] = field(default_factory=dict)
    peak_used: float = 0
    peak_cached: float = 0
    counters: dict[str, dict[object, CounterSeries]] = field(default_factory=dict)
    stalls: TimeBuckets[float] = field(default_factory=lambda: TimeBuckets(lambda a, b: a + b))
    gate_readings: dict[str, dict] = field(default_factory=lambda: {name: {} for name in gate.CHECKED})
    gate_times: dict[tuple, int] = field(default_factory=dict)
    device_memory: dict[str, TimeBuckets[tuple]] = field(default_factory=dict)
    """``hw.id`` -> (time, bytes in use) readings (NVML, as nvidia-smi)."""
    device_limit: dict[str, float] = field(default_factory=dict)
    tier: dict[tuple, TimeBuckets[tuple]] = field(default_factory=dict)
    """(engine, medium, block state) -> (time, blocks) readings of the offload tier, the largest per bucket."""
    projected: dict[tuple, tuple] = field(default_factory=dict)
    """(engine, pool scale) -> (time, projected prefix-cache hit ratio), the latest reading."""
    tier_projected: dict[tuple, tuple] = field(default_factory=dict)
    """(engine, medium, tier scale) -> (time, projected hit ratio with a tier that large), the latest
    reading; the medium is "" on an engine with no tier (a first tier's)."""
    tier_projected_size: dict[tuple, float] = field(default_factory=dict)
    """(engine, medium, tier scale) -> bytes of such a tier, the latest reading."""
    held: dict[str, TimeBuckets[tuple]] = field(default_factory=dict)
    """Attribution series (``holder``) -> (time, blocks held) readings, the largest per bucket."""
    occupancy: dict[str, dict[object, CounterSeries]] = field(default_factory=dict)
    """Attribution series -> each engine's block-seconds counter."""
    holder_names: str = ""
    """The attributes the attribution series are labelled by (``holder_names``)."""
    times: TimeRange = field(default_factory=TimeRange)
    _pending: dict[object, PoolReading] = field(default_factory=dict)

    def add(self, point: Point) -> None:
        self.ours += point.scope == names.METER_SCOPE
        handler = _HANDLERS.get(point.metric)
        if handler is None:
            return
        self.times.saw(point.time)
        handler(self, point)

    def _blocks(self, point: Point) -> None:
        """The three states of one reading come as three points with one timestamp."""
        engine = point.attributes.get(names.ENGINE_INDEX, 0)
        state = point.attributes.get(names.BLOCK_STATE)
        if state == names.BLOCK_STATE_USED:
            self.peak_used = max(self.peak_used, point.value)
        elif state == names.BLOCK_STATE_CACHED:
            self.peak_cached = max(self.peak_cached, point.value)
        pending = self._pending.get(engine)
        if pending is None or pending.time != point.time:
            self._flush(engine)
            pending = self._pending[engine] = PoolReading(point.time)
        pending.set(state, point.value)

    def _flush(self, engine) -> None:
        reading = self._pending.pop(engine, None)
        if reading is not None:
            self.pool.setdefault(engine, TimeBuckets(_fuller)).add(reading.time, reading)

    def _limit(self, point: Point) -> None:
        self.limit = max(self.limit, point.value)
        self.limit_by_engine[point.attributes.get(names.ENGINE_INDEX, 0)] = point.value

    def _counter(self, point: Point) -> None:
        engine = point.attributes.get(names.ENGINE_INDEX)
        series = self.counters.setdefault(point.metric, {}).setdefault(engine, CounterSeries())
        grew, when = series.add(point)
        if point.metric == names.ALLOCATION_STALLS and grew > 0:
            self.stalls.add(max(when, self.times.first or when), grew)  # not before the first reading

    def _gate_reading(self, point: Point) -> None:
        """The newest point of each engine, as ``otlp_json.latest_per_engine`` picks it."""
        engine = point.attributes.get(names.ENGINE_INDEX)
        if point.time >= self.gate_times.get((point.metric, engine), -1):
            self.gate_times[(point.metric, engine)] = point.time
            self.gate_readings[point.metric][engine] = point.value

    def _device_memory(self, point: Point) -> None:
        device = str(point.attributes.get(names.HW_ID_ATTRIBUTE, "gpu"))
        series = self.device_memory.setdefault(device, TimeBuckets(lambda a, b: max(a, b, key=lambda r: r[1])))
        series.add(point.time, (point.time, point.value))

    def _device_limit(self, point: Point) -> None:
        self.device_limit[str(point.attributes.get(names.HW_ID_ATTRIBUTE, "gpu"))] = point.value

    def _tier_blocks(self, point: Point) -> None:
        attributes = point.attributes
        key = (attributes.get(names.ENGINE_INDEX, 0), attributes.get(names.OFFLOAD_MEDIUM, ""),
               attributes.get(names.BLOCK_STATE, ""))  # fmt: skip
        series = self.tier.setdefault(key, TimeBuckets(lambda a, b: max(a, b, key=lambda r: r[1])))
        series.add(point.time, (point.time, point.value))

    def _projected(self, point: Point) -> None:
        scale = point.attributes.get(names.POOL_SCALE)
        if scale is None:
            return
        key = (point.attributes.get(names.ENGINE_INDEX, 0), float(scale))
        if point.time >= self.projected.get(key, (-1, 0))[0]:
            self.projected[key] = (point.time, point.value)

    def _tier_projected(self, point: Point) -> None:
        key = self._tier_scale_key(point)
        if key is not None and point.time >= self.tier_projected.get(key, (-1, 0))[0]:
            self.tier_projected[key] = (point.time, point.value)

    def _tier_projected_size(self, point: Point) -> None:
        key = self._tier_scale_key(point)
        if key is not None:
            self.tier_projected_size[key] = point.value

    @staticmethod
    def _tier_scale_key(point: Point) -> tuple | None:
        attributes = point.attributes
        scale = attributes.get(names.OFFLOAD_SCALE)
        if scale is None:
            return None
        return attributes.get(names.ENGINE_INDEX, 0), attributes.get(names.OFFLOAD_MEDIUM, ""), float(scale)

    def _held(self, point: Point) -> None:
        if names.OFFLOAD_MEDIUM in point.attributes:  # the offload tier's, not the GPU pool's
            return
        self.holder_names = self.holder_names or holder_names(point.attributes)
        series = self.held.setdefault(holder(point.attributes), TimeBuckets(lambda a, b: max(a, b, key=lambda r: r[1])))
        series.add(point.time, (point.time, point.value))

    def _occupancy(self, point: Point) -> None:
        if names.OFFLOAD_MEDIUM in point.attributes:
            return
        engines = self.occupancy.setdefault(holder(point.attributes), {})
        engines.setdefault(point.attributes.get(names.ENGINE_INDEX), CounterSeries()).add(point)

    def occupancy_totals(self) -> dict[str, float]:
        """Block-seconds by attribution series, summed over engines."""
        return {label: sum(s.total for s in engines.values()) for label, engines in self.occupancy.items()}

    def total(self, counter: str) -> float:
        """Summed over engines: the demo's table's ``counter_total``."""
        return sum(series.total for series in self.counters.get(counter, {}).values())

    def finish(self) -> MetricDigest:
        for engine in list(self._pending):
            self._flush(engine)
        return self


_HANDLERS = {
    names.BLOCKS: MetricDigest._blocks,
    names.BLOCKS_LIMIT: MetricDigest._limit,
    **{name: MetricDigest._counter for name in COUNTERS},
    **{name: MetricDigest._gate_reading for name in gate.CHECKED},
    names.GPU_MEMORY_USAGE: MetricDigest._device_memory,
    names.GPU_MEMORY_LIMIT: MetricDigest._device_limit,
    names.OFFLOAD_BLOCKS: MetricDigest._tier_blocks,
    names.PROJECTED_HIT_RATIO: MetricDigest._projected,
    names.OFFLOAD_PROJECTED_HIT_RATIO: MetricDigest._tier_projected,
    names.OFFLOAD_PROJECTED_SIZE: MetricDigest._tier_projected_size,
    names.HELD_BLOCKS: MetricDigest._held,
    names.OCCUPANCY: MetricDigest._occupancy,
}

OVERFLOW_LABEL = "other (over the series limit)"


def holder(attributes: dict) -> str:
    """An attribution series' label: the values of its attributes but the engine's, in the
    order of their names (``holder_names``)."""
    if attributes.get(names.METRIC_OVERFLOW):
        return OVERFLOW_LABEL
    return ", ".join(str(v) for k, v in sorted(attributes.items()) if k != names.ENGINE_INDEX) or "(all)"


def holder_names(attributes: dict) -> str:
    """What an attribution series' label is made of: its attributes' names."""
    return ", ".join(k for k in sorted(attributes) if k not in (names.ENGINE_INDEX, names.METRIC_OVERFLOW))


def read_metrics(path: Path) -> MetricDigest:
    digest = MetricDigest()
    for point in points(path, digest.lines):
        digest.add(point)
    return digest.finish()
