"""Prometheus names and text, held to what the real OpenTelemetry Prometheus exporter writes."""

from __future__ import annotations

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import AggregationTemporality, Histogram, Sum
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from otel_kvcache import names
from otel_kvcache.commands import gate, prometheus_names

from conftest import prometheus_scrape_of_a_run


def test_the_derived_names_are_those_the_real_exporter_writes(make_engine, telemetry):
    text, metrics = prometheus_scrape_of_a_run(make_engine, telemetry)
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    exported = {s.name for s in samples}
    labels = {label for s in samples for label in s.labels}
    assert len(metrics) > 30
    for m in metrics:
        counter = (
            isinstance(m.data, Sum)
            and m.data.is_monotonic
            and m.data.aggregation_temporality == AggregationTemporality.CUMULATIVE
        )
        name = prometheus_names.metric(m.name, m.unit, counter=counter)
        assert (name + "_count" if isinstance(m.data, Histogram) else name) in exported, (m.name, m.unit, name)
        for point in m.data.data_points:
            assert {prometheus_names.label(key) for key in point.attributes} <= labels, (m.name, point.attributes)
    # The names with a unit spelled out, each of a kind.
    assert prometheus_names.metric(names.KV_MEMORY_USAGE, "By") == "vllm_kv_cache_memory_usage_bytes"
    assert prometheus_names.metric(names.EVICTION_AGE, "s", counter=True) in exported


MODEL = 'C:\\models\\"llama" {x="}"}'
"""A label value with an escaped quote, a backslash and braces."""


def test_the_gate_reads_label_values_with_quotes_and_backslashes():
    registry = CollectorRegistry()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry)])
    meter = provider.get_meter(names.METER_SCOPE)
    labels = {names.ENGINE_INDEX: 1, names.MODEL: MODEL}
    for name, unit, value in (
        (names.ORPHANED_BLOCKS, "{block}", 3),
        (names.ZOMBIE_REQUESTS, "{request}", 0),
        (names.TAIL_SLACK_RATIO, "1", 0.25),
    ):
        meter.create_observable_gauge(name, [lambda _, v=value: [Observation(v, labels)]], unit=unit)
    meter.create_observable_gauge(names.PROJECTED_HIT_RATIO, [lambda _: [
        Observation(0.4, {**labels, names.POOL_SCALE: 1.0}), Observation(0.7, {**labels, names.POOL_SCALE: 2.0}),
    ]], unit="1")  # fmt: skip
    try:
        text = generate_latest(registry).decode()
    finally:
        provider.shutdown()
    assert '\\"llama\\"' in text and "\\\\models" in text  # the exposition escapes them

    model_label = prometheus_names.label(names.MODEL)
    assert {s.labels[model_label] for s in gate.prometheus_samples(text) if model_label in s.labels} == {MODEL}
    readings = gate.readings_from_prometheus(text)
    assert readings == {names.ORPHANED_BLOCKS: {"1": 3.0}, names.ZOMBIE_REQUESTS: {"1": 0.0},
                        names.TAIL_SLACK_RATIO: {"1": 0.25}}  # fmt: skip
    assert gate.evaluate(readings, gate.Tolerances()) == ["engine 1: orphaned blocks 3 > tolerance 0"]
    assert gate.hit_gains_from_prometheus(text) == {"1": 0.7 - 0.4}
