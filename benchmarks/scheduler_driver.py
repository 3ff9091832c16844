"""A lean loop around vLLM's real V1 scheduler with fake model outputs, at constant concurrency.

Whenever a request finishes, a new one is admitted, so the scheduler always
holds ``concurrency`` requests; output lengths vary around the workload's so
that requests finish at a steady rate. Only the model runner is faked: one sampled
token per scheduled request per step.
"""

from __future__ import annotations

import itertools
import multiprocessing
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from harness.offloading import OffloadingWorker, offloading
from harness.scheduler import LAYOUTS, VOCAB_SIZE, make_model_config, make_scheduler, model_runner_output

BLOCK_SIZE = 16
TIER_BYTES_PER_BLOCK = 16384
"""A block of the harness's model in vLLM's CPU tier (its KV bytes per block, aligned)."""


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    prompt_len: int
    shared_prefix: int
    output_len: int
    num_blocks: int
    layout: str | None = None
    """One of ``harness.scheduler.LAYOUTS`` (a hybrid model's groups), or one full-attention group."""
    offload_blocks: int = 0
    """Blocks of a CPU offload tier (vLLM's OffloadingConnector, LRU), its workers played
    (``harness.offloading``); 0: none."""

    @property
    def blocks_per_request(self) -> int:
        return -(-(self.prompt_len + self.output_len) // BLOCK_SIZE)


TARGETS = {"decode-heavy": 0.01, "churn": 0.01, "wide": 0.01}
"""The overhead targets by workload shape (a small-pool variant shares its shape's), everything
on: the 1 % of #37 (``benchmarks/RESULTS.md``)."""


def against_target(overhead: float, workload_name: str) -> str:
    """``overhead`` (0.01 is 1 %) against the workload's target, as the benchmarks print it."""
    target = TARGETS.get(workload_name.split("/")[0])
    if target is None:
        return "no target"
    return f"target {100 * target:g} %: {'met' if overhead <= target else 'NOT met'}"


def workloads() -> list[Workload]:
    """The issue's three shapes, each on a roomy pool and on one small enough to preempt.

    Half the roomy pool: the shared prefix leaves a request about two thirds of its
    blocks of its own, so a pool 60 % as large still fits the steady state and
    never preempted; at half, the running requests' growth preempts throughout
    (decode-heavy's every 3-6 steps, churn's in bursts)."""
    shapes = [
        ("decode-heavy", 256, 512, 256, 256),
        ("churn", 256, 256, 128, 64),
        ("wide", 1024, 512, 256, 256),
    ]
    result = []
    for name, concurrency, prompt, shared, output in shapes:
        per_request = -(-(prompt + output) // BLOCK_SIZE)
        roomy = concurrency * per_request + 64
        result.append(Workload(name, concurrency, prompt, shared, output, roomy))
        result.append(Workload(f"{name}/small-pool", concurrency, prompt, shared, output, roomy // 2))
    # Churn on a hybrid model's groups (attention in blocks of 16 beside a Mamba group in
    # blocks of 64, hashed every 16 tokens): its attention blocks, and two Mamba state blocks.
    churn = next(workload for workload in result if workload.name == "churn")
    hybrid_blocks = churn.concurrency * (churn.blocks_per_request + 2) + 64
    result.append(Workload("churn/hybrid", 256, 256, 128, 64, hybrid_blocks, layout="mamba-finer-attention"))
    # Churn with a CPU offload tier as large as its pool: each request's prompt blocks stored,
    # the shared prefix's kept, the rest evicted as requests come.
    result.append(Workload("churn/offload", 256, 256, 128, 64, churn.num_blocks, offload_blocks=churn.num_blocks))
    return result


def in_fresh_processes(function: Callable, workload_names: list[str], *args) -> Iterator[tuple[str, object]]:
    """``(name, function(name, *args))`` for each workload, each in a fresh process:
    instrumenting is for the process's life."""
    context = multiprocessing.get_context("spawn")
    for name in workload_names:
        with context.Pool(1) as pool:
            yield name, pool.apply(function, (name, *args))


_model_config = None


def model_config():
    global _model_config
    if _model_config is None:
        _model_config = make_model_config(tempfile.mkdtemp(prefix="bench-model-"))
    return _model_config


class Driver:
    """One scheduler running one workload."""

    def __init__(self, workload: Workload, log_stats: bool = True, kv_cache_metrics_sample: float | None = None):
        self.workload = workload
        self.offloading_worker = OffloadingWorker() if workload.offload_blocks else None
        tier = offloading(workload.offload_blocks * TIER_BYTES_PER_BLOCK) if workload.offload_blocks else None
        scheduler = make_scheduler(
            model_config(),
            num_blocks=workload.num_blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=workload.concurrency,
            max_num_batched_tokens=8192,
            log_stats=log_stats,
            kv_events=False,
            kv_cache_metrics_sample=kv_cache_metrics_sample,
            layout=LAYOUTS.get(workload.layout),
            kv_transfer_config=tier,
        )
        self.scheduler = scheduler
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(scheduler.hash_block_size, sha256)
        self._ids = itertools.count()
        self._shared = [(k * 13 + 5) % VOCAB_SIZE for k in range(workload.shared_prefix)]
        self.finished = 0
        self.steps = 0

    def _new_request(self) -> Request:
        n = next(self._ids)
        # Output lengths spread evenly over [0.5, 1.5) x output_len (same sequence in
        # every process), so requests finish at a steady rate instead of in waves.
        output_len = self.workload.output_len * (64 + (n * 37) % 128) // 128
        # Beyond the shared prefix no two prompts match: the request's number leads the rest.
        unique = [n % VOCAB_SIZE, n // VOCAB_SIZE % VOCAB_SIZE] + [
            (n * 7919 + 31 * k) % VOCAB_SIZE for k in range(self.workload.prompt_len - self.workload.shared_prefix - 2)
        ]
        return Request(
            request_id=f"req-{n}",
            prompt_token_ids=self._shared + unique,
            sampling_params=SamplingParams(max_tokens=output_len, ignore_eos=True),
            pooling_params=None,
            block_hasher=self._hasher,
        )

    def top_up(self) -> None:
        scheduler = self.scheduler
        missing = self.workload.concurrency - len(scheduler.requests)
        for _ in range(missing):
            scheduler.add_request(self._new_request())

    def step(self) -> None:
        scheduler = self.scheduler
        output = scheduler.schedule()
        req_ids = list(output.num_scheduled_tokens)
        worker = self.offloading_worker
        transfers = {} if worker is None else {"kv_connector_output": worker.output()}
        runner_output = model_runner_output(req_ids, [[7]] * len(req_ids), **transfers)
        if worker is not None:
            worker.take(output)
        before = len(scheduler.requests)
        scheduler.update_from_output(output, runner_output)
        self.finished += before - len(scheduler.requests)
        self.steps += 1
        self.top_up()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
