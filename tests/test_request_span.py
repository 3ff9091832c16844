"""The per-request span against vLLM's own ground truth, on the real scheduler."""

from __future__ import annotations

from opentelemetry.trace import SpanKind

from otel_kvcache import names

BLOCK_SIZE = 16


def _event_names(span):
    return [event.name for event in span.events]


def test_prefix_sharing_matches_vllm(engine, telemetry):
    first = engine.add(engine.make_request("first", prompt_len=100, shared_prefix=64))
    engine.run()
    later = [engine.add(engine.make_request(f"shared-{i}", prompt_len=90 + i, shared_prefix=64)) for i in range(4)]
    engine.run()

    spans = telemetry.span_by_request()
    truth = engine.truth
    assert set(spans) == {first.request_id, *(r.request_id for r in later)}
    for request in [first, *later]:
        span = spans[request.request_id]
        attrs = span.attributes
        rid = request.request_id
        assert span.kind is SpanKind.INTERNAL
        assert span.parent is None
        assert span.start_time == int(request.arrival_time * 1e9)
        assert attrs[names.INPUT_TOKENS] == request.num_prompt_tokens
        assert attrs[names.OUTPUT_TOKENS] == request.num_output_tokens
        assert attrs[names.CACHE_READ_INPUT_TOKENS] == truth.first_admission_cached_tokens[rid]
        assert attrs[names.BLOCK_SIZE] == BLOCK_SIZE
        assert attrs[names.BLOCKS_PEAK] == truth.peak_blocks[rid]
        assert attrs[names.BLOCKS_FREED] == truth.last_held_blocks[rid]
        # Full-attention blocks: every held block was either new or a prefix hit.
        assert attrs[names.BLOCKS_ALLOCATED] + attrs[names.BLOCKS_PREFIX_HIT] == truth.peak_blocks[rid]
        assert attrs[names.BLOCKS_PREFIX_HIT] * BLOCK_SIZE == truth.first_admission_cached_tokens[rid]
        assert attrs[names.PREEMPTIONS] == request.num_preemptions == 0
        assert attrs[names.FINISH_REASON] == str(request.get_finished_reason()) == "length"
        assert _event_names(span) == [names.EVENT_ADMITTED, names.EVENT_RELEASED]
        admitted, released = span.events
        assert admitted.attributes[names.EVENT_PREFIX_HIT_TOKENS] == truth.first_admission_cached_tokens[rid]
        assert released.attributes[names.BLOCKS] == truth.last_held_blocks[rid]

    # The later requests really hit the first one's prefix (4 full blocks of 16).
    assert all(truth.first_admission_cached_tokens[r.request_id] == 64 for r in later)
    assert telemetry.total(names.PREFIX_CACHE_QUERIES) == truth.prefix_queries
    assert telemetry.total(names.PREFIX_CACHE_HITS) == truth.prefix_hits


def test_span_is_child_of_the_requests_trace_headers(engine, telemetry):
    trace_id, parent_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    carrier = {"traceparent": f"00-{trace_id:032x}-{parent_id:016x}-01"}
    engine.add(engine.make_request("traced", prompt_len=40, trace_headers=carrier))
    engine.add(engine.make_request("untraced", prompt_len=40))
    engine.run()

    spans = telemetry.span_by_request()
    traced = spans["traced"]
    assert traced.context.trace_id == trace_id
    assert traced.parent.span_id == parent_id
    assert traced.parent.is_remote
    untraced = spans["untraced"]
    assert untraced.parent is None
    assert untraced.context.trace_id != trace_id


def test_aborted_requests_release_what_they_held(engine, telemetry):
    running = [engine.add(engine.make_request(f"run-{i}", prompt_len=70, max_tokens=200)) for i in range(3)]
    for _ in range(5):
        engine.step()
    waiting_only = engine.add(engine.make_request("never-scheduled", prompt_len=30))
    engine.abort(running[0].request_id, running[1].request_id, waiting_only.request_id)
    engine.run()

    spans = telemetry.span_by_request()
    for request in (running[0], running[1], waiting_only):
        attrs = spans[request.request_id].attributes
        assert attrs[names.FINISH_REASON] == str(request.get_finished_reason()) == "abort"
        assert attrs[names.BLOCKS_FREED] == engine.truth.last_held_blocks.get(request.request_id, 0)
        assert attrs[names.OUTPUT_TOKENS] == request.num_output_tokens
    assert spans[running[0].request_id].attributes[names.BLOCKS_FREED] > 0
    assert spans[waiting_only.request_id].attributes[names.BLOCKS_FREED] == 0
    assert spans[running[2].request_id].attributes[names.FINISH_REASON] == "length"
    # Everything went back: nothing is referenced any more.
    assert engine.pool_scan()["used"] == 0
    assert telemetry.blocks_by_state()["used"] == 0


def test_state_stays_bounded_over_many_requests(make_engine, telemetry):
    engine = make_engine(num_blocks=128)
    for wave in range(6):
        for i in range(50):
            engine.add(engine.make_request(f"w{wave}-{i}", prompt_len=20 + i % 17, max_tokens=3))
        engine.run()
    tracked = engine.scheduler._otel_kvcache_engine.requests
    assert tracked == {}
    assert len(telemetry.kv_spans()) == 300 == len(engine.requests)


def test_a_request_released_while_instrumentation_is_suppressed_gets_no_span(engine, telemetry):
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    engine.add(engine.make_request("quiet", prompt_len=20, max_tokens=3))
    with suppress_instrumentation():
        engine.run()
    engine.add(engine.make_request("heard", prompt_len=20, max_tokens=3))
    engine.run()
    assert set(telemetry.span_by_request()) == {"heard"}
    assert telemetry.blocks_by_state() == engine.pool_scan()  # the pool's accounting never paused
