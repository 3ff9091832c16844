"""The instrumentation must not change what vLLM does, even when our own code fails."""

from __future__ import annotations

import logging

import pytest
from vllm.v1.request import RequestStatus

from otel_kvcache import VLLMKVCacheInstrumentor, names
from otel_kvcache.engine import EngineTelemetry
from otel_kvcache.pool import PoolTracker

from conftest import Telemetry
from engine_harness import EngineHarness, make_scheduler


def _workload(model_config):
    """A preempting, prefix-sharing, aborting run; returns everything vLLM decided."""
    engine = EngineHarness(make_scheduler(model_config, num_blocks=24))
    requests = [
        engine.add(engine.make_request(f"req-{i}", prompt_len=40 + 8 * i, shared_prefix=32, max_tokens=60))
        for i in range(6)
    ]
    decisions = []
    for step in range(400):
        if not engine.scheduler.has_requests():
            break
        if step == 10:
            engine.abort("req-1")
        out = engine.step()
        decisions.append(
            (
                sorted(out.num_scheduled_tokens.items()),
                sorted(r.req_id for r in out.scheduled_new_reqs),
                sorted(out.scheduled_cached_reqs.resumed_req_ids),
                sorted(out.preempted_req_ids or ()),
                sorted(out.finished_req_ids),
            )
        )
    final = [
        (r.request_id, r.status, r.num_preemptions, list(r.output_token_ids), r.num_computed_tokens) for r in requests
    ]
    return decisions, final, engine.pool_scan(), engine.events.removed_hashes


def _instrumented(telemetry):
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    return instrumentor


def _fail(*args, **kwargs):
    raise RuntimeError("injected failure in otel-kvcache")


def test_scheduler_decisions_identical_with_and_without_instrumentation(model_config, monkeypatch, caplog):
    baseline = _workload(model_config)

    telemetry = Telemetry()
    instrumentor = _instrumented(telemetry)
    try:
        instrumented = _workload(model_config)
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
        for method in ("note_pops", "before_prepending", "on_appending", "on_touching", "on_reset", "settle"):
            monkeypatch.setattr(PoolTracker, method, _fail)
        instrumentor = _instrumented(telemetry)
        with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
            failing = _workload(model_config)
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
