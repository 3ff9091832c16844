"""vLLM's KV offload tier (``vllm.v1.kv_offload``), as ``engine/offload_tier.py`` reads it.

``OffloadingConnector`` (``--kv-offloading-size``) keeps its tier's pool in an
``OffloadingManager`` on the scheduler side: ``CPUOffloadingManager`` for the CPU
backend, LRU or ARC. Its unit is a chunk of ``blocks_per_chunk`` GPU blocks, one by
default; a chunk is allocated when a store is prepared (so a store in flight holds
one) and freed by an eviction, a failed store or a reset. The same in 0.30 to 0.34.

The spec that sized the tier is gone once the connector is built; its bytes per chunk
are kept on the connector's scheduler side as it is built (``remember_tier_bytes``,
the ``offload_tier_init`` hook point).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from otel_kvcache.vllm_compat.kv_transfer import kv_connector

TIER_BYTES_ATTRIBUTE = "_otel_kvcache_tier_bytes_per_block"
"""Set on each ``OffloadingConnectorScheduler`` built while instrumented: its spec's
``kv_bytes_per_chunk`` (padding to vLLM's alignment included)."""


def offload_tier_manager(scheduler: Any) -> Any | None:
    """The manager of the scheduler's offload tier, where it is one whose pool we can
    read (a ``CPUOffloadingManager``); None otherwise (no offloading connector, a
    tiering manager, LMCache)."""
    manager = getattr(getattr(kv_connector(scheduler), "connector_scheduler", None), "manager", None)
    if all(hasattr(manager, name) for name in ("_num_chunks", "_get_num_free_chunks", "medium")):
        return manager
    return None


def tier_blocks(manager: Any) -> tuple[int, int]:
    """The tier's used and free blocks (chunks), as the manager counts them when it
    allocates: a chunk whose store is in flight is used."""
    capacity = manager._num_chunks
    # Read on the metric reader's thread: a reset under way may show its free list cleared
    # and not yet its allocations, for a moment.
    free = min(max(manager._get_num_free_chunks(), 0), capacity)
    return capacity - free, free


def tier_capacity_blocks(scheduler: Any, manager: Any) -> int:
    """The tier's capacity in GPU blocks: its chunks, of ``blocks_per_chunk`` blocks each."""
    config = getattr(kv_connector(scheduler).connector_scheduler, "config", None)
    return manager._num_chunks * getattr(config, "blocks_per_chunk", 1)


def tier_medium(manager: Any) -> str:
    """``cpu``: vLLM's ``Medium`` member, in lower case."""
    return str(manager.medium.value).lower()


def tier_bytes_per_block(scheduler: Any) -> int | None:
    """Bytes of one of the tier's blocks, where the connector was built while instrumented."""
    return getattr(getattr(kv_connector(scheduler), "connector_scheduler", None), TIER_BYTES_ATTRIBUTE, None)


def remember_tier_bytes(connector_scheduler: Any, spec: Any) -> None:
    """As an ``OffloadingConnectorScheduler`` is built from its spec (a ``CPUOffloadingSpec``)."""
    bytes_per_chunk = getattr(spec, "kv_bytes_per_chunk", None)
    if isinstance(bytes_per_chunk, int) and bytes_per_chunk > 0:
        setattr(connector_scheduler, TIER_BYTES_ATTRIBUTE, bytes_per_chunk)


def store_keys(prepared: Any) -> tuple[Collection[Any], Collection[Any]]:
    """A ``PrepareStoreOutput``'s keys: those the tier accepted, and those it evicted for them."""
    return prepared.keys_to_store, prepared.evicted_keys


def request_id_of(req_context: Any) -> str:
    """The request a manager's call is for (its ``ReqContext``)."""
    return req_context.req_id
