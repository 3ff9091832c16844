"""Every prefix number at vLLM's own unit, on the layouts of the hybrid models users run.

Each layout is built as vLLM's EngineCore builds its scheduler (``harness.scheduler.KVLayout``):
attention beside a sliding window, and beside a Mamba group in "align" mode, of the same
and of a larger block size, hashed at the block size or at a finer ``--prefix-match-unit``.
The recorded stream (``prefix_stream``: shared system prompts, chats coming back) evicts
and preempts on each. What the instrumentation reports is checked against vLLM's own
state: its ``PrefixCacheStats``, its block lists at every step, its Request objects, a scan
of its pool, and what its own lookup would have hit over every entry its cache held
(``engine_harness.PrefixCacheTruth``).
"""

from __future__ import annotations

import multiprocessing

import pytest

import prefix_stream
from engine_harness import EngineHarness, PrefixCacheTruth
from harness.scheduler import LAYOUTS, make_scheduler
from otel_kvcache import names
from otel_kvcache.handover import miss_reasons

POOL_BLOCKS = {None: 200, "sliding-window": 200, "mamba": 100, "mamba-finer-attention": 300, "prefix-match-unit": 100}
"""Pools that evict and preempt under the stream on each layout."""
CURVE_POOL_BLOCKS = {"mamba-finer-attention": 600, "prefix-match-unit": 300}
"""Pools the curve is projected from, whose size matters to the stream from half to four times."""
TOLERANCE = 0.05
CHECKED_SCALES = (0.5, 2.0, 4.0)


def _replayed(model_config, layout: str | None, blocks: int) -> tuple[EngineHarness, PrefixCacheTruth]:
    scheduler = make_scheduler(model_config, num_blocks=blocks, max_num_seqs=32, layout=LAYOUTS.get(layout))
    engine = EngineHarness(scheduler)
    truth = PrefixCacheTruth(engine)
    return prefix_stream.replay(engine, prefix_stream.prompts(count=prefix_stream.HYBRID_REQUESTS)), truth


@pytest.mark.parametrize("layout", [None, *LAYOUTS], ids=["one-group", *LAYOUTS])
def test_every_prefix_number_is_vllms_own(model_config, telemetry, monkeypatch, layout):
    # A history of what vLLM freed that reaches back over the whole stream: the shipped one
    # holds 2 to 4 pools' worth, past which an evicted prefix counts as cold (its only error,
    # ``miss_reasons.py``), which the stream's returning chats reach on one group.
    monkeypatch.setattr(miss_reasons, "HISTORY_PER_BLOCK", 1 << 10)
    engine, truth = _replayed(model_config, layout, POOL_BLOCKS[layout])
    requests = engine.requests
    queries, hits = engine.truth.prefix_queries, engine.truth.prefix_hits
    assert engine.events.removed_hashes, "the stream must make vLLM evict"
    assert sum(request.num_preemptions for request in requests.values()), "and preempt"
    assert hits and sum(truth.evicted.values()) and sum(truth.cold.values())

    # The what-if curve's 1x point is vLLM's own hit ratio.
    projected = {p.attributes[names.POOL_SCALE]: p.value for p in telemetry.points(names.PROJECTED_HIT_RATIO)}
    assert abs(projected[1.0] - hits / queries) < 1e-9, (projected, hits / queries)

    # The miss reasons add up to vLLM's misses, and split them as its cache held them.
    misses = {
        reason: telemetry.total(names.PREFIX_CACHE_MISSES, **{names.MISS_REASON: reason})
        for reason in (names.MISS_EVICTED, names.MISS_COLD, names.MISS_UNCACHEABLE)
    }
    assert sum(misses.values()) == queries - hits
    assert misses[names.MISS_EVICTED] == sum(truth.evicted.values())
    assert misses[names.MISS_COLD] == sum(truth.cold.values())

    spans = telemetry.span_by_request()
    assert sorted(spans) == sorted(requests)
    for request_id, request in requests.items():
        attributes = spans[request_id].attributes
        assert attributes[names.PREFIX_EVICTED_TOKENS] == truth.evicted[request_id], request_id
        assert attributes[names.PREFIX_COLD_TOKENS] == truth.cold[request_id], request_id
        assert attributes[names.BLOCKS_PREFIX_HIT] == truth.hit_blocks[request_id], request_id
        assert attributes[names.BLOCKS_PEAK] == engine.truth.peak_blocks[request_id], request_id
        assert attributes[names.BLOCKS_FREED] == engine.truth.last_held_blocks[request_id], request_id
        assert attributes[names.PREEMPTIONS] == request.num_preemptions
        assert attributes[names.INPUT_TOKENS] == request.num_prompt_tokens
        assert attributes[names.OUTPUT_TOKENS] == request.num_output_tokens
        assert attributes[names.FINISH_REASON] == "length"
        if not request.num_preemptions:
            assert attributes[names.CACHE_READ_INPUT_TOKENS] == engine.truth.first_admission_cached_tokens[request_id]
    assert sum(s.attributes[names.CACHE_READ_INPUT_TOKENS] for s in spans.values()) == hits
    assert telemetry.blocks_by_state() == engine.pool_scan()


@pytest.mark.parametrize("layout", [None, "mamba"], ids=["one-group", "mamba"])
def test_the_shipped_history_only_ever_takes_an_evicted_miss_for_cold(model_config, telemetry, layout):
    """With the history's shipped reach (2 to 4 pools' worth of what vLLM freed), a prefix
    evicted longer ago counts as cold: never the other way, and the two still add up."""
    engine, truth = _replayed(model_config, layout, POOL_BLOCKS[layout])
    spans = telemetry.span_by_request()
    shorter = 0
    for request_id in engine.requests:
        attributes = spans[request_id].attributes
        evicted, cold = attributes[names.PREFIX_EVICTED_TOKENS], attributes[names.PREFIX_COLD_TOKENS]
        assert evicted <= truth.evicted[request_id], request_id
        assert evicted + cold == truth.evicted[request_id] + truth.cold[request_id], request_id
        shorter += evicted < truth.evicted[request_id]
    assert shorter, "the stream must reach back further than the history"


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(CURVE_POOL_BLOCKS))
def test_the_curve_projects_what_vllm_hits_with_pools_of_other_sizes(model_config, telemetry, layout):
    """As on one group (``test_whatif.py``), from pools of other sizes replaying the stream
    uninstrumented, each in a process of its own."""
    blocks = CURVE_POOL_BLOCKS[layout]
    sizes = [(int(scale * blocks), layout) for scale in CHECKED_SCALES]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        measured = pool.starmap_async(prefix_stream.measured_hybrid_hit_ratio, sizes)
        _replayed(model_config, layout, blocks)
        measured = dict(zip(CHECKED_SCALES, measured.get(timeout=900)))
    projected = {p.attributes[names.POOL_SCALE]: p.value for p in telemetry.points(names.PROJECTED_HIT_RATIO)}
    assert measured[4.0] - measured[0.5] > 0.3, "the stream must make the pool's size matter"
    for scale in CHECKED_SCALES:
        assert abs(projected[scale] - measured[scale]) < TOLERANCE, (scale, projected, measured)


@pytest.mark.parametrize("layout", [None, "sliding-window", "mamba"], ids=["one-group", "sliding-window", "mamba"])
def test_speculative_decoding_keeps_every_span_and_the_pool_exact(model_config, telemetry, monkeypatch, layout):
    """N-gram speculation: vLLM allocates slots for each step's draft tokens and keeps the
    blocks of those it rejects; the leak checks run at every step and find nothing."""
    monkeypatch.setenv("OTEL_KVCACHE_RECONCILE_SECONDS", "0")
    monkeypatch.setenv("OTEL_KVCACHE_ZOMBIE_GRACE_SECONDS", "0")
    scheduler = make_scheduler(model_config, num_blocks=48, max_num_seqs=8, layout=LAYOUTS.get(layout),
                               speculative_tokens=3)  # fmt: skip
    engine = EngineHarness(scheduler)
    engine.draft_tokens = 3
    requests = [
        engine.add(engine.make_request(f"spec-{i}", prompt_len=40 + 9 * i, shared_prefix=32, max_tokens=70))
        for i in range(8)
    ]
    pools = []
    engine.run(after_step=lambda harness: pools.append((telemetry.blocks_by_state(), harness.pool_scan())))
    assert engine.truth.draft_tokens_scheduled, "vLLM must have verified draft tokens"
    assert sum(r.num_preemptions for r in requests), "the pool must be tight enough to preempt"
    assert all(ours == vllms for ours, vllms in pools)
    spans = telemetry.span_by_request()
    for request in requests:
        attributes = spans[request.request_id].attributes
        assert attributes[names.BLOCKS_PEAK] == engine.truth.peak_blocks[request.request_id]
        assert attributes[names.BLOCKS_FREED] == engine.truth.last_held_blocks[request.request_id]
        assert attributes[names.OUTPUT_TOKENS] == request.num_output_tokens
        assert attributes[names.PREEMPTIONS] == request.num_preemptions
    assert not [s for s in telemetry.spans.get_finished_spans() if s.name == names.FINDING_SPAN]
    assert telemetry.total(names.ORPHANED_BLOCKS) == 0
