"""The offload tier of vLLM's ``OffloadingConnector`` (CPU backend, LRU and ARC), per
request and as a pool, on the real scheduler with the connector's real scheduler side
and its real ``CPUOffloadingManager``; the workers are played as vLLM's offloading tests
play them (``engine_harness.OffloadingWorker``).

Every number is checked against vLLM: the jobs its scheduler side registers (each
store's and load's keys and request, ``_jobs``), which keys its manager's policy holds
after each step, its capacity, and the request's prefill stats and statuses.
"""

from __future__ import annotations

import gc
import multiprocessing
import time

import prefix_stream
import pytest
from conftest import Telemetry
from engine_harness import EngineHarness
from harness.offloading import OffloadingWorker, offloading
from harness.scheduler import make_scheduler
from test_connectors import attributes
from vllm.v1.request import RequestStatus

from otel_kvcache import VLLMKVCacheInstrumentor, config, names
from otel_kvcache.engine.connectors import ConnectorTelemetry
from otel_kvcache.engine.offload_tier import OffloadTier

TIER_BLOCKS = 8


class Ledger:
    """What vLLM did with each key of the tier, read after every step: the keys of the
    store and load jobs its scheduler side registered, and which keys its manager's
    policy holds (a key that leaves it was evicted: this test neither resets the tier
    nor fails a store)."""

    def __init__(self, connector_scheduler) -> None:
        self.connector_scheduler = connector_scheduler
        self.manager = connector_scheduler.manager
        self.stored: dict[str, int] = {}  # blocks per request
        self.loads = 0
        self.evictions = self.evicted_unused = 0
        self.resident: set = set()
        self.loaded_since_stored: dict = {}  # key -> loaded since its last store
        self.owner: dict = {}  # key -> the request whose store job last put it in the tier

    def take(self, scheduler_output) -> None:
        metadata = scheduler_output.kv_connector_metadata
        for job_id in (*metadata.store_jobs, *metadata.load_jobs):
            job = self.connector_scheduler._jobs[job_id]
            if job.is_store:
                self.stored[job.req_id] = self.stored.get(job.req_id, 0) + len(job.keys)
                self.loaded_since_stored.update(dict.fromkeys(job.keys, False))
                self.owner.update(dict.fromkeys(job.keys, job.req_id))
            else:
                self.loads += len(job.keys)
                self.loaded_since_stored.update(dict.fromkeys(job.keys, True))
        now = {key for key in self.loaded_since_stored if self.manager._policy.get(key) is not None}
        for key in self.resident - now:
            self.evictions += 1
            self.evicted_unused += not self.loaded_since_stored[key]
        self.resident = now


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_tier_is_its_managers_pool_and_each_request_its_jobs(policy, make_engine, telemetry, monkeypatch):
    monkeypatch.setenv(config.ATTRIBUTION, names.PRIORITY)  # whose blocks: by priority, read as an engine starts
    # A tier's block takes what its spec says (the model's KV bytes per block, aligned): read
    # off a first engine's, which then goes, so that its tier is not reported beside the next.
    probe = make_engine(num_blocks=64, kv_transfer_config=offloading(1 << 30, policy))
    bytes_per_block = probe.scheduler.connector.connector_scheduler._otel_kvcache_tier_bytes_per_block
    del probe
    gc.collect()
    tier_bytes = TIER_BLOCKS * bytes_per_block + bytes_per_block // 2  # room for 8 blocks and a half
    engine = make_engine(num_blocks=64, kv_transfer_config=offloading(tier_bytes, policy))
    connector_scheduler = engine.scheduler.connector.connector_scheduler
    manager = connector_scheduler.manager
    assert manager._num_chunks == TIER_BLOCKS
    worker, ledger = OffloadingWorker(), Ledger(connector_scheduler)
    medium = {names.OFFLOAD_MEDIUM: "cpu"}
    waits = {}  # request id -> (seconds before the step that parked it, after the step that freed it)

    def tier_holders() -> dict:
        return tier_holders_of(telemetry)

    def tier_metrics() -> dict:
        blocks = {p.attributes[names.BLOCK_STATE]: p.value for p in telemetry.points(names.OFFLOAD_BLOCKS)}
        assert all(p.attributes[names.OFFLOAD_MEDIUM] == "cpu" for p in telemetry.points(names.OFFLOAD_BLOCKS))
        return blocks

    def run() -> None:
        for _ in range(200):
            if not (engine.scheduler.has_requests() or worker.jobs):
                return
            started = time.monotonic()
            parked = {rid for rid, r in engine.requests.items() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}
            output = engine.step(kv_connector_output=worker.output())
            worker.take(output)
            ledger.take(output)
            for request in engine.requests.values():
                waiting = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                if waiting and request.request_id not in waits:
                    waits[request.request_id] = (started, None)
                elif request.request_id in parked and not waiting:
                    waits[request.request_id] = (waits[request.request_id][0], time.monotonic())
            if worker.jobs:  # stores and loads in flight: their blocks are the tier's used ones
                assert tier_metrics() == {
                    names.BLOCK_STATE_USED: len(ledger.resident),
                    names.BLOCK_STATE_FREE: manager._num_chunks - len(ledger.resident),
                }
        raise AssertionError("still busy after 200 steps")

    engine.add(engine.make_request("a", 80, shared_prefix=80, max_tokens=4))  # 5 blocks stored
    run()
    assert engine.scheduler.reset_prefix_cache()  # the GPU's copy is gone, the tier's stays
    engine.add(engine.make_request("b", 96, shared_prefix=80, max_tokens=4, priority=1))  # loads a's 5, stores 1
    run()
    for request_id, priority in (("c", 0), ("d", 1), ("e", 1)):  # 4 blocks each, unique: the tier evicts
        engine.add(engine.make_request(request_id, 64, max_tokens=2, priority=priority))
        run()
    assert engine.scheduler.reset_prefix_cache()
    engine.add(engine.make_request("f", 80, shared_prefix=80, max_tokens=2))  # a's prefix again, if it stayed
    run()

    # The pool, and what went through it.
    assert ledger.loads and ledger.evictions > ledger.evicted_unused > 0  # some evicted after a load, some unused
    assert tier_metrics() == {
        names.BLOCK_STATE_USED: len(ledger.resident),
        names.BLOCK_STATE_FREE: manager._num_chunks - len(ledger.resident),
    }
    assert telemetry.total(names.OFFLOAD_STORES, **medium) == sum(ledger.stored.values())
    assert telemetry.total(names.OFFLOAD_LOADS, **medium) == ledger.loads
    assert telemetry.total(names.OFFLOAD_EVICTIONS, **medium) == ledger.evictions
    assert telemetry.total(names.OFFLOAD_EVICTED_UNUSED, **medium) == ledger.evicted_unused
    [limit] = telemetry.points(names.OFFLOAD_MEMORY_LIMIT)
    assert limit.value <= tier_bytes < limit.value + limit.value / TIER_BLOCKS  # vLLM's whole blocks of the budget
    if hasattr(manager, "config_info"):  # 0.33 on: vLLM says how many bytes it took
        assert limit.value == manager.config_info()[0]["cpu_kv_cache_size_bytes"]
    [usage] = telemetry.points(names.OFFLOAD_MEMORY_USAGE)
    assert usage.value == len(ledger.resident) * limit.value // TIER_BLOCKS

    # Each request: its stores, its loads' tokens (vLLM's prefill stats) and its wait.
    for request_id in "abcdef":
        attrs = attributes(telemetry, request_id)
        assert attrs[names.OFFLOAD_STORED_BLOCKS] == ledger.stored.get(request_id, 0)
        assert attrs[names.OFFLOAD_HIT_TOKENS] == engine.truth.external_cached_tokens.get(request_id, 0)
        if request_id in waits:
            started, ended = waits[request_id]
            assert 0 < attrs[names.OFFLOAD_LOAD_SECONDS] <= ended - started
        else:
            assert attrs[names.OFFLOAD_LOAD_SECONDS] == 0
    assert attributes(telemetry, "b")[names.OFFLOAD_HIT_TOKENS] == 80 and "b" in waits
    hits = sum(engine.truth.external_cached_tokens.values())
    assert telemetry.total(names.CONNECTOR_HIT_TOKENS) == hits  # the tier's hits are the connector's

    # Whose blocks the tier holds, after its evictions: those of the requests that stored them.
    held_by_priority = {}
    for key in ledger.resident:
        priority = engine.requests[ledger.owner[key]].priority
        held_by_priority[priority] = held_by_priority.get(priority, 0) + 1
    assert len(held_by_priority) == 2
    assert tier_holders() == held_by_priority

    # vLLM resets the tier: its blocks go, and they were no evictions.
    counted = {name: telemetry.total(name, **medium) for name in (names.OFFLOAD_EVICTIONS, names.OFFLOAD_STORES)}
    connector_scheduler.reset_cache()
    assert tier_metrics()[names.BLOCK_STATE_USED] == manager._num_chunks - manager._get_num_free_chunks() == 0
    assert set(tier_holders().values()) == {0}
    assert {name: telemetry.total(name, **medium) for name in counted} == counted


def tier_holders_of(telemetry) -> dict:
    """The tier's rows of ``vllm.kv_cache.held_blocks``, by priority."""
    return {
        p.attributes[names.PRIORITY]: p.value
        for p in telemetry.points(names.HELD_BLOCKS)
        if p.attributes.get(names.OFFLOAD_MEDIUM) == "cpu"
    }


def test_the_tiers_blocks_are_the_storing_requests_by_series(model_config, monkeypatch):
    """By priority: the blocks the tier holds are those of the requests whose store jobs put
    them there (vLLM's jobs, and its policy's keys), each request's series with the medium;
    while nothing changes, their block-seconds grow by the blocks held times the time."""
    monkeypatch.setenv(config.ATTRIBUTION, names.PRIORITY)
    telemetry, instrumentor = Telemetry(), VLLMKVCacheInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    try:
        tiered = offloading(1 << 30, "lru")
        engine = EngineHarness(make_scheduler(model_config, num_blocks=64, kv_transfer_config=tiered))
        connector_scheduler = engine.scheduler.connector.connector_scheduler
        worker, ledger = OffloadingWorker(), Ledger(connector_scheduler)
        owner = {}  # key -> the request whose store job last put it in the tier
        for request_id, priority in (("p0-a", 0), ("p1-a", 1), ("p1-b", 1)):
            engine.add(engine.make_request(request_id, 64 + 16 * priority, max_tokens=3, priority=priority))
            while engine.scheduler.has_requests() or worker.jobs:
                output = engine.step(kv_connector_output=worker.output())
                worker.take(output)
                ledger.take(output)
                for job_id in output.kv_connector_metadata.store_jobs:
                    job = connector_scheduler._jobs[job_id]
                    owner.update(dict.fromkeys(job.keys, job.req_id))
        held_by_priority = {}
        for key in ledger.resident:
            priority = engine.requests[owner[key]].priority
            held_by_priority[priority] = held_by_priority.get(priority, 0) + 1
        assert held_by_priority == {0: 4, 1: 10}  # 4 blocks, then 5 and 5: nothing evicted from 1 GiB

        def tier_series(metric: str) -> dict:
            return {
                p.attributes[names.PRIORITY]: p.value
                for p in telemetry.points(metric)
                if p.attributes.get(names.OFFLOAD_MEDIUM) == "cpu"
            }

        assert tier_holders_of(telemetry) == held_by_priority
        before, start = tier_series(names.OCCUPANCY), time.monotonic()
        time.sleep(0.5)
        after, elapsed = tier_series(names.OCCUPANCY), time.monotonic() - start
        for priority, blocks in held_by_priority.items():
            assert after[priority] - before[priority] == pytest.approx(blocks * elapsed, rel=0.1)
    finally:
        instrumentor.uninstrument()


def test_the_tiers_failures_are_counted_and_vllm_decides_as_it_does_without_them(model_config, monkeypatch):
    """Our tier code failing at every hook, or as the engine starts: vLLM's jobs and requests
    are what they are with it working, the failures are counted by hook point, and the
    rest of the engine's telemetry goes on (its spans)."""

    def run() -> tuple[Telemetry, Ledger, list]:
        telemetry, instrumentor = Telemetry(), VLLMKVCacheInstrumentor()
        instrumentor.instrument(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
        try:
            engine = EngineHarness(make_scheduler(model_config, num_blocks=64, kv_transfer_config=offloading(1 << 20)))
            worker, ledger = OffloadingWorker(), Ledger(engine.scheduler.connector.connector_scheduler)
            for request_id in ("a", "b"):  # b loads a's prefix back from the tier
                engine.add(engine.make_request(request_id, 80, shared_prefix=64, max_tokens=4))
                while engine.scheduler.has_requests() or worker.jobs:
                    ledger.take(worker.step(engine))
                assert engine.scheduler.reset_prefix_cache()
            requests = engine.requests.values()
            return telemetry, ledger, [(r.request_id, list(r.output_token_ids), r.num_computed_tokens) for r in requests]
        finally:
            instrumentor.uninstrument()

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure in otel-kvcache")

    working, ledger, outcome = run()
    assert ledger.loads and working.total(names.INSTRUMENTATION_ERRORS) == 0
    with monkeypatch.context() as patched:
        for method in ("on_store_prepared", "on_load_prepared", "on_store_completed", "on_reset"):
            patched.setattr(OffloadTier, method, fail)
        failing, failing_ledger, failing_outcome = run()
    assert (failing_outcome, failing_ledger.stored, failing_ledger.loads) == (outcome, ledger.stored, ledger.loads)
    hooks = {p.attributes[names.HOOK] for p in failing.points(names.INSTRUMENTATION_ERRORS)}
    assert {"OffloadingManager.prepare_store", "OffloadingManager.prepare_load"} <= hooks
    assert set(failing.span_by_request()) == {"a", "b"}

    with monkeypatch.context() as patched:
        patched.setattr(ConnectorTelemetry, "watch_offload_tier", fail)
        unwatched, _, unwatched_outcome = run()
    assert unwatched_outcome == outcome
    assert {p.attributes[names.HOOK] for p in unwatched.points(names.INSTRUMENTATION_ERRORS)} == {
        "Scheduler.__init__ (offload tier)"
    }
    assert not unwatched.points(names.OFFLOAD_BLOCKS)
    assert set(unwatched.span_by_request()) == {"a", "b"}  # the connector's view and the rest go on
    assert unwatched.span_by_request()["b"].attributes[names.CONNECTOR_HIT_TOKENS] == 64


def test_an_engine_without_a_tier_reports_none_of_it(engine, telemetry):
    engine.add(engine.make_request("r-1", 40, max_tokens=2))
    engine.run()
    assert not [k for k in attributes(telemetry, "r-1") if k.startswith("vllm.kv_cache.offload.")]
    assert not telemetry.points(names.OFFLOAD_BLOCKS)
    assert not telemetry.points(names.OFFLOAD_STORES)



TIER_SCALE_BLOCKS = 1200
"""The instrumented replay's tier: twice its GPU pool (``prefix_stream.POOL_BLOCKS``)."""
TIER_TOLERANCE = 0.05


@pytest.mark.parametrize("policy", ["lru", "arc", None], ids=["lru", "arc", "no-tier"])
def test_the_tier_what_if_is_what_vllm_serves_with_tiers_of_those_sizes(policy, make_engine, telemetry, capsys):
    """The stream replayed through real schedulers with real LRU tiers of each size (in
    processes of their own, uninstrumented), against the projection of one instrumented
    replay: with a tier of ``TIER_SCALE_BLOCKS`` (LRU, or ARC, projected as LRU), or with none,
    whose projection is of a first tier, in multiples of the GPU pool."""
    probe = make_engine(num_blocks=64, kv_transfer_config=offloading(1 << 30))
    bytes_per_block = probe.scheduler.connector.connector_scheduler._otel_kvcache_tier_bytes_per_block
    del probe
    gc.collect()
    if policy is None:  # scale: the GPU pool's bytes (its blocks, as the tier's take as many bytes)
        checked, scale_blocks = (1.0, 2.0, 4.0), prefix_stream.POOL_BLOCKS
    else:
        checked, scale_blocks = (0.0, 0.5, 1.0, 2.0, 4.0), TIER_SCALE_BLOCKS
    tier_bytes = {scale: int(scale * scale_blocks) * bytes_per_block for scale in checked}
    with multiprocessing.get_context("spawn").Pool(2) as pool:  # uninstrumented: a process of their own
        measured = pool.starmap_async(
            prefix_stream.measured_tier_hit_ratio,
            [(prefix_stream.POOL_BLOCKS, tier_bytes[scale] or None) for scale in checked],
        )
        transfer = None if policy is None else offloading(tier_bytes[1.0], policy)
        engine = make_engine(num_blocks=prefix_stream.POOL_BLOCKS, max_num_seqs=32, kv_transfer_config=transfer)
        prefix_stream.replay(engine, worker=None if policy is None else OffloadingWorker())
        measured = dict(zip(checked, measured.get(timeout=900)))

    projected = {p.attributes[names.OFFLOAD_SCALE]: p.value for p in telemetry.points(names.OFFLOAD_PROJECTED_HIT_RATIO)}
    sizes = {p.attributes[names.OFFLOAD_SCALE]: p.value for p in telemetry.points(names.OFFLOAD_PROJECTED_SIZE)}
    if policy is None:
        assert sorted(projected) == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]
        [pool_bytes] = [p.value for p in telemetry.points(names.KV_MEMORY_LIMIT)]
        assert sizes == {scale: round(scale * pool_bytes) for scale in projected}
        assert not telemetry.points(names.OFFLOAD_BLOCKS)
    else:
        assert engine.scheduler.connector.connector_scheduler.manager._num_chunks == TIER_SCALE_BLOCKS
        assert sorted(projected) == [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
        [limit] = telemetry.points(names.OFFLOAD_MEMORY_LIMIT)
        assert sizes == {scale: round(scale * limit.value) for scale in projected}
        assert all(p.attributes[names.OFFLOAD_MEDIUM] == "cpu" for p in telemetry.points(names.OFFLOAD_PROJECTED_SIZE))
        happened = (engine.truth.prefix_hits + engine.truth.connector_hits) / engine.truth.prefix_queries
        assert abs(projected[1.0] - happened) < 0.01
    with capsys.disabled():  # docs/telemetry.md quotes these
        print(f"\n{policy or 'no'} tier: scale  projected  measured by vLLM (LRU)")
        for scale in checked:
            print(f"{scale:16}  {projected[scale]:.3f}      {measured[scale]:.3f}")
    assert measured[4.0] - measured[checked[0]] > 0.15, "the stream must make the tier's size matter"
    for scale in checked:
        assert abs(projected[scale] - measured[scale]) < TIER_TOLERANCE, (scale, projected, measured)
