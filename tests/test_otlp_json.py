"""OTLP JSON lines read through ``otlp_json``, from files the real export path wrote: the SDK's
OTLP/gRPC exporter into the demo's sink, which writes each request as the collector's file
exporter does (hex ids)."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

from demo.otlp_sink import OTLPSink
from otel_kvcache import names
from otel_kvcache.commands import otlp_json


def _spans(path):
    return [
        span
        for request in otlp_json.requests(path, ExportTraceServiceRequest)
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


def test_trace_and_span_ids_are_read_as_the_sdk_made_them(tmp_path):
    sink = OTLPSink(tmp_path).start()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sink.endpoint, insecure=True)))
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=sink.endpoint, insecure=True), 3_600_000)
    meter_provider = MeterProvider(metric_readers=[reader])
    counter = meter_provider.get_meter(names.METER_SCOPE).create_counter(names.PREEMPTIONS)
    tracer = tracer_provider.get_tracer(names.METER_SCOPE)
    try:
        with tracer.start_as_current_span("parent") as parent:
            link = trace.Link(parent.get_span_context())
            with tracer.start_as_current_span(names.KV_REQUEST_SPAN, links=[link]) as child:
                counter.add(1)  # sampled in a span: an exemplar with its ids
        meter_provider.force_flush()
    finally:
        meter_provider.shutdown()
        tracer_provider.shutdown()
        sink.stop()
    parent_ids, child_ids = parent.get_span_context(), child.get_span_context()
    trace_id, span_id = child_ids.trace_id.to_bytes(16, "big"), child_ids.span_id.to_bytes(8, "big")
    assert f'"traceId":"{child_ids.trace_id:032x}"' in (tmp_path / "traces.jsonl").read_text()  # hex in the file

    spans = {span.name: span for span in _spans(tmp_path / "traces.jsonl")}
    assert set(spans) == {"parent", names.KV_REQUEST_SPAN}
    read = spans[names.KV_REQUEST_SPAN]
    assert (read.trace_id, read.span_id) == (trace_id, span_id)
    assert read.parent_span_id == parent_ids.span_id.to_bytes(8, "big") == spans["parent"].span_id
    assert [(link.trace_id, link.span_id) for link in read.links] == [(trace_id, parent_ids.span_id.to_bytes(8, "big"))]
    [kv_span] = otlp_json.kv_spans(tmp_path / "traces.jsonl")
    assert kv_span["trace_id"] == f"{child_ids.trace_id:032x}"

    request = next(otlp_json.requests(tmp_path / "metrics.jsonl", ExportMetricsServiceRequest))  # the flush's
    [metric] = request.resource_metrics[0].scope_metrics[0].metrics
    [exemplar] = metric.sum.data_points[0].exemplars
    assert (exemplar.trace_id, exemplar.span_id) == (trace_id, span_id)


VALUES = {
    "an.array": ["a", "b"],
    "a.kvlist": {"inner": 7, "list": [1.5, True]},
    "some.bytes": b"\x00\xffkv",
    "an.int": 2**62,
    "a.double": 0.25,
}


def test_every_attribute_value_kind_is_read(tmp_path):
    sink = OTLPSink(tmp_path).start()
    # The SDK's tracer keeps only primitive values and their arrays; OTLP carries any value, as a
    # span of another SDK or a collector's processor may: given to the real exporter as such.
    span = ReadableSpan(name=names.KV_REQUEST_SPAN, context=trace.SpanContext(1, 2, False), attributes=VALUES,
                        start_time=1, end_time=2)  # fmt: skip
    try:
        assert OTLPSpanExporter(endpoint=sink.endpoint, insecure=True).export([span]) == SpanExportResult.SUCCESS
    finally:
        sink.stop()
    [read] = _spans(tmp_path / "traces.jsonl")
    assert otlp_json.attributes(read.attributes) == VALUES


def test_a_line_that_is_not_an_export_request_is_counted_and_skipped(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text('{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x", "traceId": "0a"}]}]}]}\n'
                    '{"resourceMetrics": []}\n'  # a metrics request in a traces file
                    '{"resourceSpans": [{"resource"\n'  # cut mid-write
                    '{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "y", "traceId": "not hex"}]}]}]}\n')  # fmt: skip
    count = otlp_json.LineCount()
    assert [span.name for request in otlp_json.requests(path, ExportTraceServiceRequest, count)
            for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans] == ["x"]  # fmt: skip
    assert (count.requests, count.skipped) == (1, 3)
