"""The KV block pool's composition, kept up to date without scanning it.

vLLM's ``BlockPool`` knows how many blocks are free, but not how many of those
free blocks still hold a reusable prefix (they are evictable, yet a later
request may hit them). Scanning the pool for that is O(blocks) per step, so
``PoolTracker`` counts the transitions instead, from the only places a block
changes state: ``free_blocks`` (a block's last reference goes), ``touch`` (a
prefix hit takes a cached block back), ``get_new_blocks`` (blocks popped off
the free queue lose their hash: evictions) and ``reset_prefix_cache``. Each
costs O(blocks passed to that call).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterable
from typing import Any, NamedTuple


class PoolSnapshot(NamedTuple):
    """The pool at one instant; ``used + cached + free == limit`` always."""

    used: int
    cached: int
    free: int
    limit: int

    @property
    def utilization(self) -> float:
        return self.used / self.limit if self.limit else 0.0


def _is_cached_free(block: Any) -> bool:
    return block.ref_cnt == 0 and not block.is_null and block.block_hash is not None


class PoolTracker:
    """Counts the evictable cached blocks of one vLLM ``BlockPool``."""

    __slots__ = ("pool", "limit", "cached", "evictions", "eviction_age_sum", "eviction_age_max", "_cached_at", "_hit")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        # vLLM reserves block 0 as a placeholder ("null block") that is never
        # handed out, so it is not part of the usable pool.
        self.limit = pool.num_gpu_blocks - 1
        self.cached = sum(1 for block in pool.blocks if _is_cached_free(block))
        self.evictions = 0
        self.eviction_age_sum = 0.0
        self.eviction_age_max = 0.0
        now = time.monotonic()
        self._cached_at = array("d", [now]) * pool.num_gpu_blocks  # when each block's prefix was last cached
        self._hit = bytearray(pool.num_gpu_blocks)  # reused by a prefix hit since then

    def on_freed(self, blocks: Iterable[Any]) -> None:
        """After ``free_blocks``: blocks whose last reference went and kept a hash."""
        pool, cached_at, now = self.pool, self._cached_at, time.monotonic()
        for block in blocks:
            if (block.pool is None or block.pool is pool) and _is_cached_free(block):
                self.cached += 1
                cached_at[block.block_id] = now

    def on_touching(self, blocks: Iterable[Any]) -> None:
        """Before ``touch``: a prefix hit takes these blocks back (out of the cache, if free)."""
        hit = self._hit
        for block in blocks:
            if block.block_hash is not None and not block.is_null:
                hit[block.block_id] = 1
                if block.ref_cnt == 0:
                    self.cached -= 1

    def cached_blocks_hit_again(self) -> int:
        """Evictable cached blocks a prefix hit has reused (a scan: reconciliation only)."""
        hit = self._hit
        return sum(1 for block in self.pool.blocks if hit[block.block_id] and _is_cached_free(block))

    def before_allocating(self, num_blocks: int) -> list[int]:
        """Before ``get_new_blocks(n)``: which of the n blocks at the head of the free
        queue still hold a prefix; popping them evicts it."""
        victims = []
        block = self.pool.free_block_queue.fake_free_list_head.next_free_block
        for _ in range(num_blocks):
            if block is None or block.is_null:
                break
            if block.block_hash is not None:
                victims.append(block.block_id)
            block = block.next_free_block
        return victims

    def before_evicting(self, block_ids) -> list[int]:
        """Before ``evict_blocks`` (a KV connector's): the free cached blocks among them."""
        blocks = self.pool.blocks
        return [block_id for block_id in block_ids if _is_cached_free(blocks[block_id])]

    def on_evicted(self, block_ids: list[int]) -> None:
        """The cached blocks vLLM just evicted: counted, and aged since they were cached."""
        if not block_ids:
            return
        now, cached_at, hit = time.monotonic(), self._cached_at, self._hit
        for block_id in block_ids:
            age = now - cached_at[block_id]
            self.eviction_age_sum += age
            if age > self.eviction_age_max:
                self.eviction_age_max = age
            hit[block_id] = 0
        self.evictions += len(block_ids)
        self.cached -= len(block_ids)

    def take_eviction_age_max(self) -> float:
        """The oldest eviction since the last call (the gauge's reading), then reset."""
        oldest, self.eviction_age_max = self.eviction_age_max, 0.0
        return oldest

    def on_reset(self) -> None:
        self.cached = 0
        self._hit = bytearray(len(self._hit))

    def used_blocks(self) -> int:
        return self.limit - self.pool.get_num_free_blocks()

    def snapshot(self) -> PoolSnapshot:
        free_total = self.pool.get_num_free_blocks()
        cached = min(max(self.cached, 0), free_total)
        return PoolSnapshot(
            used=self.limit - free_total,
            cached=cached,
            free=free_total - cached,
            limit=self.limit,
        )
