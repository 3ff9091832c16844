"""The instrumentation must not change what vLLM does, even when our own code fails."""

from __future__ import annotations

import logging

import pytest
from vllm.v1.request import RequestStatus

from otel_kvcache import VLLMKVCacheInstrumentor, names
from otel_kvcache.engine.pool import PoolTracker
from otel_kvcache.handover.tally import OCCUPANCY_BLOCK_NS
from otel_kvcache.engine.telemetry import PACKING, EngineTelemetry
from otel_kvcache.wiring.patch import ENGINE_ATTRIBUTE

from conftest import Telemetry
from engine_harness import EngineHarness, busy_run_decisions
from harness.scheduler import make_scheduler


def _instrumented(telemetry):
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    return instrumentor


def _fail(*args, **kwargs):
    raise RuntimeError("injected failure in otel-kvcache")


def test_scheduler_decisions_identical_with_and_without_instrumentation(model_config, monkeypatch, caplog):
    baseline = busy_run_decisions(model_config)

    telemetry = Telemetry()
    instrumentor = _instrumented(telemetry)
    try:
        instrumented = busy_run_decisions(model_config)
        assert len(telemetry.kv_spans()) == 6
        assert telemetry.total(names.INSTRUMENTATION_ERRORS) == 0
        instrumentor.uninstrument()

        # Now make every piece of our own code raise, before and after vLLM's calls
        # (the wrappers take our functions when they are built: at instrument()).
        for method in (
            "on_prefix_cache_lookup",
            "on_scheduled",
            "on_stall",
            "before_preempt",
            "on_preempted",
            "before_release",
            "on_released",
        ):
            monkeypatch.setattr(EngineTelemetry, method, _fail)
        for method in ("note_pops", "before_prepending", "on_appending", "on_touching", "on_reset", "catch_up"):
            monkeypatch.setattr(PoolTracker, method, _fail)
        instrumentor = _instrumented(telemetry)
        with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
            failing = busy_run_decisions(model_config)
    finally:
        instrumentor.uninstrument()

    assert instrumented == baseline
    assert failing == baseline
    errors = telemetry.points(names.INSTRUMENTATION_ERRORS)
    hooks = {p.attributes[names.HOOK] for p in errors}
    assert {"Scheduler.schedule", "Scheduler._free_blocks", "Scheduler._preempt_request",
            "KVCacheManager.record_prefix_cache_stats", "FreeKVCacheBlockQueue.prepend_n",
            "FreeKVCacheBlockQueue.append_n", "BlockPool.touch"} <= hooks
    assert sum(p.value for p in errors) > len(hooks)  # counted every time...
    logged = [r for r in caplog.records if "injected" in str(r.exc_info and r.exc_info[1])]
    assert len(logged) == len(hooks)  # ...logged once per kind


def test_a_hybrid_models_decisions_are_identical_and_our_failures_counted(model_config, monkeypatch):
    """Attention beside a Mamba group: what only such a layout runs (the peaks read after a
    step's allocations, the checkpoints read as blocks reach the free queue, those running
    requests hold) fails, and vLLM decides as it does uninstrumented."""
    from harness.scheduler import LAYOUTS

    layout = LAYOUTS["mamba-finer-attention"]
    baseline = busy_run_decisions(model_config, layout)
    telemetry = Telemetry()
    instrumentor = _instrumented(telemetry)
    try:
        assert busy_run_decisions(model_config, layout) == baseline
        assert telemetry.total(names.INSTRUMENTATION_ERRORS) == 0
        instrumentor.uninstrument()
        for method in ("_read_peaks", "_entries_freed", "_entries_cached"):
            monkeypatch.setattr(EngineTelemetry, method, _fail)
        instrumentor = _instrumented(telemetry)
        failing = busy_run_decisions(model_config, layout)
    finally:
        instrumentor.uninstrument()
    assert failing == baseline
    hooks = {p.attributes[names.HOOK] for p in telemetry.points(names.INSTRUMENTATION_ERRORS)}
    assert {"Scheduler.schedule", "FreeKVCacheBlockQueue.append_n"} <= hooks


def test_vllm_exceptions_pass_through_unchanged(model_config, telemetry):
    engine = EngineHarness(make_scheduler(model_config, num_blocks=24))
    request = engine.add(engine.make_request("r", prompt_len=20))
    with pytest.raises(ValueError, match="Cannot get 1000000 free blocks from the pool"):
        engine.scheduler.kv_cache_manager.block_pool.get_new_blocks(1_000_000)
    with pytest.raises(AssertionError, match="Only running requests can be preempted"):
        engine.scheduler._preempt_request(request, 0.0)
    assert request.status == RequestStatus.WAITING
    assert telemetry.total(names.INSTRUMENTATION_ERRORS) == 0
    engine.run()
    assert telemetry.span_by_request()["r"].attributes[names.PREEMPTIONS] == 0


def test_a_count_past_64_bits_is_counted_and_its_span_still_goes_out(model_config, telemetry):
    """A released tally is packed into 64-bit counts: one that no longer fits (an occupancy
    summed over a day of a huge pool) is counted as ours and clamped, and the span is sent."""
    engine = EngineHarness(make_scheduler(model_config, num_blocks=24))
    request = engine.add(engine.make_request("r", prompt_len=20))
    engine.step()  # admitted: its tally is open
    ours = getattr(engine.scheduler, ENGINE_ATTRIBUTE)
    ours.requests["r"][OCCUPANCY_BLOCK_NS] = 1 << 64
    engine.run()
    span = telemetry.span_by_request()["r"]
    assert span.attributes[names.OUTPUT_TOKENS] == request.num_output_tokens > 0
    assert span.attributes[names.OCCUPANCY] >= (1 << 63) / 1e9  # block-seconds, from the clamped count
    errors = telemetry.points(names.INSTRUMENTATION_ERRORS)
    assert {p.attributes[names.HOOK] for p in errors} == {PACKING}
