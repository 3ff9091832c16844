"""vLLM's real V1 Scheduler, built in-process for the tests and the benchmarks.

One full-attention KV group over the demo's tiny llama config (vLLM reads the
config only; no weights are loaded), so that the tests (``tests/engine_harness.py``)
and the benchmarks (``benchmarks/scheduler_driver.py``) drive the same scheduler
without importing each other.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import torch
import vllm.triton_utils
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ObservabilityConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from demo.tiny_model import LLAMA_CONFIG

VOCAB_SIZE = 1000
MAX_MODEL_LEN = 2048

# The demo's tiny llama: here vLLM only reads its config; no weights are loaded.
TINY_LLAMA_CONFIG = {**LLAMA_CONFIG, "vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_MODEL_LEN}


@contextlib.contextmanager
def scheduler_only_platform() -> Iterator[None]:
    """vLLM's config as its CPU platform builds it, without the kernel check.

    From 0.34 on, ``CpuPlatform.check_and_update_config`` raises "vLLM on x86 CPUs
    requires Triton" where triton-cpu is missing (0.33 only warned), which is here:
    the CUDA wheel brings no triton-cpu. The scheduler and the KV manager run no
    kernel, so while a config is built the platform is told Triton is there (it
    reads ``vllm.triton_utils.HAS_TRITON`` as it runs); everything else it sets
    up is as on a CPU server. The package itself never does this.
    """
    has_triton = vllm.triton_utils.HAS_TRITON
    vllm.triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        vllm.triton_utils.HAS_TRITON = has_triton


def make_model_config(directory: str) -> ModelConfig:
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(TINY_LLAMA_CONFIG, f)
    with scheduler_only_platform():
        return ModelConfig(model=directory, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float32")


def make_scheduler(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 4096,
    enable_prefix_caching: bool = True,
    data_parallel_rank: int = 0,
    log_stats: bool = True,
    kv_events: bool = True,
    kv_cache_metrics_sample: float | None = None,
    kv_transfer_config: KVTransferConfig | None = None,
    **scheduler_options,
) -> Scheduler:
    """A real Scheduler on one full-attention KV group; ``kv_cache_metrics_sample``
    turns on vLLM's own ``--kv-cache-metrics`` at that sample rate, ``kv_transfer_config``
    gives it a KV connector (its scheduler side: NIXL's needs no NIXL library); other
    keywords go to its ``SchedulerConfig`` (``max_num_inflight_kv_loads``, from 0.34)."""
    observability = (
        ObservabilityConfig(kv_cache_metrics=True, kv_cache_metrics_sample=kv_cache_metrics_sample)
        if kv_cache_metrics_sample
        else ObservabilityConfig()
    )
    with scheduler_only_platform():
        vllm_config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=MAX_MODEL_LEN,
                is_encoder_decoder=False,
                **scheduler_options,
            ),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events, publisher="null"),
            observability_config=observability,
            kv_transfer_config=kv_transfer_config,
        )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    vllm_config.parallel_config.data_parallel_index = data_parallel_rank
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(TINY_LLAMA_CONFIG["num_hidden_layers"])]
    page = spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        # One layer-outermost tensor, as vLLM's get_kv_cache_configs lays out one group.
        kv_cache_tensors=[
            KVCacheTensor(size=page * num_blocks * len(layers), layers=layers,
                          layer_stride=page * num_blocks, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=log_stats,
    )


def model_runner_output(req_ids: list[str], sampled_token_ids: list[list[int]], **fields) -> ModelRunnerOutput:
    """What the model runner hands the scheduler after a step: ``req_id_to_index`` too
    where the installed vLLM has it (0.34 dropped it: a request's row is its place in
    ``req_ids``)."""
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:
        fields["req_id_to_index"] = {request_id: i for i, request_id in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids, **fields)
