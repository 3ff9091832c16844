"""The vLLM internals otel-kvcache reads without a hook, and what depends on each.

A hook point that is missing is reported by the patcher (``hooks.py``); an
attribute or a local name that is missing would fail later, inside our own
code, at every call. So each is looked for once, in vLLM's code itself (the
names its ``__init__`` assigns, a dataclass's fields, a method's locals), when
the first engine is built and by ``otel-kvcache doctor``: a missing one is
reported once, by name, with the installed version, and only what depends on
it is switched off.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from functools import lru_cache
from typing import NamedTuple

from otel_kvcache.vllm_compat.versions import installed_vllm_version

_logger = logging.getLogger(__name__)

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
    core: bool = False
    """Whether the request span cannot be made without it."""
    where: str = "__init__"

    @property
    def qualname(self) -> str:
        if self.kind == "local":
            return f"{self.owner}.{self.where} local {self.name!r}"
        return f"{self.owner}.{self.name}"


INTERNALS: tuple[Internal, ...] = (
    Internal("scheduler_requests", SCHEDULER, "Scheduler", "requests", "assigned", "every request's span", core=True),
    Internal("kv_cache_manager", SCHEDULER, "Scheduler", "kv_cache_manager", "assigned", "everything", core=True),
    Internal("block_size", SCHEDULER, "Scheduler", "block_size", "assigned", "block counts in tokens", core=True),
    Internal("deferred_frees", SCHEDULER, "Scheduler", "deferred_frees", "assigned",
             "orphaned-block counts while frees wait behind an in-flight step"),
    Internal("schedule_request_local", SCHEDULER, "Scheduler", "request", "local",
             "the stall of the request a preemption made room for", where="schedule"),
    Internal("block_pool", MANAGER, "KVCacheManager", "block_pool", "assigned", "the pool's metrics", core=True),
    Internal("coordinator", MANAGER, "KVCacheManager", "coordinator", "assigned", "blocks held per request",
             core=True),
    Internal("lookup_enabled", MANAGER, "KVCacheManager", "prefix_cache_lookup_enabled", "method",
             "prefix-cache queries and hits"),
    Internal("req_to_blocks", SINGLE_TYPE, "SingleTypeKVCacheManager", "req_to_blocks", "assigned",
             "blocks held per request", core=True),
    Internal("free_block_queue", POOL, "BlockPool", "free_block_queue", "assigned", "the pool's metrics", core=True),
    Internal("num_gpu_blocks", POOL, "BlockPool", "num_gpu_blocks", "assigned", "the pool's size", core=True),
    Internal("num_free_blocks", UTILS, "FreeKVCacheBlockQueue", "num_free_blocks", "assigned",
             "free blocks", core=True),
    Internal("block_ref_cnt", UTILS, "KVCacheBlock", "ref_cnt", "field", "the pool's composition", core=True),
    Internal("block_hash", UTILS, "KVCacheBlock", "_block_hash", "field", "cached blocks and their hits"),
    Internal("new_requests", OUTPUT, "SchedulerOutput", "scheduled_new_reqs", "field", "admissions", core=True),
    Internal("cached_requests", OUTPUT, "SchedulerOutput", "scheduled_cached_reqs", "field", "resumptions",
             core=True),
    Internal("resumed_req_ids", OUTPUT, "CachedRequestData", "resumed_req_ids", "field", "resumptions",
             core=True),
    Internal("trace_headers", REQUEST, "Request", "trace_headers", "assigned", "the span's place in the trace"),
    Internal("arrival_time", REQUEST, "Request", "arrival_time", "assigned", "the span's start", core=True),
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
    """The keys of the internals the installed vLLM lacks, each reported once (at the first call)."""
    absent = frozenset(internal.key for internal in INTERNALS if not is_present(internal))
    for internal in INTERNALS:
        if internal.key in absent:
            _logger.warning(
                "otel-kvcache: vLLM %s has no %s; %s %s",
                installed_vllm_version(),
                internal.qualname,
                "no KV telemetry is recorded" if internal.core else "not recorded:",
                "" if internal.core else internal.feeds,
            )
    return absent


def has(key: str) -> bool:
    return key not in missing()


def core_missing() -> list[str]:
    return [internal.qualname for internal in INTERNALS if internal.core and internal.key in missing()]
