"""Readers of vLLM's requests, of a step's scheduler output and of the engine's config.

Most are built once, for the installed release (``internals`` says what it has), and
return a plain function or an ``attrgetter``: the engine thread calls them at every
admission, step and release with no check of the release left in the call. The rest
read a value once, as the engine starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import compress
from operator import attrgetter
from typing import Any

from otel_kvcache import names
from otel_kvcache.vllm_compat import internals


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


def scheduler_block_size(scheduler: Any) -> int:
    """Tokens per KV block, as the scheduler counts them."""
    if internals.has("block_size"):
        return scheduler.block_size
    return scheduler.cache_config.block_size


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


def running_status() -> Any:
    """``RequestStatus.RUNNING``, compared by identity (``RequestStatus.name`` is a
    Python property: a call per read)."""
    from vllm.v1.request import RequestStatus

    return RequestStatus.RUNNING


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


def statuses_waiting_for_blocks() -> frozenset:
    """The ``RequestStatus`` members of a request an admission attempt left waiting
    (not one parked for a remote KV transfer or a grammar): after ``schedule()``,
    an attempted request in one of them found no blocks. (A set of members, as
    ``RequestStatus.name`` is slow.)"""
    from vllm.v1.request import RequestStatus

    return frozenset(status for status in RequestStatus if status.name in ("WAITING", "PREEMPTED"))
