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

Whose blocks the tier holds: each block stored is the storing request's, by its
attribution series (``attribution.py``: model, priority, tenant, within the series limit),
until it leaves the tier; the blocks each series holds, and their block-nanoseconds, change
only when a store, an eviction, a failed store or a reset does. vLLM may store a request's
last blocks on the step after its release (decode blocks, a sliding window's tail): the
series of the last ``RECENTLY_RELEASED`` released requests are kept for those. Such stores
are counted for the pool and its holders, not on the request's span, built at its release.

The hit tokens and the load wait of a request are its connector's
(``ConnectorTally``): with an offloading connector, what it loads comes from the tier.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Hashable, Mapping
from itertools import repeat
from typing import Any

from otel_kvcache.vllm_compat.offload_tier import request_id_of, store_keys, tier_blocks, tier_medium


RECENTLY_RELEASED = 1024
"""Released requests whose attribution series a late store of theirs finds."""


class OffloadTier:
    """One engine's offload tier; its counts are read by the metric reader."""

    def __init__(
        self,
        manager: Any,
        bytes_per_block: int | None,
        owner_of: Callable[[str], Hashable],
        emptied: Callable[[], None],
    ) -> None:
        self.manager = manager
        self.medium = tier_medium(manager)
        self.bytes_per_block = bytes_per_block
        """None where the tier's size in bytes is not known (a connector built before ``instrument()``)."""
        self.stores = self.loads = self.evictions = self.evicted_unused = 0
        self.stored_by_request: dict[str, int] = {}
        self._not_loaded_since_stored: set[Any] = set()
        self._owner_of = owner_of
        """A request's attribution series, by its id (as many series as the attribution admits)."""
        self._owner_of_request: dict[str, Hashable] = {}
        self._owner_of_released: OrderedDict[str, Hashable] = OrderedDict()
        self._owner_of_block: dict[Any, Hashable] = {}
        self._series: dict[Hashable, Hashable] = {}
        self.held: dict[Hashable, Holding] = {}
        """The blocks each attribution series holds in the tier, and their block-nanoseconds."""
        self._reported_block_ns: dict[Hashable, int] = {}
        self.admitted_tokens: dict[str, int] = {}
        """Tokens the tier served a request at its latest admission, until its lookup is recorded."""
        self._emptied = emptied
        """Tells the tier's what-if curve that the tier was emptied."""

    # --- hooks (the manager's, after vLLM's call) ----------------------------------

    def on_store_prepared(self, prepared: Any, keys: Collection[Any], req_context: Any) -> None:
        if prepared is None:  # the tier could not take the store; nothing was evicted
            return
        accepted, evicted = store_keys(prepared)
        now_ns = time.monotonic_ns()
        if evicted:
            self.evictions += len(evicted)
            unused = self._not_loaded_since_stored
            before = len(unused)
            unused.difference_update(evicted)
            self.evicted_unused += before - len(unused)
            self._leave(evicted, now_ns)
        if accepted:
            request_id = request_id_of(req_context)
            self.stored_by_request[request_id] = self.stored_by_request.get(request_id, 0) + len(accepted)
            self.stores += len(accepted)
            self._not_loaded_since_stored.update(accepted)
            owner = self._owner_of_request.get(request_id)
            if owner is None:
                owner = self._owner_of_released.get(request_id)
                if owner is None:
                    owner = self._owner_of(request_id)
                    # One object per series, however many requests' blocks stay in the tier:
                    # a key of its own for each would leave a tracked tuple per request.
                    owner = self._owner_of_request[request_id] = self._series.setdefault(owner, owner)
            self._holding(owner, now_ns).blocks += len(accepted)
            owner_of_block = self._owner_of_block
            for key in accepted:  # for a store's few keys, 2.5 times as fast as update(dict.fromkeys(...))
                owner_of_block[key] = owner

    def on_load_prepared(self, load_spec: Any, keys: Collection[Any], req_context: Any) -> None:
        self.loads += len(keys)
        self._not_loaded_since_stored.difference_update(keys)

    def on_store_completed(self, result: Any, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        if not success:  # the tier freed the blocks: no eviction
            self._not_loaded_since_stored.difference_update(keys)
            self._leave(keys, time.monotonic_ns())

    def on_reset(self, result: Any) -> None:
        self._emptied()
        self._not_loaded_since_stored.clear()
        self._leave(list(self._owner_of_block), time.monotonic_ns())

    def _holding(self, owner: Hashable, now_ns: int) -> Holding:
        """The owner's holding, its block-nanoseconds brought up to now (before its blocks change)."""
        holding = self.held.get(owner)
        if holding is None:
            holding = self.held[owner] = Holding(now_ns)
        else:
            holding.catch_up(now_ns)
        return holding

    def _leave(self, keys: Collection[Any], now_ns: int) -> None:
        """Blocks leave the tier: their owners hold them no more."""
        owners = list(map(self._owner_of_block.pop, keys, repeat(None)))  # None: stored before instrumenting
        first = owners[0] if owners else None
        if owners.count(first) == len(owners):  # mostly: the blocks of one request, in C (Counter costs 1 µs)
            if first is not None:
                self._holding(first, now_ns).blocks -= len(owners)
            return
        for owner, blocks in Counter(owners).items():
            if owner is not None:
                self._holding(owner, now_ns).blocks -= blocks

    # --- per request --------------------------------------------------------------

    def stored_blocks(self, request_id: str) -> int:
        """The request's blocks the tier accepted, as its record leaves (``ConnectorSummary``)."""
        owner = self._owner_of_request.pop(request_id, None)
        if owner is not None:
            released = self._owner_of_released
            released[request_id] = owner
            if len(released) > RECENTLY_RELEASED:
                released.popitem(last=False)
        return self.stored_by_request.pop(request_id, 0)

    def forget_departed(self, live: Mapping[str, Any]) -> None:
        for table in (self.stored_by_request, self._owner_of_request, self.admitted_tokens):
            for request_id in [rid for rid in table if rid not in live]:
                del table[request_id]

    # --- readings -----------------------------------------------------------------

    def blocks(self) -> tuple[int, int]:
        """Used and free blocks, as the manager counts them now."""
        return tier_blocks(self.manager)

    def holdings(self) -> list[tuple[Hashable, int, float]]:
        """Each attribution series' blocks in the tier now, and their block-seconds so far."""
        now_ns, reported = time.monotonic_ns(), self._reported_block_ns
        holdings = []
        for owner, holding in list(self.held.items()):  # one C call: safe against the engine thread
            # Read while the engine thread changes it, a holding may count a stretch twice for a
            # moment: a counter never goes back.
            block_ns = reported[owner] = max(holding.block_ns_until(now_ns), reported.get(owner, 0))
            holdings.append((owner, holding.blocks, block_ns / 1e9))
        return holdings


class Holding:
    """One attribution series' blocks in the tier, and their block-nanoseconds up to ``since_ns``."""

    __slots__ = ("blocks", "block_ns", "since_ns")

    def __init__(self, now_ns: int) -> None:
        self.blocks = self.block_ns = 0
        self.since_ns = now_ns

    def catch_up(self, now_ns: int) -> None:
        self.block_ns += self.blocks * (now_ns - self.since_ns)
        self.since_ns = now_ns

    def block_ns_until(self, now_ns: int) -> int:
        return self.block_ns + self.blocks * max(now_ns - self.since_ns, 0)
