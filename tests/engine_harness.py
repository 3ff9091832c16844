"""Drives vLLM's real V1 Scheduler in-process with fake model outputs.

The model runner is the only thing faked (one sampled token per scheduled
request, as vLLM's own tests/v1/core do). Everything the tests compare against
is vLLM's ground truth: its Request objects, its KV manager's block lists, its
PrefixCacheStats, its KV-cache events and a scan of its block pool.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from harness.scheduler import VOCAB_SIZE, make_scheduler, model_runner_output
from vllm.config import KVTransferConfig
from vllm.distributed.kv_events import BlockRemoved
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, make_block_hash_with_group_id
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput
from vllm.v1.request import Request, RequestStatus


class _EventRecorder:
    """Stands in for vLLM's KV-event publisher and keeps what vLLM publishes."""

    def __init__(self) -> None:
        self.removed_hashes = 0

    def publish(self, batch) -> None:
        self.removed_hashes += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockRemoved))

    def shutdown(self) -> None:
        pass


@dataclass
class GroundTruth:
    """What vLLM itself says happened, gathered step by step."""

    prefix_queries: int = 0
    prefix_hits: int = 0
    first_admission_cached_tokens: dict[str, int] = field(default_factory=dict)
    peak_blocks: Counter = field(default_factory=Counter)
    last_held_blocks: dict[str, int] = field(default_factory=dict)
    stalls: set[tuple[str, int]] = field(default_factory=set)
    """(request id, step) where vLLM's ``allocate_slots`` found no blocks for the request."""
    connector_hits: int = 0
    """Tokens a KV connector served, as vLLM's connector PrefixCacheStats count them."""
    external_cached_tokens: dict[str, int] = field(default_factory=dict)
    """A KV connector's hit tokens at each request's first admission (vLLM's prefill stats)."""
    kv_transfer_params: dict[str, dict] = field(default_factory=dict)
    """What each finished request hands the next engine, as vLLM returns it to the client."""
    draft_tokens_scheduled: int = 0
    """Draft tokens vLLM scheduled for verification (speculative decoding)."""
    update_started: float = 0.0
    update_ended: float = 0.0
    """``time.monotonic()`` around the last step's ``update_from_output``."""


class _AllocationRecorder:
    """Calls the KV manager's ``allocate_slots`` and keeps, per step, the requests it
    found no blocks for (it returns None)."""

    def __init__(self, harness: EngineHarness) -> None:
        self.harness = harness
        self._allocate = harness.scheduler.kv_cache_manager.allocate_slots

    def __call__(self, request, *args, **kwargs):
        blocks = self._allocate(request, *args, **kwargs)
        if blocks is None:
            self.harness.truth.stalls.add((request.request_id, self.harness.steps))
        return blocks


class _HitRecorder:
    """Keeps, per block, the hash it held when vLLM's last prefix hit took it (``touch``),
    then calls the class's ``touch``: the instrumented one, when instrumented."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.hash_at_hit: dict[int, object] = {}
        self._touch = type(pool).touch

    def __call__(self, blocks) -> None:
        self.hash_at_hit.update((block.block_id, block.block_hash) for block in blocks)
        self._touch(self.pool, blocks)

    def cached_blocks_hit_again(self) -> int:
        """Free blocks still holding the prefix they held when a hit reused them."""
        blocks = self.pool.blocks
        return sum(
            1
            for block_id, block_hash in self.hash_at_hit.items()
            if blocks[block_id].ref_cnt == 0 and block_hash is not None and blocks[block_id].block_hash == block_hash
        )


class EngineHarness:
    """A scheduler plus the fake model runner that steps it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.events = _EventRecorder()
        scheduler.kv_event_publisher = self.events
        pool = scheduler.kv_cache_manager.block_pool
        self.hits = pool.touch = _HitRecorder(pool)
        scheduler.kv_cache_manager.allocate_slots = _AllocationRecorder(self)
        init_none_hash(sha256)
        self.block_size = scheduler.block_size
        # As vLLM's EngineCore hashes a request's prompt: every hash_block_size tokens.
        self.block_hasher = get_request_block_hasher(scheduler.hash_block_size, sha256)
        self.draft_tokens = 0
        """Draft tokens proposed for each running request after each step (speculative
        decoding): the step after, the first few of them are accepted, a different number each time."""
        self.requests: dict[str, Request] = {}
        self.truth = GroundTruth()
        self.steps = 0

    # --- requests ---------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt_len: int,
        shared_prefix: int = 0,
        max_tokens: int = 8,
        trace_headers: dict[str, str] | None = None,
        kv_transfer_params: dict | None = None,
        **fields,
    ) -> Request:
        """Prompt = ``shared_prefix`` tokens common to all requests + unique tokens;
        ``kv_transfer_params`` as a disaggregated-serving proxy sends them (copied: NIXL
        rewrites them); ``fields``: more of ``Request``'s (``session_id``, ``priority``,
        ``lora_request``)."""
        seed = sum(map(ord, request_id)) * 7919
        unique = [(seed + 31 * k) % VOCAB_SIZE for k in range(prompt_len - shared_prefix)]
        tokens = [(k * 13 + 5) % VOCAB_SIZE for k in range(shared_prefix)] + unique
        extra_args = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params is not None else None
        return Request(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args),
            pooling_params=None,
            trace_headers=trace_headers,
            block_hasher=self.block_hasher,
            **fields,
        )

    def add(self, request: Request) -> Request:
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        return request

    def abort(self, *request_ids: str) -> None:
        for request_id in request_ids:
            self.truth.last_held_blocks[request_id] = self.held_blocks(request_id)
        self.scheduler.finish_requests(list(request_ids), RequestStatus.FINISHED_ABORTED)

    # --- stepping -----------------------------------------------------------------

    def step(self, after_schedule=None, kv_connector_output=None):
        """One engine step; ``kv_connector_output`` is what the workers' connector reports
        with the model's output (finished sends and receives, failed loads)."""
        output = self.scheduler.schedule()
        if after_schedule is not None:  # where the model would run: the instrumentation's chores ran
            after_schedule(self)
        for request_id in self.scheduler.requests:
            held = self.held_blocks(request_id)
            self.truth.peak_blocks[request_id] = max(self.truth.peak_blocks[request_id], held)
            self.truth.last_held_blocks[request_id] = held
        req_ids = list(output.num_scheduled_tokens)
        drafts = output.scheduled_spec_decode_tokens
        self.truth.draft_tokens_scheduled += sum(map(len, drafts.values()))
        runner_output = model_runner_output(
            req_ids,
            [self._accepted(drafts.get(req_id, ()), i) + [(self.steps + i) % VOCAB_SIZE] for i, req_id in enumerate(req_ids)],
            kv_connector_output=kv_connector_output,
        )
        self.truth.update_started = time.monotonic()
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        self.truth.update_ended = time.monotonic()
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                if out.prefill_stats is not None:
                    self.truth.first_admission_cached_tokens[out.request_id] = out.prefill_stats.num_local_cached_tokens
                    self.truth.external_cached_tokens[out.request_id] = out.prefill_stats.num_external_cached_tokens
                if out.kv_transfer_params is not None:
                    self.truth.kv_transfer_params[out.request_id] = out.kv_transfer_params
            stats = outputs.scheduler_stats
            if stats is not None and stats.prefix_cache_stats is not None:
                p = stats.prefix_cache_stats
                self.truth.prefix_queries += p.queries + p.preempted_queries
                self.truth.prefix_hits += p.hits + p.preempted_hits
            if stats is not None and stats.connector_prefix_cache_stats is not None:
                c = stats.connector_prefix_cache_stats
                self.truth.connector_hits += c.hits + c.preempted_hits
        if self.draft_tokens:
            running = [request_id for request_id, request in self.scheduler.requests.items()
                       if request.status == RequestStatus.RUNNING]  # fmt: skip
            proposals = [[(self.steps + k) % VOCAB_SIZE for k in range(self.draft_tokens)] for _ in running]
            self.scheduler.update_draft_token_ids(DraftTokenIds(running, proposals))
        self.steps += 1
        return output

    def _accepted(self, drafted, index: int) -> list:
        """The draft tokens the model accepts: the first few of those the step verified."""
        return list(drafted)[: (self.steps + index) % (len(drafted) + 1)] if drafted else []

    def run(self, max_steps: int = 2000, after_step=None, after_schedule=None) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step(after_schedule)
            if after_step is not None:
                after_step(self)
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    # --- vLLM's own view of the pool -------------------------------------------------

    def held_blocks(self, request_id: str) -> int:
        manager = self.scheduler.kv_cache_manager
        return sum(
            sum(1 for b in m.req_to_blocks.get(request_id, ()) if not b.is_null)
            for m in manager.coordinator.single_type_managers
        )

    def pool_scan(self) -> dict[str, int]:
        """used / cached / free by scanning every block of vLLM's pool."""
        pool = self.scheduler.kv_cache_manager.block_pool
        states = Counter()
        for block in pool.blocks:
            if block.is_null:
                continue
            if block.ref_cnt > 0:
                states["used"] += 1
            elif block.block_hash is not None:
                states["cached"] += 1
            else:
                states["free"] += 1
        return {"used": states["used"], "cached": states["cached"], "free": states["free"]}


def break_free_for(monkeypatch, engine, victim: str, orphan: bool) -> list:
    """Make vLLM's KVCacheManager.free skip one request: keep its block list (a zombie),
    or drop the list but never return the references (orphaned blocks)."""
    manager = engine.scheduler.kv_cache_manager
    original_free = manager.free
    lost = []

    def free(request):
        if request.request_id != victim:
            return original_free(request)
        if orphan:
            lost.extend(manager.pop_blocks_for_free(request))

    monkeypatch.setattr(manager, "free", free)
    return lost


def busy_run_decisions(model_config, layout=None) -> tuple:
    """A preempting, prefix-sharing, aborting run (on ``layout``'s groups, a
    ``harness.scheduler.KVLayout``, or one); returns everything vLLM decided."""
    engine = EngineHarness(make_scheduler(model_config, num_blocks=24, layout=layout))
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
                sorted(getattr(out.scheduled_cached_reqs, "resumed_req_ids", ())),  # 0.34: among the new ones
                sorted(out.preempted_req_ids or ()),
                sorted(out.finished_req_ids),
            )
        )
    final = [
        (r.request_id, r.status, r.num_preemptions, list(r.output_token_ids), r.num_computed_tokens) for r in requests
    ]
    return decisions, final, engine.pool_scan(), engine.events.removed_hashes


def nixl_both() -> KVTransferConfig:
    """vLLM's NIXL connector, producing and consuming, recomputing what fails to load."""
    return KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both", kv_load_failure_policy="recompute")


class KVTransfers:
    """Plays the workers' side of an engine whose NIXL connector both produces and consumes
    (``kv_role="kv_both"``): what vLLM parks for a remote load arrives ``recv_steps`` later,
    what it holds for a send leaves ``send_steps`` after it finished, and every
    ``fail_every``-th load has one bad block. The requests it sends: a remote decode
    (produce, one token) and a remote prefill (consume), in turn."""

    def __init__(self, harness: EngineHarness, recv_steps: int = 2, send_steps: int = 3, fail_every: int = 4) -> None:
        self.harness = harness
        self.recv_steps, self.send_steps, self.fail_every = recv_steps, send_steps, fail_every
        self.due: dict[str, int] = {}
        self.loads = 0
        self.sent = 0

    def add(self, prompt_len: int = 48) -> Request:
        n, self.sent = self.sent, self.sent + 1
        if n % 2:
            params = dict(do_remote_prefill=True, do_remote_decode=False, remote_engine_id="prefill",
                          remote_request_id=f"prefill-{n}", remote_block_ids=list(range(prompt_len // 16)),
                          remote_host="prefill-host", remote_port=1234, tp_size=1)  # fmt: skip
            request = self.harness.make_request(f"c{n}", prompt_len, max_tokens=8, kv_transfer_params=params)
        else:
            params = {"do_remote_decode": True, "do_remote_prefill": False}
            request = self.harness.make_request(f"p{n}", prompt_len, max_tokens=1, kv_transfer_params=params)
        return self.harness.add(request)

    def step(self) -> None:
        harness, step = self.harness, self.harness.steps
        recving, sending, invalid = set(), set(), set()
        for request_id, due in list(self.due.items()):
            if due > step:
                continue
            del self.due[request_id]
            request = harness.scheduler.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                recving.add(request_id)
                self.loads += 1
                if self.loads % self.fail_every == 0:
                    invalid.add(harness.scheduler.kv_cache_manager.get_block_ids(request_id)[0][0])
            elif request.is_finished():
                sending.add(request_id)
        harness.step(kv_connector_output=KVConnectorOutput(
            finished_recving=recving, finished_sending=sending, invalid_block_ids=invalid))  # fmt: skip
        for request_id, request in harness.scheduler.requests.items():
            if request_id in self.due:
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.due[request_id] = harness.steps + self.recv_steps
            elif request.is_finished():
                self.due[request_id] = harness.steps + self.send_steps

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.harness.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"transfers still unfinished after {max_steps} steps")


class PrefixCacheTruth:
    """What vLLM's prefix cache could have given each counted lookup, by vLLM's own lookup.

    Kept beside an ``EngineHarness``: every entry vLLM's pool registers
    (``_insert_block_hash``), and those it drops for want of blocks (``get_new_blocks``
    evicting), stay known; an entry it drops for another reason (a partial-block entry
    replaced when its block fills up, a Mamba state it overwrites) was never there to
    evict, and goes. At each lookup (``get_computed_blocks``), vLLM's coordinator looks
    the request up again over those entries, as a cache that never evicted would hold
    them: its hit beyond vLLM's own is the evicted tokens; the units vLLM could look up
    beyond that, the cold. Also the blocks each lookup gave, vLLM's null placeholders
    left out, summed over the request's admissions.
    """

    def __init__(self, harness: EngineHarness) -> None:
        scheduler = harness.scheduler
        self.unit = scheduler.hash_block_size
        manager, pool = scheduler.kv_cache_manager, scheduler.kv_cache_manager.block_pool
        self.held: set = set()
        self.evicted: dict[str, int] = Counter()
        self.cold: dict[str, int] = Counter()
        self.hit_blocks: dict[str, int] = Counter()
        self._looked_up: dict[str, tuple[int, int, int]] = {}  # request id -> (units, never-evicted hit, blocks)
        self._evicting = False
        insert, remove, new_blocks = pool._insert_block_hash, pool._remove_cached_block_hashes, pool.get_new_blocks
        find, computed, record = (manager.coordinator.find_longest_cache_hit, manager.get_computed_blocks,
                                  manager.record_prefix_cache_stats)  # fmt: skip

        def inserting(key, block, num_tokens):
            self.held.add(key)
            return insert(key, block, num_tokens)

        def removing(block):
            removed = remove(block)
            if not self._evicting:
                self.held.difference_update(removed)
            return removed

        def getting_new_blocks(num_blocks):
            self._evicting = True
            try:
                return new_blocks(num_blocks)
            finally:
                self._evicting = False

        def never_evicted(block_hash, group_ids):
            if all(make_block_hash_with_group_id(block_hash, group) in self.held for group in group_ids):
                return [pool.null_block] * len(group_ids)
            return None

        def finding(block_hashes, max_cache_hit_length, *args, **kwargs):
            pool.get_cached_block = never_evicted
            try:
                _, hit, *_ = find(block_hashes, max_cache_hit_length, *args, **kwargs)
            finally:
                del pool.get_cached_block
            self._bound = (max_cache_hit_length // self.unit, hit)
            return find(block_hashes, max_cache_hit_length, *args, **kwargs)

        def looking_up(request, *args, **kwargs):  # 0.33 on: and a bound on the hit
            self._bound = None
            manager.coordinator.find_longest_cache_hit = finding
            try:
                result = computed(request, *args, **kwargs)
            finally:
                del manager.coordinator.find_longest_cache_hit
            if self._bound is not None:
                blocks = sum(not block.is_null for group in result[0].blocks for block in group)
                self._looked_up[request.request_id] = (*self._bound, blocks)
            return result

        def recording(request, num_hits):
            record(request, num_hits)
            looked_up = self._looked_up.pop(request.request_id, None)
            if looked_up is None:
                return
            units, never_evicted_hit, blocks = looked_up
            self.hit_blocks[request.request_id] += blocks
            if not manager.prefix_cache_lookup_enabled(request):
                return
            reach = max(never_evicted_hit, num_hits)
            self.evicted[request.request_id] += reach - num_hits
            self.cold[request.request_id] += units * self.unit - reach

        pool._insert_block_hash, pool._remove_cached_block_hashes, pool.get_new_blocks = inserting, removing, getting_new_blocks
        manager.get_computed_blocks, manager.record_prefix_cache_stats = looking_up, recording
