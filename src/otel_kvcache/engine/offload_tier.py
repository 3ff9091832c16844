"""The offload tier: a KV connector's pool in host memory, per request and as a pool.

Built beside ``connectors.ConnectorTelemetry`` for an engine whose connector keeps
an offload tier we can read (``vllm_compat.offload_tier``: ``OffloadingConnector``'s
CPU manager, LRU or ARC). Its hooks are patched on that engine's manager object
(``vllm_compat.hook_points.OFFLOAD_TIER_HOOK_POINTS``) and run on the engine thread,
each in the keys of the call it follows:

- a prepared store: the blocks the tier accepted (the request's, and the pool's
  stores), and the blocks it evicted for them;
- a prepared load: the blocks it loads back into the GPU pool;
- a failed store or a reset: blocks gone without an eviction.

A block stored and not loaded back before its eviction is the tier's waste
(``vllm.kv_cache.offload.evicted_unused``): the keys stored since their last load
are kept, as many as the tier holds blocks at most. The pool's used and free blocks
are the manager's own counts, read when the metric reader collects.

The hit tokens and the load wait of a request are its connector's
(``ConnectorTally``): with an offloading connector, what it loads comes from the tier.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from otel_kvcache.vllm_compat.offload_tier import request_id_of, store_keys, tier_blocks, tier_medium


class OffloadTier:
    """One engine's offload tier; its counts are read by the metric reader."""

    def __init__(self, manager: Any, bytes_per_block: int | None) -> None:
        self.manager = manager
        self.medium = tier_medium(manager)
        self.bytes_per_block = bytes_per_block
        """None where the tier's size in bytes is not known (a connector built before ``instrument()``)."""
        self.stores = self.loads = self.evictions = self.evicted_unused = 0
        self.stored_by_request: dict[str, int] = {}
        self._not_loaded_since_stored: set[Any] = set()

    # --- hooks (the manager's, after vLLM's call) ----------------------------------

    def on_store_prepared(self, prepared: Any, keys: Collection[Any], req_context: Any) -> None:
        if prepared is None:  # the tier could not take the store; nothing was evicted
            return
        accepted, evicted = store_keys(prepared)
        if accepted:
            request_id = request_id_of(req_context)
            self.stored_by_request[request_id] = self.stored_by_request.get(request_id, 0) + len(accepted)
            self.stores += len(accepted)
        if evicted:
            self.evictions += len(evicted)
            unused = self._not_loaded_since_stored
            for key in evicted:
                if key in unused:
                    unused.discard(key)
                    self.evicted_unused += 1
        self._not_loaded_since_stored.update(accepted)

    def on_load_prepared(self, load_spec: Any, keys: Collection[Any], req_context: Any) -> None:
        self.loads += len(keys)
        self._not_loaded_since_stored.difference_update(keys)

    def on_store_completed(self, result: Any, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        if not success:  # the tier freed the blocks: no eviction
            self._not_loaded_since_stored.difference_update(keys)

    def on_reset(self, result: Any) -> None:
        self._not_loaded_since_stored.clear()

    # --- per request --------------------------------------------------------------

    def stored_blocks(self, request_id: str) -> int:
        """The request's blocks the tier accepted, as its record leaves (``ConnectorSummary``)."""
        return self.stored_by_request.pop(request_id, 0)

    def forget_departed(self, live: Mapping[str, Any]) -> None:
        for request_id in [rid for rid in self.stored_by_request if rid not in live]:
            del self.stored_by_request[request_id]

    # --- readings -----------------------------------------------------------------

    def blocks(self) -> tuple[int, int]:
        """Used and free blocks, as the manager counts them now."""
        return tier_blocks(self.manager)
