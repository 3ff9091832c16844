"""The hook-point table: each vLLM method otel-kvcache wraps, and what it records there.

Each hook point names the releases it was verified on (by this package's tests
against the real scheduler) and, where it exists only in some, the first release
without it or the first with it. A hook point missing from the installed vLLM is
reported once by name (``hooks.py``, ``survey.py``) and the others keep working:
only what it ``feeds`` is off, unless the request span cannot be made without it
(``why_core``).
"""

from __future__ import annotations

from typing import NamedTuple

from packaging.version import Version

from otel_kvcache.vllm_compat.versions import VERIFIED, installed_vllm_version, release_of

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
KV_CACHE_MANAGER_MODULE = "vllm.v1.core.kv_cache_manager"
BLOCK_POOL_MODULE = "vllm.v1.core.block_pool"
KV_CACHE_UTILS_MODULE = "vllm.v1.core.kv_cache_utils"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
OFFLOADING_SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
OFFLOAD_MANAGER_MODULE = "vllm.v1.kv_offload.base"


class HookPoint(NamedTuple):
    module: str
    owner: str
    method: str
    role: str
    """Which wrapper in ``patch.py`` goes here, and what the method means to us."""
    feeds: str
    """What it records: switched off where it is missing."""
    parameters: tuple[str, ...] = ()
    """The leading parameters after the instance that its wrapper reads, as verified."""
    why_core: str = ""
    """Why the request span cannot be made without it (``otel-kvcache doctor`` fails): no
    second source in vLLM tells the same. Empty for a hook point the span survives the loss of."""
    hot: bool = True
    """Runs in the engine's loop, up to many times a step: patched with a plain
    function: wrapt's proxy adds frames of its own to every call (``hooks.py``)."""
    verified_on: tuple[str, ...] = VERIFIED
    until: str | None = None
    """The first release without this hook point (it exists only before it), or None."""
    since: str | None = None
    """The first release with this hook point, or None (every supported one)."""

    @property
    def qualname(self) -> str:
        return f"{self.owner}.{self.method}"

    def applies_to(self, installed: str) -> bool:
        """Whether the installed vLLM (a version string) should have this hook point."""
        release = release_of(installed)
        if release is None:
            return True
        return (self.until is None or release < Version(self.until)) and (
            self.since is None or release >= Version(self.since)
        )


HOOK_POINTS: tuple[HookPoint, ...] = (
    # Builds the engine's KV telemetry right after vLLM built its KV manager.
    HookPoint(SCHEDULER_MODULE, "Scheduler", "__init__", "scheduler_init",
              "everything: the engine's telemetry is built there",
              why_core="the engine's telemetry is built beside the scheduler vLLM just built", hot=False),
    # Once per step; its output lists the step's new and resumed requests. The
    # step's work is done after it (the pool's gauges are read as they are).
    HookPoint(SCHEDULER_MODULE, "Scheduler", "schedule", "scheduled",
              "admissions, the step's chores (pool settling, leak reconciliation, hand-over)",
              why_core="the step: admissions, the pool's settling and the hand-over of finished spans run there"),
    # The waiting loop's prefix lookup: one call per admission attempt of a
    # new or preempted request, before its blocks are allocated. The loop stops
    # at the first attempt whose allocation fails: only a step's last one can.
    HookPoint(SCHEDULER_MODULE, "Scheduler", "_get_local_prefix_cache_hit", "admission_attempt",
              "allocation stalls", ("request",)),
    # Frees all of a request's blocks and increments Request.num_preemptions.
    HookPoint(SCHEDULER_MODULE, "Scheduler", "_preempt_request", "preempt",
              "preemptions and recomputed tokens", ("request",)),
    # Every finished request (stopped, aborted, errored, after a delayed
    # connector free) gives its blocks back here; they are popped inside.
    HookPoint(SCHEDULER_MODULE, "Scheduler", "_free_blocks", "release",
              "the request span, freed blocks, leaks seen at release", ("request",),
              why_core="a request's end: its blocks are counted as vLLM frees them, and its span is made"),
    # Called once per successful admission with the local prefix-hit tokens
    # (get_computed_blocks also runs for admissions that fail and over-counts).
    HookPoint(KV_CACHE_MANAGER_MODULE, "KVCacheManager", "record_prefix_cache_stats", "prefix_lookup",
              "prefix-cache hit tokens and queries", ("request", "num_hits")),
    # The free queue: free_blocks prepends the blocks whose last reference went
    # and that hold no prefix, then appends those that do (evictable cache, the
    # order vLLM evicts them in); unpin_blocks (hisparse) appends too. Both build
    # the list they append for the call and drop it after: pool.py keeps it.
    # get_new_blocks pops from the head, evicting the hashed blocks it pops: not
    # hooked, as it runs dozens of times a step; pool.py infers it from the
    # queue's length.
    HookPoint(KV_CACHE_UTILS_MODULE, "FreeKVCacheBlockQueue", "prepend_n", "queue_prepend",
              "the pool's used / cached / free composition", ("blocks",)),
    HookPoint(KV_CACHE_UTILS_MODULE, "FreeKVCacheBlockQueue", "append_n", "queue_append",
              "the pool's composition, evictions and their ages", ("blocks",)),
    # hisparse: releases blocks that stay readable until reused, appending them
    # to the free queue with or without a hash.
    HookPoint(BLOCK_POOL_MODULE, "BlockPool", "unpin_blocks", "unpin",
              "the pool's composition (hisparse)", ("blocks",)),
    # A prefix hit takes cached blocks back into use.
    HookPoint(BLOCK_POOL_MODULE, "BlockPool", "touch", "touch", "prefix-cache blocks hit again", ("blocks",)),
    # A KV connector drops blocks from the prefix cache by id.
    HookPoint(BLOCK_POOL_MODULE, "BlockPool", "evict_blocks", "evict_blocks",
              "evictions a KV connector asks for", ("block_ids",)),
    # Drops every hash at once.
    HookPoint(BLOCK_POOL_MODULE, "BlockPool", "reset_prefix_cache", "reset_prefix_cache",
              "the pool's composition after a prefix-cache reset"),
    # The offloading connector's scheduler side, built from the spec that sized its tier
    # (gone once the connector is built): the tier's bytes per block.
    HookPoint(OFFLOADING_SCHEDULER_MODULE, "OffloadingConnectorScheduler", "__init__", "offload_tier_init",
              "the offload tier's bytes", ("spec",), hot=False),
    # API server: drops the HTTP request's trace headers without --otlp-traces-endpoint.
    HookPoint("vllm.v1.engine.async_llm", "AsyncLLM", "add_request", "remember_trace_headers",
              "the span's place in the caller's trace", hot=False),
    # API server, in the request's coroutine: the EngineCoreRequest bound for the engine.
    HookPoint("vllm.v1.engine.input_processor", "InputProcessor", "assign_request_id", "attach_trace_context",
              "the span's place in the caller's trace", hot=False),
    # Starts EngineCore and worker processes (named as in ``processes.PROCESS_ROLES``).
    HookPoint("multiprocessing.process", "BaseProcess", "start", "name_child_process",
              "vllm.process.role and vllm.engine.index in the resources", hot=False),
    # API server: the serving layer reads the caller's trace headers here and keeps
    # traceparent and tracestate only; 0.30 and 0.31 drop those too (return None)
    # unless tracing is on, before AsyncLLM.add_request sees them.
    HookPoint("vllm.entrypoints.serve.engine.serving", "BaseServing", "_get_trace_headers", "recover_trace_headers",
              "the caller's baggage; the span's place in the caller's trace (0.30, 0.31)",
              hot=False, verified_on=("0.32.0", "0.33.0", "0.34.0"), since="0.32"),
    *(
        HookPoint(module, owner, "_get_trace_headers", "recover_trace_headers",
                  "the caller's baggage; the span's place in the caller's trace (0.30, 0.31)",
                  hot=False, verified_on=("0.30.0", "0.31.0"), until="0.32")
        for module, owner in (
            ("vllm.entrypoints.generate.base.serving", "GenerateBaseServing"),
            ("vllm.entrypoints.pooling.base.serving", "PoolingBaseServing"),
            ("vllm.entrypoints.generate.generative_scoring.serving", "ServingGenerativeScoring"),
        )
    ),
)  # fmt: skip


CONNECTOR_HOOK_POINTS: tuple[HookPoint, ...] = (
    # Patched on each scheduler that has a KV connector, and on its connector, as the
    # engine starts: an engine without one pays nothing for them (``connectors.py``).
    # Once a step: the workers' connector output (finished sends and receives,
    # failed loads) before vLLM acts on it, and what the failures left computed.
    HookPoint(SCHEDULER_MODULE, "Scheduler", "update_from_output", "connector_output",
              "KV connector transfers: remote KV ready, sends done, failed loads",
              ("scheduler_output", "model_runner_output")),
    # Every finished request: with a connector its blocks may stay held (a send).
    HookPoint(SCHEDULER_MODULE, "Scheduler", "_free_request", "finished",
              "blocks a KV connector holds for finished requests", ("request",)),
    # Once per successful admission from the waiting queue, with vLLM's external
    # computed tokens (twice for an asynchronous load: then with 0), before the
    # connector reads (and NIXL rewrites) the request's kv_transfer_params.
    HookPoint(CONNECTOR_MODULE, "KVConnectorBase_V1", "update_state_after_alloc", "connector_allocated",
              "KV connector hit tokens, the request's role, its wait for remote KV",
              ("request", "blocks", "num_external_tokens")),
    # The transfer parameters a finished request hands the next engine: one
    # of the two, as the connector supports several KV-cache groups or not.
    *(
        HookPoint(CONNECTOR_MODULE, owner, method, "connector_finished",
                  "the link from a consumer's span to its producer's", ("request",))
        for owner, method in (
            ("KVConnectorBase_V1", "request_finished"),
            ("SupportsHMA", "request_finished_all_groups"),
        )
    ),
)  # fmt: skip


OFFLOAD_TIER_HOOK_POINTS: tuple[HookPoint, ...] = (
    # Patched on the offload tier's manager of each engine that has one (``offload_tier.py``),
    # as the connector's hook points are. Each is called with the request's ReqContext.
    # A store's chunks are allocated (evicting others) when it is prepared.
    HookPoint(OFFLOAD_MANAGER_MODULE, "OffloadingManager", "prepare_store", "tier_store_prepared",
              "the offload tier's stores and evictions", ("keys", "req_context")),
    HookPoint(OFFLOAD_MANAGER_MODULE, "OffloadingManager", "prepare_load", "tier_load_prepared",
              "the offload tier's loads, and which evictions were waste", ("keys", "req_context")),
    # A failed store frees its chunks (0.34's failed jobs).
    HookPoint(OFFLOAD_MANAGER_MODULE, "OffloadingManager", "complete_store", "tier_store_completed",
              "which evictions were waste", ("keys", "req_context", "success")),
    HookPoint(OFFLOAD_MANAGER_MODULE, "OffloadingManager", "reset_cache", "tier_reset",
              "which evictions were waste"),
)  # fmt: skip


def hook_points_of(installed: str | None = None) -> tuple[HookPoint, ...]:
    """The hook points the installed vLLM (or the version given) should have."""
    installed = installed or installed_vllm_version()
    return tuple(point for point in HOOK_POINTS if point.applies_to(installed))
