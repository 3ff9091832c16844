"""No client can cost another its telemetry: what a client chooses is bounded, exports are
bounded in bytes, and what is lost is counted, also while the engine is idle.

The real scheduler in-process, spans built in the real helper process and exported over
OTLP/gRPC to a real receiver (gRPC's default 4 MiB message limit, the Collector's too,
unless a test lowers it), against vLLM's own Request objects."""

from __future__ import annotations

import os
import time

import pytest
from conftest import Telemetry, export_through_a_helper
from demo.otlp_sink import OTLPSink, attributes_of

from otel_kvcache import VLLMKVCacheInstrumentor, names

TRACE_ID, PARENT_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"
MiB = 1 << 20


@pytest.fixture
def receiver(request, monkeypatch):
    """A receiver, and an environment that has the helper export to it."""
    sink = OTLPSink(**getattr(request, "param", {})).start()
    export_through_a_helper(monkeypatch, sink.endpoint)
    yield sink
    sink.stop()


@pytest.fixture
def instrumented():
    """This process keeps the engine's metrics; the spans are built in the helper."""
    telemetry = Telemetry()
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=telemetry.meter_provider)
    yield telemetry
    instrumentor.uninstrument()


def _engine(model_config, **options):
    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    engine = EngineHarness(make_scheduler(model_config, **options))
    return engine, engine.scheduler._otel_kvcache_engine.record_sink


def _kv_spans(sink: OTLPSink) -> dict[str, object]:
    return {
        attributes_of(span.attributes)[names.REQUEST_ID]: span
        for _, span in sink.spans()
        if span.name == names.KV_REQUEST_SPAN
    }


def _cut_as_documented(value: str, limit: int) -> str:
    """The README's rule, written out: the first limit - 1 characters, then "…"."""
    return value[: limit - 1] + "…" if len(value) > limit else value


@pytest.mark.parametrize("sdk_limit", [None, 64], ids=["default", "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT=64"])
def test_hostile_values_are_bounded_and_cost_nobody_their_span(
    model_config, receiver, monkeypatch, sdk_limit
):
    """A 6 MB request id, a malformed traceparent with a 1 MB tracestate, and ordinary
    requests around them: every span arrives, each hostile value cut where it entered,
    its length as vLLM holds it beside it."""
    if sdk_limit:
        monkeypatch.setenv("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", str(sdk_limit))
    limit = sdk_limit or 256
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=Telemetry().meter_provider)
    try:
        engine, exporter = _engine(model_config, num_blocks=64)
        requests = [engine.add(engine.make_request(f"before-{i}", prompt_len=40, max_tokens=4)) for i in range(3)]
        huge_id = engine.add(engine.make_request("h" * 6_000_000, prompt_len=40, max_tokens=4))
        bad_context = engine.add(
            engine.make_request(
                "bad-context",
                prompt_len=40,
                max_tokens=4,
                trace_headers={"traceparent": "00-not-a-trace-parent", "tracestate": "k=" + "v" * MiB},
            )
        )
        ordinary = engine.add(
            engine.make_request("with-parent", prompt_len=40, max_tokens=4, trace_headers={"traceparent": TRACEPARENT})
        )
        requests += [huge_id, bad_context, ordinary]
        requests += [engine.add(engine.make_request(f"after-{i}", prompt_len=40, max_tokens=4)) for i in range(3)]
        engine.run()
        assert exporter.close(wait=30)
    finally:
        instrumentor.uninstrument()

    assert all(r.is_finished() and r.num_output_tokens == 4 for r in requests)
    assert exporter.dropped == 0
    spans = _kv_spans(receiver)
    assert set(spans) == {_cut_as_documented(r.request_id, limit) for r in requests}
    hostile = attributes_of(spans[_cut_as_documented(huge_id.request_id, limit)].attributes)
    assert len(hostile[names.REQUEST_ID]) == limit
    assert hostile[names.REQUEST_ID].endswith("…")
    assert hostile[names.REQUEST_ID_ORIGINAL_LENGTH] == len(huge_id.request_id) == 6_000_000
    assert hostile[names.OUTPUT_TOKENS] == huge_id.num_output_tokens
    assert names.REQUEST_ID_ORIGINAL_LENGTH not in attributes_of(spans["after-0"].attributes)
    # The malformed context starts a trace of its own; the ordinary one joins its parent.
    assert spans["bad-context"].parent_span_id == b""
    assert spans["with-parent"].trace_id == TRACE_ID.to_bytes(16, "big")
    assert spans["with-parent"].parent_span_id == PARENT_ID.to_bytes(8, "big")
    assert max(request.ByteSize() for request in receiver.requests["traces"]) < MiB


def test_a_batch_larger_than_the_receiver_takes_arrives_in_parts(model_config, receiver, instrumented, monkeypatch):
    """Forty spans of 150 kB each (client values let through by a raised bound): 6 MB in
    one batch, more than the receiver's 4 MiB. Every span arrives, in requests of at most
    OTEL_KVCACHE_EXPORT_MAX_BYTES."""
    monkeypatch.setenv("OTEL_KVCACHE_CLIENT_VALUE_LENGTH_LIMIT", "200000")
    engine, exporter = _engine(model_config, num_blocks=512, max_num_seqs=64)
    requests = [
        engine.add(engine.make_request(f"{i:02d}" + "x" * 150_000, prompt_len=20, max_tokens=2)) for i in range(40)
    ]
    engine.run()  # idle at the end: one frame, one batch in the helper
    assert exporter.close(wait=60)

    assert exporter.dropped == 0
    assert set(_kv_spans(receiver)) == {r.request_id for r in requests}
    sizes = [request.ByteSize() for request in receiver.requests["traces"]]
    assert sum(sizes) > 4 * MiB
    assert max(sizes) <= 3 * MiB


@pytest.mark.parametrize("receiver", [{"max_message_bytes": MiB}], indirect=True)
def test_a_span_the_receiver_refuses_alone_is_the_only_one_lost_and_is_counted_while_idle(
    model_config, receiver, instrumented, monkeypatch
):
    """A receiver that takes 1 MiB, and one 1.5 MB span among ordinary ones in one batch:
    that span alone is dropped, the others arrive. The engine is idle by then and takes
    no step: the drop shows at the next metric collection all the same."""
    telemetry = instrumented
    monkeypatch.setenv("OTEL_KVCACHE_CLIENT_VALUE_LENGTH_LIMIT", str(2_000_000))
    engine, exporter = _engine(model_config, num_blocks=256, max_num_seqs=32)
    ordinary = [engine.add(engine.make_request(f"ordinary-{i}", prompt_len=20, max_tokens=2)) for i in range(10)]
    too_large = engine.add(engine.make_request("L" * 1_500_000, prompt_len=20, max_tokens=2))
    engine.run()

    deadline = time.monotonic() + 20
    while telemetry.total(names.TELEMETRY_DROPPED) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)  # nothing touches the engine or its exporter here
    assert telemetry.total(names.TELEMETRY_DROPPED, **{names.STAGE: names.STAGE_EXPORT}) == 1
    assert telemetry.total(names.TELEMETRY_DROPPED) == 1
    assert set(_kv_spans(receiver)) == {r.request_id for r in ordinary}
    assert too_large.is_finished() and too_large.num_output_tokens == 2
    assert exporter.close(wait=30)


@pytest.mark.parametrize("receiver", [{"refuse": True}], indirect=True)
def test_an_idle_engine_counts_what_its_helper_failed_to_export(model_config, receiver, instrumented, monkeypatch):
    """A collector refusing every span, for which the helper holds them a second; the
    engine goes idle after its requests and nothing calls it again: the drops are counted
    within seconds of the hold's end (the helper's holding thread tells the engine, which
    looks while its helper holds spans)."""
    monkeypatch.setenv("OTEL_KVCACHE_EXPORT_HOLD_SECONDS", "1")
    telemetry = instrumented
    engine, exporter = _engine(model_config, num_blocks=256)
    requests = [engine.add(engine.make_request(f"r{i}", prompt_len=40, max_tokens=4)) for i in range(7)]
    engine.run()
    went_idle = time.monotonic()
    while telemetry.total(names.TELEMETRY_DROPPED) < len(requests) and time.monotonic() < went_idle + 30:
        time.sleep(0.1)
    counted_after = time.monotonic() - went_idle
    assert telemetry.total(names.TELEMETRY_DROPPED, **{names.STAGE: names.STAGE_EXPORT}) == len(requests)
    assert receiver.refused >= len(requests)  # each reached the collector, maybe again after a while held
    assert counted_after < 15, f"counted {counted_after:.1f} s after the engine went idle"  # 1 s held, a try or two
    exporter.close(wait=30)


@pytest.mark.parametrize("receiver", [{"max_message_bytes": MiB}], indirect=True)
def test_after_the_engine_exits_the_helper_counts_what_it_could_not_send(
    model_config, receiver, instrumented, monkeypatch
):
    """The engine hands everything over at its exit and reads no more (``close()`` as at
    exit): a span refused after that is counted by the helper, in the metrics it exports
    with the engine's resource before it exits."""
    monkeypatch.setenv("OTEL_KVCACHE_CLIENT_VALUE_LENGTH_LIMIT", str(2_000_000))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    telemetry = instrumented
    engine, exporter = _engine(model_config, num_blocks=256, max_num_seqs=32)
    ordinary = [engine.add(engine.make_request(f"ordinary-{i}", prompt_len=20, max_tokens=2)) for i in range(6)]
    engine.add(engine.make_request("L" * 1_500_000, prompt_len=20, max_tokens=2))
    engine.run()
    helper = exporter.helper_pid or _wait_for_pid(exporter)
    exporter.close()  # as at the engine's exit: no wait
    deadline = time.monotonic() + 30
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(helper)

    counted_by_helper = sum(
        point.as_int
        for resource, metric in receiver.metrics(names.TELEMETRY_DROPPED)
        if resource["process.pid"] == os.getpid()
        for point in metric.sum.data_points
        if attributes_of(point.attributes)[names.STAGE] == names.STAGE_EXPORT
    )
    counted_by_engine = telemetry.total(names.TELEMETRY_DROPPED, **{names.STAGE: names.STAGE_EXPORT})
    assert counted_by_engine + counted_by_helper == 1
    assert set(_kv_spans(receiver)) == {r.request_id for r in ordinary}


def _wait_for_pid(exporter, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while exporter.helper_pid is None and time.monotonic() < deadline:
        time.sleep(0.05)
        exporter.flush()
    return exporter.helper_pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
