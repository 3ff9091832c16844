"""A pool too small for the load: preemptions, evictions, stalls and the pool gauges."""

from __future__ import annotations

import time

import pytest
from harness.scheduler import VOCAB_SIZE
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from otel_kvcache import names
from otel_kvcache.engine import telemetry as engine_module
from otel_kvcache.engine import pool as pool_tracking

NUM_BLOCKS = 24  # 23 usable blocks of 16 tokens for requests that grow to ~9 blocks each


def _overloaded(make_engine):
    engine = make_engine(num_blocks=NUM_BLOCKS)
    requests = [
        engine.add(engine.make_request(f"chat-{i}", prompt_len=40 + 8 * i, shared_prefix=32, max_tokens=90))
        for i in range(6)
    ]
    return engine, requests


def test_preemptions_stalls_and_evictions_match_vllm(make_engine, telemetry):
    engine, requests = _overloaded(make_engine)
    engine.run()

    spans = telemetry.span_by_request()
    total_preemptions = sum(r.num_preemptions for r in requests)
    assert total_preemptions > 0, "the workload must preempt for this test to mean anything"
    for request in requests:
        span = spans[request.request_id]
        attrs = span.attributes
        assert attrs[names.PREEMPTIONS] == request.num_preemptions
        assert attrs[names.FINISH_REASON] == str(request.get_finished_reason())
        assert attrs[names.OUTPUT_TOKENS] == request.num_output_tokens
        # Steps in which vLLM's allocate_slots found no blocks for it.
        assert attrs[names.ALLOCATION_STALLS] == sum(rid == request.request_id for rid, _ in engine.truth.stalls)
        assert attrs[names.BLOCKS_PEAK] == engine.truth.peak_blocks[request.request_id]
        assert attrs[names.BLOCKS_FREED] == engine.truth.last_held_blocks[request.request_id]
        events = [e.name for e in span.events]
        assert events.count(names.EVENT_PREEMPTED) == request.num_preemptions
        assert events.count(names.EVENT_RESUMED) == request.num_preemptions
        assert events[0] == names.EVENT_ADMITTED and events[-1] == names.EVENT_RELEASED
        if request.num_preemptions:
            assert attrs[names.RECOMPUTED_TOKENS] > 0
            # Re-admissions allocate again: more blocks taken over the life than held at once.
            assert attrs[names.BLOCKS_ALLOCATED] + attrs[names.BLOCKS_PREFIX_HIT] > attrs[names.BLOCKS_PEAK]
        else:
            assert attrs[names.RECOMPUTED_TOKENS] == 0

    assert telemetry.total(names.PREEMPTIONS) == total_preemptions
    assert engine.truth.stalls, "the workload must run out of blocks for this test to mean anything"
    assert telemetry.total(names.ALLOCATION_STALLS) == len(engine.truth.stalls)
    # Every hash vLLM dropped from its prefix cache (its KV events) is one evicted block here.
    assert engine.events.removed_hashes > 0
    assert telemetry.total(names.EVICTIONS) == engine.events.removed_hashes
    # Hits summed over all admissions, re-admissions included, equal vLLM's PrefixCacheStats.
    assert sum(s.attributes[names.CACHE_READ_INPUT_TOKENS] for s in spans.values()) == engine.truth.prefix_hits
    assert telemetry.total(names.PREFIX_CACHE_QUERIES) == engine.truth.prefix_queries
    assert telemetry.total(names.PREFIX_CACHE_HITS) == engine.truth.prefix_hits


def test_pool_gauges_equal_a_scan_of_vllms_pool_at_every_step(make_engine, telemetry):
    engine, requests = _overloaded(make_engine)
    limit = NUM_BLOCKS - 1
    seen_states = set()
    # vLLM's own size of a block: its spec's page size times the layers sharing the block id.
    [group] = engine.scheduler.kv_cache_config.kv_cache_groups
    block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)

    def check(harness):
        scan = harness.pool_scan()
        gauges = telemetry.blocks_by_state()
        assert gauges == scan, f"step {harness.steps}"
        assert sum(gauges.values()) == limit
        assert telemetry.total(names.BLOCKS_LIMIT) == limit
        assert telemetry.total(names.UTILIZATION) == scan["used"] / limit
        kv_bytes = {p.attributes[names.BLOCK_STATE]: p.value for p in telemetry.points(names.KV_MEMORY_USAGE)}
        assert kv_bytes == {state: blocks * block_bytes for state, blocks in scan.items()}
        assert telemetry.total(names.KV_MEMORY_LIMIT) == limit * block_bytes
        seen_states.update(state for state, n in scan.items() if n)

    engine.run(after_step=check)
    assert seen_states == {"used", "cached", "free"}
    points = telemetry.points(names.BLOCKS)
    assert {p.attributes[names.ENGINE_INDEX] for p in points} == {0}


def test_engines_are_told_apart_by_data_parallel_rank(make_engine, telemetry):
    engines = [make_engine(num_blocks=32, data_parallel_rank=rank) for rank in (0, 1)]
    engines[1].add(engines[1].make_request("on-rank-1", prompt_len=60, max_tokens=50))
    for _ in range(3):
        engines[1].step()
        engines[0].step()
    used = {p.attributes[names.ENGINE_INDEX]: p.value for p in telemetry.points(names.BLOCKS)
            if p.attributes[names.BLOCK_STATE] == "used"}
    assert used == {0: engines[0].pool_scan()["used"], 1: engines[1].pool_scan()["used"]}
    assert used[1] > 0 == used[0]


def test_prefix_cache_reset_empties_the_cached_state(make_engine, telemetry):
    engine = make_engine(num_blocks=64)
    for i in range(4):
        engine.add(engine.make_request(f"r{i}", prompt_len=80, shared_prefix=48, max_tokens=4))
    engine.run()
    assert telemetry.blocks_by_state()["cached"] == engine.pool_scan()["cached"] > 0
    assert engine.scheduler.reset_prefix_cache()
    engine.step()  # the gauges read the snapshot published at the end of a step
    assert telemetry.blocks_by_state() == engine.pool_scan() == {"used": 0, "cached": 0, "free": 63}


def test_an_abort_while_the_engine_idles_shows_in_the_gauges(engine, telemetry):
    engine.add(engine.make_request("lonely", prompt_len=100, max_tokens=500))
    for _ in range(3):
        engine.step()
    assert telemetry.blocks_by_state()["used"] == engine.pool_scan()["used"] > 0
    engine.abort("lonely")  # the client went away; vLLM's engine loop has nothing left to step
    assert telemetry.blocks_by_state() == engine.pool_scan()
    assert telemetry.blocks_by_state()["used"] == 0


def test_a_kv_connector_evicting_free_cached_blocks_is_counted_once(make_engine, telemetry):
    """A KV connector drops the prefixes of blocks by id (``BlockPool.evict_blocks``):
    free ones keep their place in the queue, hashless, until the head reaches them.
    (While the head is inside a run holding such entries the cached count may be
    off by those; it is exact again once the run is popped, as checked here.)"""
    engine = make_engine(num_blocks=NUM_BLOCKS)
    for i in range(3):
        engine.add(engine.make_request(f"first-{i}", prompt_len=48, max_tokens=8))
    engine.run()
    pool = engine.scheduler.kv_cache_manager.block_pool
    cached = [b.block_id for b in pool.blocks if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None]
    assert len(cached) >= 6
    pool.evict_blocks(set(cached[1::2]))  # every other one: dead entries between live ones
    for i in range(4):  # enough to pop the whole queue, dead entries included
        engine.add(engine.make_request(f"second-{i}", prompt_len=64, max_tokens=24))
    engine.run()
    assert telemetry.blocks_by_state() == engine.pool_scan()
    assert telemetry.total(names.EVICTIONS) == engine.events.removed_hashes > len(cached[1::2])


@pytest.mark.parametrize("catch_up_seconds", [0.0, pool_tracking.CATCH_UP_SECONDS])
@pytest.mark.parametrize("eager_appends", [0, 1, pool_tracking.EAGER_APPENDS])
def test_a_growing_chat_takes_its_cached_blocks_back_and_the_gauges_follow(
    make_engine, telemetry, monkeypatch, eager_appends, catch_up_seconds
):
    """The article's multi-turn chat: each turn's prompt is the whole conversation so
    far, so its prefix hit takes back the blocks the previous turn freed (free and
    cached), while the pool is small enough for the head to evict. Whether runs are
    indexed when appended or only when a hit needs them (``EAGER_APPENDS``), the
    gauges equal a scan of vLLM's pool at every step and the evictions vLLM's KV
    events: at every step when the pops are taken off the runs each step, at the
    end when they wait (``CATCH_UP_SECONDS``, longer than the test) for the engine to go idle."""
    monkeypatch.setattr(pool_tracking, "EAGER_APPENDS", eager_appends)
    monkeypatch.setattr(pool_tracking, "CATCH_UP_SECONDS", catch_up_seconds)
    engine = make_engine(num_blocks=40)
    chats = {f"chat-{c}": [(97 * c + 11 * k) % VOCAB_SIZE for k in range(40)] for c in range(3)}

    def check(harness):
        assert telemetry.blocks_by_state() == harness.pool_scan(), f"step {harness.steps}"
        if not catch_up_seconds:
            assert telemetry.total(names.EVICTIONS) == harness.events.removed_hashes, f"step {harness.steps}"

    hit_tokens_after_first_turn = 0
    for turn in range(6):
        requests = {
            chat: engine.add(
                Request(
                    request_id=f"{chat}-turn-{turn}",
                    prompt_token_ids=list(tokens),
                    sampling_params=SamplingParams(max_tokens=20, ignore_eos=True),
                    pooling_params=None,
                    block_hasher=engine.block_hasher,
                )
            )
            for chat, tokens in chats.items()
        }
        hits_before = engine.truth.prefix_hits
        engine.run(after_step=check)
        if turn:
            hit_tokens_after_first_turn += engine.truth.prefix_hits - hits_before
        for chat, request in requests.items():  # the answer and the next question join the context
            chats[chat] = list(request.all_token_ids) + [(turn * 7 + k) % VOCAB_SIZE for k in range(12)]

    assert hit_tokens_after_first_turn > 0, "later turns must hit the cached blocks earlier turns freed"
    assert engine.events.removed_hashes > 0, "the pool must be small enough to evict"
    assert telemetry.total(names.EVICTIONS) == engine.events.removed_hashes


def test_unpinned_blocks_join_the_free_queue_as_vllm_counts_them(make_engine, telemetry):
    """hisparse's ``unpin_blocks`` hands blocks back to the free queue's tail, to stay
    readable until reused: hashless ones are free, not cached, and their reuse
    evicts nothing."""
    engine = make_engine(num_blocks=NUM_BLOCKS)
    engine.add(engine.make_request("warm", prompt_len=64, max_tokens=4))
    engine.run()  # leaves cached blocks behind
    pool = engine.scheduler.kv_cache_manager.block_pool
    pinned = pool.get_new_blocks(3)  # one reference each, no hash
    reused = []
    pool.unpin_blocks(pinned, on_reuse=reused.append)
    engine.step()  # the gauges read the counts published at the end of a step
    assert telemetry.blocks_by_state() == engine.pool_scan()

    def check(harness):
        assert telemetry.blocks_by_state() == harness.pool_scan(), f"step {harness.steps}"

    engine.add(engine.make_request("after", prompt_len=352, max_tokens=4))  # takes all 23 blocks
    engine.run(after_step=check)
    assert {block.block_id for block in reused} == {block.block_id for block in pinned}
    assert engine.events.removed_hashes > 0
    assert telemetry.total(names.EVICTIONS) == engine.events.removed_hashes


class StepClock:
    """``time`` for the engine and the pool, but for ``monotonic``, which moves one
    second a step (from now, so the chores come due as they would)."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.mark.parametrize("eager_appends", [0, pool_tracking.EAGER_APPENDS])
def test_mixed_traffic_evicts_what_vllm_evicts_as_old_as_it_was(make_engine, telemetry, monkeypatch, eager_appends):
    """Most requests new, every third one going back to part of a recent one's prompt, on a
    pool small enough to evict every few steps: pops take whole runs and end inside
    others, hits take blocks back from runs indexed and not yet indexed. At every
    step, the evictions counted are vLLM's KV events, their summed age is how long
    each block vLLM evicted had been free and cached (a step's clock), and the
    gauges are a scan of its pool."""
    monkeypatch.setattr(pool_tracking, "EAGER_APPENDS", eager_appends)
    monkeypatch.setattr(pool_tracking, "CATCH_UP_SECONDS", 0.0)
    clock = StepClock()
    monkeypatch.setattr(pool_tracking, "time", clock)
    monkeypatch.setattr(engine_module, "time", clock)
    engine = make_engine(num_blocks=48, max_num_seqs=4)
    blocks = engine.scheduler.kv_cache_manager.block_pool.blocks
    cached_since: dict[int, tuple] = {}  # free blocks holding a prefix: since when, and which prefix
    truth = {"evicted": 0, "age": 0.0}

    def check(harness):
        for block_id, (since, block_hash) in list(cached_since.items()):
            block = blocks[block_id]
            if block.block_hash is not block_hash:  # popped and reused: evicted in this step's schedule()
                truth["evicted"] += 1
                truth["age"] += clock.now - since
                del cached_since[block_id]
            elif block.ref_cnt:  # a prefix hit took it back
                del cached_since[block_id]
        for block in blocks:
            if not block.ref_cnt and block.block_hash is not None and block.block_id not in cached_since:
                cached_since[block.block_id] = (clock.now, block.block_hash)  # freed in this step
        assert truth["evicted"] == harness.events.removed_hashes, f"step {harness.steps}"
        assert telemetry.total(names.EVICTIONS) == truth["evicted"], f"step {harness.steps}"
        assert telemetry.total(names.EVICTION_AGE) == pytest.approx(truth["age"]), f"step {harness.steps}"
        assert telemetry.blocks_by_state() == harness.pool_scan(), f"step {harness.steps}"
        clock.now += 1.0

    prompts: list[list[int]] = []
    for n in range(90):
        prompt = [(n * 31 + 3 * k) % VOCAB_SIZE for k in range(20 + (n * 13) % 60)]
        if n % 3 == 2:  # back to one of the last few prompts, one to four blocks deep
            prompt = prompts[n - 2 - n % 5 if n > 6 else 0][: 16 * (1 + n % 4)] + prompt
        prompts.append(prompt)
        engine.add(
            Request(
                request_id=f"mixed-{n}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=4 + (n * 5) % 24, ignore_eos=True),
                pooling_params=None,
                block_hasher=engine.block_hasher,
            )
        )
        for _ in range(1 + n % 2):
            if engine.scheduler.has_requests():
                engine.step()
                check(engine)
    engine.run(after_step=check)

    assert engine.truth.prefix_hits > 0
    assert truth["evicted"] > 20, "the pool must evict often for this test to mean anything"


def test_cached_blocks_given_back_at_the_head_are_cached_until_popped_and_then_evicted(make_engine, telemetry):
    """vLLM 0.34's ``free_blocks(..., evict_first=True)``, as its CPU-offloading connector
    uses it in lazy mode: it takes cached blocks off the free queue (``touch``) to copy
    them, then gives them back at the head, still cached: a prefix can hit them until
    the head is popped, which evicts them first."""
    import inspect

    engine = make_engine(num_blocks=NUM_BLOCKS)
    pool = engine.scheduler.kv_cache_manager.block_pool
    if "evict_first" not in inspect.signature(pool.free_blocks).parameters:
        pytest.skip("vLLM before 0.34 always appends cached blocks")
    engine.add(engine.make_request("warm", prompt_len=96, shared_prefix=64, max_tokens=4))
    engine.add(engine.make_request("other", prompt_len=96, max_tokens=4))
    engine.run()  # leaves cached blocks behind
    free_cached = [b for b in pool.free_block_queue.get_all_free_blocks() if b.block_hash is not None]
    stored = free_cached[:4]  # the head's cached blocks, as the lazy store takes them
    pool.touch(stored)
    pool.free_blocks(stored, evict_first=True)
    assert pool.free_block_queue.get_all_free_blocks()[: len(stored)] == stored  # at the head, still cached
    engine.step()
    assert telemetry.blocks_by_state() == engine.pool_scan()

    def check(harness):
        assert telemetry.blocks_by_state() == harness.pool_scan(), f"step {harness.steps}"

    # A prefix hit on the shared blocks, and a request big enough to pop the head.
    engine.add(engine.make_request("hit", prompt_len=96, shared_prefix=64, max_tokens=4))
    engine.add(engine.make_request("big", prompt_len=200, max_tokens=4))
    engine.run(after_step=check)
    assert engine.events.removed_hashes > 0
    assert telemetry.total(names.EVICTIONS) == engine.events.removed_hashes
