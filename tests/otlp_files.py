"""OTLP JSON lines written as the collector's file exporter writes them, for report tests.

One line per export request: opentelemetry-proto's messages in the encoding of
``demo/otlp_sink.py`` (protobuf's JSON mapping, ids in hex). ``Run`` lays out a
small load: a pool that fills, a request preempted and resumed, an aborted one,
a leak finding, NVML readings and, optionally, the capacity what-if gauge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.message import Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AGGREGATION_TEMPORALITY_CUMULATIVE,
    Gauge,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from demo.otlp_sink import to_otlp_json
from otel_kvcache import names

T0 = 1_796_000_000_000_000_000
SECOND = 1_000_000_000


def value(v) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    return AnyValue(string_value=str(v))


def attrs(mapping: dict) -> list[KeyValue]:
    return [KeyValue(key=k, value=value(v)) for k, v in mapping.items()]


def event(name: str, at: float, **attributes) -> Span.Event:
    return Span.Event(time_unix_nano=T0 + int(at * SECOND), name=name, attributes=attrs(attributes))


def kv_span(request_id: str, trace: int, start: float, end: float, finish: str, events: list[Span.Event],
            more: dict | None = None, **span_attrs) -> Span:  # fmt: skip
    attributes = {
        **(more or {}),
        names.REQUEST_ID: request_id,
        names.INPUT_TOKENS: span_attrs.get("prompt", 64),
        names.CACHE_READ_INPUT_TOKENS: span_attrs.get("hit", 0),
        names.BLOCKS_PEAK: span_attrs.get("peak", 4),
        names.PREEMPTIONS: span_attrs.get("preemptions", 0),
        names.ALLOCATION_STALLS: span_attrs.get("stalls", 0),
        names.FINISH_REASON: finish,
    }
    return Span(
        trace_id=trace.to_bytes(16, "big"),
        span_id=trace.to_bytes(8, "big"),
        name=names.KV_REQUEST_SPAN,
        kind=Span.SPAN_KIND_INTERNAL,
        start_time_unix_nano=T0 + int(start * SECOND),
        end_time_unix_nano=T0 + int(end * SECOND),
        attributes=attrs(attributes),
        events=events,
    )


def traces_request(spans: list[Span], engine: int = 0) -> ExportTraceServiceRequest:
    resource = {names.PROCESS_ROLE: names.ROLE_ENGINE_CORE, names.ENGINE_INDEX: engine}
    return ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=Resource(attributes=attrs(resource)),
        scope_spans=[ScopeSpans(scope=InstrumentationScope(name=names.METER_SCOPE), spans=spans)],
    )])  # fmt: skip


def gauge(name: str, at: float, points: list[tuple[float, dict]]) -> Metric:
    data_points = [
        NumberDataPoint(time_unix_nano=T0 + int(at * SECOND), attributes=attrs(a), **_number(v)) for v, a in points
    ]
    return Metric(name=name, gauge=Gauge(data_points=data_points))


def counter(name: str, at: float, total: float, engine: int = 0, series: list[tuple[float, dict]] = ()) -> Metric:
    """A cumulative counter's reading: ``total``, or each of ``series`` (value, attributes)."""
    points = [
        NumberDataPoint(start_time_unix_nano=T0, time_unix_nano=T0 + int(at * SECOND), **_number(value),
                        attributes=attrs({names.ENGINE_INDEX: engine, **attributes}))
        for value, attributes in (series or [(total, {})])
    ]  # fmt: skip
    return Metric(name=name, sum=Sum(data_points=points, aggregation_temporality=AGGREGATION_TEMPORALITY_CUMULATIVE,
                                     is_monotonic=True))  # fmt: skip


def _number(v) -> dict:
    return {"as_int": v} if isinstance(v, int) else {"as_double": v}


def metrics_request(metrics: list[Metric], scope: str = names.METER_SCOPE) -> ExportMetricsServiceRequest:
    return ExportMetricsServiceRequest(resource_metrics=[ResourceMetrics(
        resource=Resource(attributes=attrs({names.PROCESS_ROLE: names.ROLE_ENGINE_CORE})),
        scope_metrics=[ScopeMetrics(scope=InstrumentationScope(name=scope), metrics=metrics)],
    )])  # fmt: skip


def line(request: Message) -> str:
    """One export request as the sink writes it."""
    return json.dumps(to_otlp_json(request), separators=(",", ":")) + "\n"


def write_lines(path: Path, requests: list[Message]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line(r) for r in requests))


@dataclass
class Run:
    """A small load on a 16-block pool, over six seconds."""

    with_what_if: bool = True
    pool: list[tuple[int, int, int]] = field(
        default_factory=lambda: [(0, 0, 16), (6, 2, 8), (12, 3, 1), (16, 0, 0), (5, 9, 2), (0, 10, 6)]
    )
    """(used, cached, free) at each second's export."""
    preemptions: list[int] = field(default_factory=lambda: [0, 0, 1, 2, 2, 2])
    stalls: list[int] = field(default_factory=lambda: [0, 0, 4, 9, 9, 9])
    evictions: list[int] = field(default_factory=lambda: [0, 0, 0, 3, 5, 5])
    hits: list[int] = field(default_factory=lambda: [0, 32, 64, 96, 96, 160])
    queries: list[int] = field(default_factory=lambda: [0, 64, 128, 256, 320, 320])
    zombies: list[int] = field(default_factory=lambda: [0, 0, 0, 0, 1, 1])
    tier: list[tuple[int, int]] = field(default_factory=lambda: [(0, 8), (3, 5), (6, 2), (8, 0), (8, 0), (5, 3)])
    """The offload tier's (used, free) at each second's export: its blocks are the first model's."""
    scales: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    tier_scales: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    tier_bytes: int = 8 * 2**20
    """The offload tier's bytes (scale 1 of its what-if)."""
    first_tier: bool = False
    """The tier's what-if as an engine with no tier exports it: a first tier's, without a medium."""
    models: tuple[str, ...] = ("llama", "adapter-x")
    """The attribution series: the first holds three quarters of the used blocks."""

    def spans(self) -> list[Span]:
        free_used = lambda free, used: {names.POOL_FREE_BLOCKS: free, names.POOL_USED_BLOCKS: used}  # noqa: E731
        return [
            kv_span("req-a", 1, 0.9, 2.5, "stop", [
                event(names.EVENT_ADMITTED, 1.0, **{names.BLOCKS: 4, names.EVENT_PREFIX_HIT_TOKENS: 0}, **free_used(12, 4)),
                event(names.EVENT_RELEASED, 2.5, **{names.BLOCKS: 6}, **free_used(4, 10)),
            ], peak=6),
            kv_span("req-b", 2, 1.2, 4.4, "length", [
                event(names.EVENT_ADMITTED, 1.3, **{names.BLOCKS: 5, names.EVENT_PREFIX_HIT_TOKENS: 32}, **free_used(7, 9)),
                event(names.EVENT_PREEMPTED, 2.2, **{names.BLOCKS: 6}, **free_used(1, 15)),
                event(names.EVENT_RESUMED, 3.1, **{names.BLOCKS: 6, names.EVENT_PREFIX_HIT_TOKENS: 64}, **free_used(2, 14)),
                event(names.EVENT_PREEMPTED, 3.3, **{names.BLOCKS: 7}, **free_used(0, 16)),
                event(names.EVENT_RESUMED, 3.6, **{names.BLOCKS: 7, names.EVENT_PREFIX_HIT_TOKENS: 96}, **free_used(3, 13)),
                event(names.EVENT_RELEASED, 4.4, **{names.BLOCKS: 8}, **free_used(11, 5)),
            ], more={names.SESSION_TURN_GAP: 40.0, names.PREFIX_EVICTED_TOKENS: 32}, prompt=100, hit=96, peak=8,
               preemptions=2, stalls=9),
            kv_span("req-c", 3, 2.0, 2.6, "abort", [
                event(names.EVENT_ADMITTED, 2.1, **{names.BLOCKS: 1, names.EVENT_PREFIX_HIT_TOKENS: 0}, **free_used(0, 16)),
                event(names.EVENT_RELEASED, 2.6, **{names.BLOCKS: 1}, **free_used(4, 12)),
            ], prompt=20, peak=1),
            kv_span("req-d", 4, 3.5, 4.9, "stop", [
                event(names.EVENT_ADMITTED, 3.9, **{names.BLOCKS: 3, names.EVENT_PREFIX_HIT_TOKENS: 48}, **free_used(1, 15)),
                event(names.EVENT_RELEASED, 4.8, **{names.BLOCKS: 3}, **free_used(9, 7)),
                event(names.EVENT_LEAK, 4.8, **{names.REQUEST_ID: "req-d", names.BLOCKS: 2}),
            ], more={names.SESSION_TURN_GAP: 0.3, names.PREFIX_EVICTED_TOKENS: 0}, prompt=64, hit=48, peak=3),
        ]

    def finding(self) -> Span:
        """A zombie finding about req-a, on a finding span after its own span ended."""
        span = kv_span("req-a", 1, 4.5, 4.5, "stop", [
            event(names.EVENT_ZOMBIE, 4.5, **{names.REQUEST_ID: "req-a", names.BLOCKS: 2}),
        ])  # fmt: skip
        span.name = names.FINDING_SPAN
        del span.attributes[:]
        return span

    def metrics(self) -> list[ExportMetricsServiceRequest]:
        requests = []
        for second, (used, cached, free) in enumerate(self.pool):
            engine = {names.ENGINE_INDEX: 0}
            metrics = [
                gauge(names.BLOCKS, second, [(n, {**engine, names.BLOCK_STATE: state})
                                             for n, state in zip((used, cached, free), names.BLOCK_STATES)]),
                gauge(names.BLOCKS_LIMIT, second, [(16, engine)]),
                counter(names.PREEMPTIONS, second, self.preemptions[second]),
                counter(names.ALLOCATION_STALLS, second, self.stalls[second]),
                counter(names.EVICTIONS, second, self.evictions[second]),
                counter(names.PREFIX_CACHE_HITS, second, self.hits[second]),
                counter(names.PREFIX_CACHE_QUERIES, second, self.queries[second]),
                gauge(names.ORPHANED_BLOCKS, second, [(0, engine)]),
                gauge(names.ZOMBIE_REQUESTS, second, [(self.zombies[second], engine)]),
                gauge(names.TAIL_SLACK_RATIO, second, [(0.1, engine)]),
                counter(names.OCCUPANCY, second, 0, series=[
                    (float(3 * second * (k + 1)), {names.MODEL: model}) for k, model in enumerate(self.models)]),
            ]  # fmt: skip
            tier_used, tier_free = self.tier[second]
            tier = {**engine, names.OFFLOAD_MEDIUM: "cpu"}
            metrics.append(gauge(names.OFFLOAD_BLOCKS, second, [
                (tier_used, {**tier, names.BLOCK_STATE: names.BLOCK_STATE_USED}),
                (tier_free, {**tier, names.BLOCK_STATE: names.BLOCK_STATE_FREE}),
            ]))  # fmt: skip
            if used:  # no series while nothing is held
                metrics.append(gauge(names.HELD_BLOCKS, second, [
                    (used * 0.75, {**engine, names.MODEL: self.models[0]}),
                    (used * 0.25, {**engine, names.MODEL: self.models[1]}),
                    (float(tier_used), {**tier, names.MODEL: self.models[0]}),  # the GPU pool's holders: not these
                ]))  # fmt: skip
            if self.with_what_if and second >= 3:
                metrics.append(gauge(names.PROJECTED_HIT_RATIO, second, [
                    (min(1.0, 0.3 + 0.1 * second * scale ** 0.5), {**engine, names.POOL_SCALE: scale})
                    for scale in self.scales
                ]))  # fmt: skip
                projected = engine if self.first_tier else tier
                metrics.append(gauge(names.OFFLOAD_PROJECTED_HIT_RATIO, second, [
                    (min(1.0, 0.4 + 0.05 * second * scale ** 0.5), {**projected, names.OFFLOAD_SCALE: scale})
                    for scale in self.tier_scales
                ]))  # fmt: skip
                metrics.append(gauge(names.OFFLOAD_PROJECTED_SIZE, second, [
                    (scale * self.tier_bytes, {**projected, names.OFFLOAD_SCALE: scale}) for scale in self.tier_scales
                ]))  # fmt: skip
            requests.append(metrics_request(metrics))
            device = {names.HW_ID_ATTRIBUTE: "GPU-0", names.HW_TYPE_ATTRIBUTE: names.HW_TYPE_GPU}
            requests.append(metrics_request([
                gauge(names.GPU_MEMORY_USAGE, second + 0.1, [(int(120.5 * 2**30), device)]),
                gauge(names.GPU_MEMORY_LIMIT, second + 0.1, [(141 * 2**30, device)]),
            ], scope="otel_kvcache.gpu"))  # fmt: skip
        return requests

    def write(self, directory: Path) -> Path:
        write_lines(directory / "traces.jsonl", [traces_request(self.spans()[:2]),
                                                 traces_request(self.spans()[2:] + [self.finding()])])  # fmt: skip
        write_lines(directory / "metrics.jsonl", self.metrics())
        return directory
