"""Spans built in the helper process, exported over real OTLP/gRPC, against vLLM's ground truth."""

from __future__ import annotations

import os
import time
from types import MappingProxyType

import pytest
from conftest import Telemetry, export_through_a_helper
from demo.otlp_sink import OTLPSink, attributes_of

from otel_kvcache import VLLMKVCacheInstrumentor, names
from otel_kvcache.export.helper_pipe import HelperPipe

TRACE_ID, PARENT_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7


@pytest.fixture
def helper_telemetry(helper_exports_to):
    """Instrumented with spans through the helper; this process keeps the engine's metrics."""
    telemetry = Telemetry()
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=telemetry.meter_provider)
    yield telemetry
    instrumentor.uninstrument()


def helper_pid(exporter: HelperPipe, timeout: float = 30) -> int:
    """The helper's pid, once its first acknowledgement has come."""
    deadline = time.monotonic() + timeout
    while exporter.helper_pid is None and time.monotonic() < deadline:
        exporter.flush()
        time.sleep(0.05)
    assert exporter.helper_pid is not None, "the helper never said its pid"
    return exporter.helper_pid


class HeaderValue(str):
    """A header value in a ``str`` subclass, as a web framework may hand it over (``marshal``
    cannot write one: the record is written again with plain strings, not dropped)."""


@pytest.fixture
def helper_exports_to(monkeypatch):
    """The helper's SDK comes from the environment, as under opentelemetry-instrument."""
    sink = OTLPSink().start()
    export_through_a_helper(monkeypatch, sink.endpoint, OTEL_BSP_SCHEDULE_DELAY="100")
    yield sink
    sink.stop()


def test_spans_and_histograms_from_the_helper_match_vllm(model_config, helper_exports_to):
    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    sink = helper_exports_to
    telemetry = Telemetry()  # the engine process keeps only the observable instruments
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=telemetry.meter_provider)
    try:
        engine = EngineHarness(make_scheduler(model_config, num_blocks=24))
        headers = {"traceparent": f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"}
        # Any mapping vLLM may hold the headers in, not only a dict, and values in str subclasses.
        held_as = [MappingProxyType(headers), {name: HeaderValue(value) for name, value in headers.items()}]
        requests = [
            engine.add(
                engine.make_request(
                    f"chat-{i}",
                    prompt_len=40 + 8 * i,
                    shared_prefix=32,
                    max_tokens=90,
                    trace_headers=held_as[i] if i < len(held_as) else headers,
                )
            )
            for i in range(6)
        ]
        engine.run()
        exporter = engine.scheduler._otel_kvcache_engine.record_sink
        assert isinstance(exporter, HelperPipe)
        assert exporter.close(wait=30)  # the helper gets EOF, flushes its SDK and exits
    finally:
        instrumentor.uninstrument()

    assert exporter.dropped == 0
    assert telemetry.kv_spans() == []  # nothing was built in this process
    spans = {
        attributes_of(span.attributes)[names.REQUEST_ID]: (resource, span)
        for resource, span in sink.spans()
        if span.name == names.KV_REQUEST_SPAN
    }
    assert set(spans) == {r.request_id for r in requests}
    assert sum(r.num_preemptions for r in requests) > 0, "the workload must preempt to mean anything"
    for request in requests:
        resource, span = spans[request.request_id]
        attrs = attributes_of(span.attributes)
        # The helper speaks for this process.
        assert resource["process.pid"] == os.getpid()
        assert span.trace_id == TRACE_ID.to_bytes(16, "big")
        assert span.parent_span_id == PARENT_ID.to_bytes(8, "big")
        assert span.start_time_unix_nano == int(request.arrival_time * 1e9)
        assert attrs[names.PREEMPTIONS] == request.num_preemptions
        assert attrs[names.OUTPUT_TOKENS] == request.num_output_tokens
        assert attrs[names.INPUT_TOKENS] == request.num_prompt_tokens
        assert attrs[names.FINISH_REASON] == str(request.get_finished_reason())
        assert attrs[names.BLOCKS_PEAK] == engine.truth.peak_blocks[request.request_id]
        assert attrs[names.BLOCKS_FREED] == engine.truth.last_held_blocks[request.request_id]
        events = [event.name for event in span.events]
        assert events.count(names.EVENT_PREEMPTED) == request.num_preemptions

    [(_, histogram)] = list(sink.metrics(names.REQUEST_BLOCKS))[-1:]
    [point] = histogram.histogram.data_points
    assert point.count == len(requests)
    assert point.sum == sum(engine.truth.peak_blocks[r.request_id] for r in requests)
    # The engine-side counters still come from this process.
    assert telemetry.total(names.PREEMPTIONS) == sum(r.num_preemptions for r in requests)


@pytest.mark.parametrize("layout", [None, "mamba-finer-attention"], ids=["one-group", "hybrid"])
def test_the_helper_finds_each_requests_miss_reasons_as_vllm_missed(
    model_config, helper_exports_to, monkeypatch, layout
):
    """The history of freed blocks is kept in the helper, from the frees and missed lookups
    the engine hands it (and, on a hybrid model, where vLLM could resume): its spans'
    evicted and cold tokens add up to the engine's counters, whose three reasons add up to
    vLLM's own misses."""
    import prefix_stream
    from engine_harness import EngineHarness
    from harness.scheduler import LAYOUTS, make_scheduler

    def replayed():
        scheduler = make_scheduler(
            model_config, num_blocks=prefix_stream.POOL_BLOCKS, max_num_seqs=32, layout=LAYOUTS.get(layout)
        )
        return prefix_stream.replay(EngineHarness(scheduler))

    sink = helper_exports_to
    telemetry = Telemetry()
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=telemetry.meter_provider)
    try:
        engine = replayed()
        exporter = engine.scheduler._otel_kvcache_engine.record_sink
        assert isinstance(exporter, HelperPipe)
        assert exporter.close(wait=30)
        misses = {
            reason: telemetry.total(names.PREFIX_CACHE_MISSES, **{names.MISS_REASON: reason})
            for reason in (names.MISS_EVICTED, names.MISS_COLD, names.MISS_UNCACHEABLE)
        }
    finally:
        instrumentor.uninstrument()

    assert exporter.dropped == 0
    assert sum(misses.values()) == engine.truth.prefix_queries - engine.truth.prefix_hits
    assert engine.events.removed_hashes and misses[names.MISS_EVICTED]  # vLLM evicted: some misses say so
    spans = [attributes_of(span.attributes) for _, span in sink.spans() if span.name == names.KV_REQUEST_SPAN]
    assert len(spans) == len(engine.requests)  # every request's span, from the helper
    assert sum(a[names.PREFIX_EVICTED_TOKENS] for a in spans) == misses[names.MISS_EVICTED]
    assert sum(a[names.PREFIX_COLD_TOKENS] for a in spans) == misses[names.MISS_COLD]
    assert sum(a[names.PREFIX_EVICTED_TOKENS] > 0 for a in spans) > 1

    # Request by request, what the engine finds itself where it builds the spans.
    monkeypatch.setenv("OTEL_KVCACHE_EXPORTER_PROCESS", "off")
    in_process = Telemetry()
    instrumentor.instrument(tracer_provider=in_process.tracer_provider, meter_provider=in_process.meter_provider)
    try:
        again = replayed()
    finally:
        instrumentor.uninstrument()
    assert again.truth.prefix_hits == engine.truth.prefix_hits  # vLLM did the same again
    reasons = (names.PREFIX_EVICTED_TOKENS, names.PREFIX_COLD_TOKENS)
    from_the_helper = {a[names.REQUEST_ID]: tuple(a[r] for r in reasons) for a in spans}
    found_here = {s.attributes[names.REQUEST_ID]: tuple(s.attributes[r] for r in reasons) for s in in_process.kv_spans()}
    assert from_the_helper == found_here


def test_an_idle_engine_hands_its_whole_backlog_to_the_helper(model_config, helper_exports_to):
    """More finished requests than the default 64 kB pipe holds: when the engine goes
    idle, all of them reach the backend, not one pipe-full (the rest would wait
    for the next request, or the exit)."""
    import time

    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    sink = helper_exports_to
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=Telemetry().meter_provider)
    try:
        engine = EngineHarness(make_scheduler(model_config, num_blocks=512, max_num_seqs=256))
        requests = [engine.add(engine.make_request(f"burst-{i:04d}", prompt_len=20, max_tokens=2)) for i in range(1200)]
        engine.run()
        exporter = engine.scheduler._otel_kvcache_engine.record_sink
        assert exporter.dropped == 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            received = {
                attributes_of(span.attributes)[names.REQUEST_ID]
                for _, span in sink.spans()
                if span.name == names.KV_REQUEST_SPAN
            }
            if len(received) == len(requests):
                break
            time.sleep(0.2)
    finally:
        instrumentor.uninstrument()
    assert received == {r.request_id for r in requests}
    assert all(r.num_output_tokens == 2 for r in requests)
    assert exporter.close(wait=30)


def test_a_busy_engine_hands_over_without_waiting_and_the_pipes_thread_sends_it(
    model_config, helper_exports_to, monkeypatch
):
    """While the engine steps, a hand-over costs it a swap of lists: with the pipe's lock
    held elsewhere all along (as the pipe's thread holds it through a long marshal), its
    steps and hand-overs go on; once the lock is let go, the pipe's thread alone sends
    what they handed over, and every finished request's span arrives, the engine untouched."""
    import threading

    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    from otel_kvcache.export import helper_pipe

    monkeypatch.setattr(helper_pipe, "FLUSH_SECONDS", 0.0)  # a hand-over due at every step
    sink = helper_exports_to
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=Telemetry().meter_provider)
    try:
        engine = EngineHarness(make_scheduler(model_config, num_blocks=512, max_num_seqs=64))
        exporter = engine.scheduler._otel_kvcache_engine.record_sink
        helper_pid(exporter)
        running = engine.add(engine.make_request("running", prompt_len=40, max_tokens=200))  # never idle
        finished = [engine.add(engine.make_request(f"done-{i}", prompt_len=40, max_tokens=4)) for i in range(20)]
        stepping = threading.Thread(target=lambda: [engine.step() for _ in range(30)])
        with exporter._lock:
            stepping.start()
            stepping.join(timeout=60)
            assert not stepping.is_alive(), "the engine waited for the pipe's lock"
            assert all(r.is_finished() for r in finished) and not running.is_finished()
        expected = {r.request_id for r in finished}
        deadline = time.monotonic() + 20
        while _kv_span_ids(sink) != expected and time.monotonic() < deadline:
            time.sleep(0.1)  # nothing touches the engine or its exporter here
        assert _kv_span_ids(sink) == expected
        assert exporter.dropped == 0
        engine.run()
    finally:
        instrumentor.uninstrument()
    assert exporter.close(wait=30)


def test_a_helper_that_stops_reading_costs_spans_never_memory(model_config, helper_exports_to, monkeypatch):
    """A helper that falls behind (here: stopped) leaves frames unread in the engine;
    past MAX_BUFFERED_BYTES of them, what a new frame would carry is dropped and
    counted, and vLLM runs on. Every request's span is exported or counted."""
    import fcntl
    import signal

    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    from otel_kvcache.export import helper_pipe

    monkeypatch.setattr(helper_pipe, "MAX_BUFFERED_BYTES", 0)  # one unread frame is too many
    sink = helper_exports_to
    telemetry = Telemetry()
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=telemetry.meter_provider)
    try:
        engine = EngineHarness(make_scheduler(model_config, num_blocks=512, max_num_seqs=64))
        exporter = engine.scheduler._otel_kvcache_engine.record_sink
        fcntl.fcntl(exporter._helper.fd, fcntl.F_SETPIPE_SZ, 4096)  # a page: a few records fill it
        os.kill(helper_pid(exporter), signal.SIGSTOP)
        requests = []
        for wave in range(3):  # the engine hands over what it has whenever it goes idle
            requests += [
                engine.add(engine.make_request(f"wave-{wave}-{i:02d}", prompt_len=20, max_tokens=2)) for i in range(20)
            ]
            engine.run()
        assert exporter.dropped > 0
        os.kill(exporter.helper_pid, signal.SIGCONT)
        assert exporter.close(wait=30)  # what is left of the first frames, then EOF
    finally:
        instrumentor.uninstrument()
    exported = {
        attributes_of(span.attributes)[names.REQUEST_ID]
        for _, span in sink.spans()
        if span.name == names.KV_REQUEST_SPAN
    }
    assert exported < {r.request_id for r in requests}
    assert len(exported) + exporter.dropped == len(requests)
    assert all(r.num_output_tokens == 2 for r in requests)
    errors = telemetry.points(names.INSTRUMENTATION_ERRORS)
    assert {p.attributes[names.HOOK] for p in errors} == {"exporter_process"}


def test_a_finding_about_an_ended_request_joins_its_trace_from_the_helper(
    model_config, helper_exports_to, monkeypatch
):
    """vLLM keeps a finished request's blocks: the finding, made after its span was
    handed over, becomes a span under it, built in the helper too."""
    from engine_harness import EngineHarness, break_free_for
    from harness.scheduler import make_scheduler

    monkeypatch.setenv("OTEL_KVCACHE_RECONCILE_SECONDS", "0")
    monkeypatch.setenv("OTEL_KVCACHE_ZOMBIE_GRACE_SECONDS", "0")
    sink = helper_exports_to
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=Telemetry().meter_provider)
    try:
        engine = EngineHarness(make_scheduler(model_config, num_blocks=64))
        break_free_for(monkeypatch, engine, "victim", orphan=False)
        headers = {"traceparent": f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"}
        engine.add(engine.make_request("victim", prompt_len=70, max_tokens=4, trace_headers=headers))
        engine.add(engine.make_request("bystander", prompt_len=40, max_tokens=30))
        engine.run()
        leaked = engine.held_blocks("victim")  # vLLM's own KV manager still lists them
        exporter = engine.scheduler._otel_kvcache_engine.record_sink
        assert exporter.close(wait=30)
    finally:
        instrumentor.uninstrument()
    assert leaked > 0
    spans = [span for _, span in sink.spans()]
    [victim] = [
        s for s in spans if s.name == names.KV_REQUEST_SPAN and attributes_of(s.attributes)[names.REQUEST_ID] == "victim"
    ]
    [finding] = [s for s in spans if s.name == names.FINDING_SPAN]
    assert finding.trace_id == TRACE_ID.to_bytes(16, "big")
    assert finding.parent_span_id == victim.span_id
    [event] = finding.events
    assert event.name == names.EVENT_ZOMBIE
    assert attributes_of(event.attributes)[names.REQUEST_ID] == "victim"
    assert attributes_of(event.attributes)[names.BLOCKS] == leaked


def _kv_span_ids(sink) -> set[str]:
    return {
        attributes_of(span.attributes)[names.REQUEST_ID] for _, span in sink.spans() if span.name == names.KV_REQUEST_SPAN
    }


def _settled(exporter: HelperPipe, timeout: float = 30) -> None:
    """Until the helper has acknowledged everything it was written."""
    deadline = time.monotonic() + timeout
    exporter.flush()
    while exporter.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
        exporter.flush()
    assert exporter.in_flight == 0


@pytest.mark.parametrize(("pipe_bytes", "lost_count"), [(None, 7), (4096, 40)], ids=["whole-frame", "frame-in-part"])
def test_a_dead_helper_is_replaced_and_what_it_took_with_it_is_counted(
    model_config, helper_exports_to, helper_telemetry, pipe_bytes, lost_count
):
    """SIGKILL of the helper while it holds records (stopped, so it holds them for sure),
    or while a frame is half in its pipe (a page-sized pipe): vLLM runs on, the engine
    notices, counts exactly those records, and a new helper exports what comes next."""
    import fcntl
    import select
    import signal

    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    sink, telemetry = helper_exports_to, helper_telemetry
    engine = EngineHarness(make_scheduler(model_config, num_blocks=256))
    exporter = engine.scheduler._otel_kvcache_engine.record_sink

    def wave(name: str, count: int) -> set[str]:
        requests = [engine.add(engine.make_request(f"{name}-{i}", prompt_len=40, max_tokens=8)) for i in range(count)]
        engine.run()  # idle at the end: everything is handed to the helper
        assert all(r.num_output_tokens == 8 for r in requests)
        return {r.request_id for r in requests}

    before = wave("before", 5)
    _settled(exporter)
    first_helper = helper_pid(exporter)
    os.kill(first_helper, signal.SIGSTOP)
    if pipe_bytes:
        fcntl.fcntl(exporter._helper.fd, fcntl.F_SETPIPE_SZ, pipe_bytes)
        # One frame for the wave, handed over as the engine goes idle: a wave that outlasts
        # a flush interval (a slow host) would first hand over a frame that fills the pipe,
        # and the next one, written whole or not at all (PIPE_BUF), would start no part.
        exporter.due = float("inf")
    lost = wave("lost", lost_count)
    exporter.due = time.monotonic()
    if pipe_bytes:
        assert exporter._frames and exporter._frames[0].started  # written in part
    else:
        assert exporter.in_flight == len(lost)
    os.kill(first_helper, signal.SIGKILL)
    # Noticed at the next hand-over once its pipes have closed: the clock starts then (a
    # hand-over a moment before, the signal not yet through, would leave it a second later).
    try:
        closed = bool(select.select([exporter._helper._acks_fd], [], [], 10.0)[0])
    except OSError:  # the pipe's thread noticed first and closed the descriptor (EBADF)
        closed = True
    assert closed, "the helper's pipes stayed open"
    noticed_by = time.monotonic() + 1.0  # one flush interval of a busy engine
    while exporter.helper_pid == first_helper and time.monotonic() < noticed_by:
        exporter.flush_if_due(time.monotonic())  # what the engine's chores call each step
        time.sleep(0.01)
    assert exporter.helper_pid != first_helper, "the death went unnoticed for a second"
    after = wave("after", 6)
    _settled(exporter)
    assert helper_pid(exporter) != first_helper
    assert exporter.close(wait=30)

    assert _kv_span_ids(sink) == before | after
    assert exporter.dropped == len(lost)
    assert telemetry.total(names.TELEMETRY_DROPPED, **{names.STAGE: names.STAGE_HELPER_DIED}) == len(lost)
    assert telemetry.total(names.TELEMETRY_DROPPED) == len(lost)
    assert telemetry.total(names.INSTRUMENTATION_ERRORS, **{names.HOOK: "exporter_process"}) == len(lost)


@pytest.mark.slow
def test_helpers_that_keep_dying_are_given_up_on_with_one_log_line(model_config, helper_telemetry, caplog):
    import logging
    import signal

    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    from otel_kvcache.export.helper_process import MAX_DEATHS

    telemetry = helper_telemetry
    engine = EngineHarness(make_scheduler(model_config, num_blocks=256))
    exporter = engine.scheduler._otel_kvcache_engine.record_sink
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        for _ in range(MAX_DEATHS):
            pid = helper_pid(exporter)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while exporter.helper_pid == pid and time.monotonic() < deadline:
                exporter.flush()
                time.sleep(0.02)
        requests = [engine.add(engine.make_request(f"r{i}", prompt_len=40, max_tokens=8)) for i in range(4)]
        engine.run()
    assert all(r.num_output_tokens == 8 for r in requests)
    gave_up = [r for r in caplog.records if "starts no more" in r.getMessage()]
    assert len(gave_up) == 1
    assert exporter.dropped == len(requests)
    assert telemetry.total(names.TELEMETRY_DROPPED, **{names.STAGE: names.STAGE_HELPER_DIED}) == len(requests)


def test_an_exporter_that_refuses_everything_counts_every_span(model_config, monkeypatch):
    """A collector that answers every export with an error, and a helper that holds
    nothing for it: each span the helper made is counted as dropped at the export stage,
    and only those."""
    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    refusing = OTLPSink(refuse=True).start()
    export_through_a_helper(monkeypatch, refusing.endpoint, OTEL_METRICS_EXPORTER="none",
                            OTEL_KVCACHE_EXPORT_HOLD_BYTES="0")  # fmt: skip
    telemetry = Telemetry()
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(meter_provider=telemetry.meter_provider)
    try:
        engine = EngineHarness(make_scheduler(model_config, num_blocks=256))
        exporter = engine.scheduler._otel_kvcache_engine.record_sink
        requests = []
        for wave in range(3):
            requests += [engine.add(engine.make_request(f"w{wave}-{i}", prompt_len=40, max_tokens=4)) for i in range(9)]
            engine.run()
        _settled(exporter)
    finally:
        instrumentor.uninstrument()
        refusing.stop()
    assert all(r.is_finished() and r.num_output_tokens == 4 for r in requests)
    made = len(requests)  # one span per finished request
    assert refusing.refused == made  # every span reached the collector, which refused it
    assert telemetry.total(names.TELEMETRY_DROPPED, **{names.STAGE: names.STAGE_EXPORT}) == made
    assert telemetry.total(names.TELEMETRY_DROPPED) == made


@pytest.mark.parametrize(
    ("setting", "given_providers", "expected"),
    [("", True, False), ("", False, False), ("on", True, True), ("off", False, False), ("sometimes", False, False)],
)
def test_where_spans_are_built(monkeypatch, caplog, setting, given_providers, expected):
    import logging

    from otel_kvcache.wiring.instrumentor import _exports_from_a_helper_process

    monkeypatch.setenv("OTEL_KVCACHE_EXPORTER_PROCESS", setting)
    # Not under opentelemetry-instrument here, so ``auto`` builds them in-process.
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        assert _exports_from_a_helper_process(given_providers) is expected
    if setting == "sometimes":
        [message] = [r.getMessage() for r in caplog.records]
        assert "OTEL_KVCACHE_EXPORTER_PROCESS='sometimes'" in message and "using 'auto'" in message


def test_prefix_events_whose_hashes_never_came_cost_that_event_and_no_more(caplog):
    """A free's hashes follow its kind and count in a second call: where that call fails
    (a ``MemoryError``, an interrupt), the helper finds the next event (a kind is no count,
    serial or hash), reads on from there, and says so once."""
    import hashlib

    from otel_kvcache.handover import tally
    from otel_kvcache.handover.miss_reasons import MissesForTheHelper, MissReasonsFromTheEngine, PrefixEvents
    from otel_kvcache.handover.record import RequestEnded, finished_request
    from otel_kvcache.vllm_compat.layouts import single_group

    block_hash = [hashlib.sha256(bytes([n])).digest() for n in range(3)]  # as vLLM's hasher makes them
    tallies = [tally.blank_tally(16, 64) for _ in range(3)]
    events: list = []
    handed_over = MissesForTheHelper(events)
    handed_over.unit = 16
    helper = MissReasonsFromTheEngine()
    layout = tuple(single_group(16))

    handed_over.freed(block_hash[:2])
    handed_over.missed(tallies[0], block_hash[:1], 0)  # freed before: evicted
    handed_over.missed(tallies[1], block_hash[2:], 0)  # never freed: cold
    events.extend((-1, 1))  # a free whose hashes never came
    handed_over.missed(tallies[2], block_hash[1:2], 0)  # read on after the loss: freed before, evicted
    with caplog.at_level("WARNING"):
        assert helper.took(PrefixEvents(64, layout, list(events)))
    del events[:]
    handed_over.missed(tallies[2], block_hash[1:2], 0)  # the next frame: evicted again
    assert helper.took(PrefixEvents(64, layout, list(events)))
    assert caplog.text.count("lost their order") == 1

    def reasons(counts: list) -> tuple[int, int]:
        finished = finished_request(RequestEnded("r", None, "stop", helper.filled_in(tally.PACKED.pack(*counts)), None, 0))
        return finished.evicted_tokens, finished.cold_tokens

    assert [reasons(counts) for counts in tallies] == [(16, 0), (0, 16), (32, 0)]
    assert not helper.took(RequestEnded("r", None, "stop", tally.PACKED.pack(*tallies[0]), None, 0))
