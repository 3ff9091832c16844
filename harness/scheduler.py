"""vLLM's real V1 Scheduler, built in-process for the tests and the benchmarks.

One full-attention KV group over the demo's tiny llama config (vLLM reads the
config only; no weights are loaded), so that the tests (``tests/engine_harness.py``)
and the benchmarks (``benchmarks/scheduler_driver.py``) drive the same scheduler
without importing each other; or a hybrid model's groups (``KVLayout``), built as
vLLM's EngineCore builds its scheduler for them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import vllm.triton_utils
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ObservabilityConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
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


@dataclass(frozen=True)
class KVLayout:
    """A hybrid model's KV cache groups: ``(kind, block size)`` each, ``full`` (attention),
    ``sliding`` (attention over the last ``SLIDING_WINDOW`` tokens) or ``mamba`` (a Mamba/GDN
    state, cached in vLLM's "align" mode), and vLLM's ``--prefix-match-unit``."""

    groups: tuple[tuple[str, int], ...]
    prefix_match_unit: int | None = None


SLIDING_WINDOW = 64

LAYOUTS = {
    "sliding-window": KVLayout((("full", 16), ("sliding", 16))),
    "mamba": KVLayout((("full", 64), ("mamba", 64))),
    "mamba-finer-attention": KVLayout((("full", 16), ("mamba", 64))),
    "prefix-match-unit": KVLayout((("full", 64), ("mamba", 64)), prefix_match_unit=16),
}
"""The hybrid layouts the tests run: attention beside a sliding window, and beside a Mamba
group of the same and of a larger block size, hashed at the block size or finer."""


def _group_spec(kind: str, block_size: int, page_size: int | None,
                speculative_tokens: int = 0) -> FullAttentionSpec | SlidingWindowSpec | MambaSpec:  # fmt: skip
    attention = {"block_size": block_size, "num_kv_heads": 1, "head_size": 64, "dtype": torch.float32}
    if kind == "full":
        return FullAttentionSpec(**attention)
    if kind == "sliding":
        return SlidingWindowSpec(**attention, sliding_window=SLIDING_WINDOW)
    # vLLM pads a Mamba state's page to the attention page, so that every group's blocks
    # come from one pool; with speculative decoding a state block per draft token.
    return MambaSpec(block_size=block_size, shapes=((4, 64),), dtypes=(torch.float32,), page_size_padded=page_size,
                     mamba_cache_mode="align", num_speculative_blocks=speculative_tokens)  # fmt: skip


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
    layout: KVLayout | None = None,
    speculative_tokens: int = 0,
    **scheduler_options,
) -> Scheduler:
    """A real Scheduler on one full-attention KV group of ``block_size``, or on ``layout``'s
    groups, its block sizes resolved as vLLM's EngineCore resolves them
    (``resolve_kv_cache_block_sizes``: the scheduler's block size, and the
    ``hash_block_size`` its requests' prefixes are hashed at); ``kv_cache_metrics_sample``
    turns on vLLM's own ``--kv-cache-metrics`` at that sample rate, ``kv_transfer_config``
    gives it a KV connector (its scheduler side: NIXL's needs no NIXL library),
    ``speculative_tokens`` n-gram speculative decoding with that many draft tokens a step;
    other keywords go to its ``SchedulerConfig`` (``max_num_inflight_kv_loads``, from 0.34)."""
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
            cache_config=_cache_config(block_size, enable_prefix_caching, layout),
            kv_events_config=KVEventsConfig(enable_kv_cache_events=kv_events, publisher="null"),
            observability_config=observability,
            kv_transfer_config=kv_transfer_config,
            speculative_config=_ngram(speculative_tokens),
        )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    vllm_config.parallel_config.data_parallel_index = data_parallel_rank
    if layout is None:
        kv_cache_config = _one_group(num_blocks, block_size)
        block_size = hash_block_size = block_size
    else:
        kv_cache_config = _groups(num_blocks, layout, speculative_tokens)
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=log_stats,
    )


def _cache_config(block_size: int, enable_prefix_caching: bool, layout: KVLayout | None) -> CacheConfig:
    """One group's, or a hybrid model's as vLLM's ``MambaModelConfig`` leaves it: "align"
    mode, its block size the Mamba group's."""
    if layout is None:
        return CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    mamba = [size for kind, size in layout.groups if kind == "mamba"]
    return CacheConfig(
        block_size=mamba[0] if mamba else layout.groups[0][1],
        enable_prefix_caching=enable_prefix_caching,
        mamba_cache_mode="align" if mamba else "none",
        mamba_block_size=mamba[0] if mamba else None,
        prefix_match_unit=layout.prefix_match_unit,
    )


def _one_group(num_blocks: int, block_size: int) -> KVCacheConfig:
    spec = _group_spec("full", block_size, None)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(TINY_LLAMA_CONFIG["num_hidden_layers"])]
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        # One layer-outermost tensor, as vLLM's get_kv_cache_configs lays out one group.
        kv_cache_tensors=[
            KVCacheTensor(size=page * num_blocks * len(layers), layers=layers,
                          layer_stride=page * num_blocks, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )


def _groups(num_blocks: int, layout: KVLayout, speculative_tokens: int) -> KVCacheConfig:
    page = _group_spec("full", layout.groups[0][1], None).page_size_bytes
    groups = [
        KVCacheGroupSpec([f"model.layers.{index}.{kind}"], _group_spec(kind, block_size, page, speculative_tokens))
        for index, (kind, block_size) in enumerate(layout.groups)
    ]
    layers = [name for group in groups for name in group.layer_names]
    return KVCacheConfig(
        num_blocks=num_blocks,
        # The groups' layers overlay one another (a block id is one group's at a time).
        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks, layers=layers, layer_stride=0, block_stride=page)],
        kv_cache_groups=groups,
    )


def _ngram(draft_tokens: int) -> SpeculativeConfig | None:
    """N-gram speculation (prompt lookup: no draft model), or None without draft tokens."""
    if not draft_tokens:
        return None
    return SpeculativeConfig(method="ngram", num_speculative_tokens=draft_tokens, prompt_lookup_max=4,
                             prompt_lookup_min=2)  # fmt: skip


def model_runner_output(req_ids: list[str], sampled_token_ids: list[list[int]], **fields) -> ModelRunnerOutput:
    """What the model runner hands the scheduler after a step: ``req_id_to_index`` too
    where the installed vLLM has it (0.34 dropped it: a request's row is its place in
    ``req_ids``)."""
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:
        fields["req_id_to_index"] = {request_id: i for i, request_id in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_token_ids, **fields)
