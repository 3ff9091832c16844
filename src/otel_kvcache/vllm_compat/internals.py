"""The vLLM internals otel-kvcache reads without a hook, and what depends on each.

A hook point that is missing is reported by the patcher (``hooks.py``); an
attribute or a local name that is missing would fail later, inside our own
code, at every call. So each is looked for once, in vLLM's code itself (the
names its ``__init__`` assigns, a dataclass's fields, a method's locals), when
the first engine is built and by ``otel-kvcache doctor``. Where vLLM offers a
second source (``fallback``), that is read instead; a missing one is reported
in the engine's start-up line (``survey.py``), and only what depends on it is
switched off. An internal the request span cannot be made without says why
(``why_core``): vLLM keeps it nowhere else.
"""

from __future__ import annotations

import importlib
import inspect
from functools import lru_cache
from typing import NamedTuple

SCHEDULER = "vllm.v1.core.sched.scheduler"
OUTPUT = "vllm.v1.core.sched.output"
MANAGER = "vllm.v1.core.kv_cache_manager"
SINGLE_TYPE = "vllm.v1.core.single_type_kv_cache_manager"
POOL = "vllm.v1.core.block_pool"
UTILS = "vllm.v1.core.kv_cache_utils"
REQUEST = "vllm.v1.request"


class Internal(NamedTuple):
    key: str
    module: str
    owner: str
    name: str
    kind: str
    """``assigned`` (by ``__init__``), ``field`` (of a dataclass or a slotted class),
    ``method`` (defined on the class), or ``local`` (of the method ``where``)."""
    feeds: str
    """The telemetry that depends on it."""
    why_core: str = ""
    """Why the request span cannot be made without it (no second source in vLLM
    gives it): empty for an internal the span survives the loss of."""
    where: str = "__init__"
    fallback: Internal | None = None
    """A second source in vLLM, read where this one is gone (``read_from``)."""

    @property
    def qualname(self) -> str:
        if self.kind == "local":
            return f"{self.owner}.{self.where} local {self.name!r}"
        return f"{self.owner}.{self.name}"


_NO_SECOND_SOURCE = "vLLM keeps it nowhere else"

INTERNALS: tuple[Internal, ...] = (
    Internal("scheduler_requests", SCHEDULER, "Scheduler", "requests", "assigned", "every request's span",
             why_core="the only map from a scheduled request id to its Request"),
    Internal("kv_cache_manager", SCHEDULER, "Scheduler", "kv_cache_manager", "assigned", "everything",
             why_core="every KV read starts from it"),
    Internal("block_size", SCHEDULER, "Scheduler", "block_size", "assigned", "block counts in tokens",
             fallback=Internal("cache_config", SCHEDULER, "Scheduler", "cache_config", "assigned",
                               "block counts in tokens (its block_size)")),
    Internal("deferred_frees", SCHEDULER, "Scheduler", "deferred_frees", "assigned",
             "orphaned-block counts while frees wait behind an in-flight step"),
    Internal("schedule_request_local", SCHEDULER, "Scheduler", "request", "local",
             "the stall of the request a preemption made room for", where="schedule"),
    Internal("schedule_allocation_local", SCHEDULER, "Scheduler", "new_blocks", "local",
             "stalls told apart from requests vLLM skipped or held back (without it, counted as stalls)",
             where="schedule"),
    Internal("block_pool", MANAGER, "KVCacheManager", "block_pool", "assigned", "the pool's metrics",
             why_core=_NO_SECOND_SOURCE + ": the pool whose blocks the span counts"),
    Internal("coordinator", MANAGER, "KVCacheManager", "coordinator", "assigned", "blocks held per request",
             why_core=_NO_SECOND_SOURCE + ": the per-group managers holding each request's blocks"),
    Internal("lookup_enabled", MANAGER, "KVCacheManager", "prefix_cache_lookup_enabled", "method",
             "prefix-cache queries and hits"),
    Internal("req_to_blocks", SINGLE_TYPE, "SingleTypeKVCacheManager", "req_to_blocks", "assigned",
             "blocks held per request", why_core=_NO_SECOND_SOURCE + ": each request's block list"),
    Internal("free_block_queue", POOL, "BlockPool", "free_block_queue", "assigned", "the pool's metrics",
             why_core="the pool's composition mirrors its order, and the span's pool readings its length"),
    Internal("num_gpu_blocks", POOL, "BlockPool", "num_gpu_blocks", "assigned", "the pool's size",
             fallback=Internal("pool_blocks", POOL, "BlockPool", "blocks", "assigned", "the pool's size")),
    Internal("num_free_blocks", UTILS, "FreeKVCacheBlockQueue", "num_free_blocks", "assigned", "free blocks",
             why_core="read at every admission, release and step (a plain attribute; a method call there "
                      "would cost the engine thread more than the budget)"),
    Internal("block_ref_cnt", UTILS, "KVCacheBlock", "ref_cnt", "field", "the pool's composition",
             why_core=_NO_SECOND_SOURCE + ": which blocks are in use"),
    # A property over the _block_hash slot up to 0.33; 0.34 made the slot itself public.
    Internal("block_hash", UTILS, "KVCacheBlock", "_block_hash", "field", "cached blocks and their hits",
             fallback=Internal("public_block_hash", UTILS, "KVCacheBlock", "block_hash", "field",
                               "cached blocks and their hits")),
    Internal("new_requests", OUTPUT, "SchedulerOutput", "scheduled_new_reqs", "field",
             "admissions (the span's admission time, first blocks and prefix hits)"),
    # 0.34 sends a resumed request again in full, among the new ones: the admission path
    # tells a resumption by the preemption it saw.
    Internal("cached_requests", OUTPUT, "SchedulerOutput", "scheduled_cached_reqs", "field", "resumptions",
             fallback=Internal("new_requests", OUTPUT, "SchedulerOutput", "scheduled_new_reqs", "field",
                               "resumptions")),
    Internal("resumed_req_ids", OUTPUT, "CachedRequestData", "resumed_req_ids", "field", "resumptions",
             fallback=Internal("new_requests", OUTPUT, "SchedulerOutput", "scheduled_new_reqs", "field",
                               "resumptions")),
    # On a layout whose blocks come and go while a request runs (sliding window, Mamba).
    Internal("new_block_ids", OUTPUT, "CachedRequestData", "new_block_ids", "field",
             "the span's peak blocks where blocks come and go while a request runs (sliding window, Mamba)"),
    Internal("trace_headers", REQUEST, "Request", "trace_headers", "assigned", "the span's place in the trace"),
    # Without it a span starts when the engine first saw the request (its first
    # admission attempt or release), which leaves out its wait before that.
    Internal("arrival_time", REQUEST, "Request", "arrival_time", "assigned", "the span's start at arrival"),
    # Who holds the KV cache (attribution.py).
    Internal("session_id", REQUEST, "Request", "session_id", "assigned", "session.id and the sessions' turn gaps"),
    Internal("priority", REQUEST, "Request", "priority", "assigned", "vllm.request.priority"),
    Internal("lora_request", REQUEST, "Request", "lora_request", "assigned", "a LoRA adapter's name as the model"),
    # Where a prefix hit can end on a model of several KV cache groups (layouts.py).
    Internal("hash_block_size", SCHEDULER, "Scheduler", "hash_block_size", "assigned",
             "prefix numbers in vLLM's own unit where it hashes finer than it schedules",
             fallback=Internal("block_size", SCHEDULER, "Scheduler", "block_size", "assigned",
                               "prefix numbers in vLLM's own unit where it hashes finer than it schedules")),
    Internal("shared_prefix_boundary", REQUEST, "Request", "shared_prefix_boundary", "assigned",
             "a hybrid model's misses whose attention blocks were in use, as evicted (cold without it)"),
    Internal("cached_block_hashes_by_block", POOL, "BlockPool", "cached_block_hashes_by_block", "assigned",
             "a hybrid model's hits that end inside a block, as evicted misses (cold without it)"),
    Internal("cached_block_hash_to_block", POOL, "BlockPool", "cached_block_hash_to_block", "assigned",
             "a hybrid model's misses where running requests held the other groups' entries, as evicted "
             "(cold without it)"),
)  # fmt: skip


def is_present(internal: Internal) -> bool:
    """Whether the installed vLLM has it (imports the module that defines it)."""
    try:
        owner = getattr(importlib.import_module(internal.module), internal.owner)
    except (ImportError, AttributeError):
        return False
    if internal.kind == "method":
        return callable(getattr(owner, internal.name, None))
    if internal.kind == "field":
        return internal.name in getattr(owner, "__dataclass_fields__", {}) or internal.name in _slots(owner)
    method = getattr(owner, internal.where, None)
    code = getattr(inspect.unwrap(method), "__code__", None) if method is not None else None  # vLLM's, not a wrapper
    if code is None:
        return False
    # An attribute __init__ assigns is among its code's names; a local, among its variables.
    locals_ = code.co_varnames + code.co_cellvars  # a local a nested function reads is a cell
    return internal.name in (locals_ if internal.kind == "local" else code.co_names)


def _slots(owner: type) -> set[str]:
    return {name for klass in owner.__mro__ for name in getattr(klass, "__slots__", ())}


@lru_cache(maxsize=1)
def missing() -> frozenset[str]:
    """The keys of the internals the installed vLLM lacks (a fallback may stand in)."""
    return frozenset(internal.key for internal in INTERNALS if not is_present(internal))


def has(key: str) -> bool:
    return key not in missing()


def read_from(internal: Internal) -> Internal | None:
    """The internal read for ``internal``: itself, its fallback, or None if neither is there."""
    if internal.key not in missing():
        return internal
    if internal.fallback is not None and is_present(internal.fallback):
        return internal.fallback
    return None
