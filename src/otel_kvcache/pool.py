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

    __slots__ = ("pool", "limit", "cached", "evictions")

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        # vLLM reserves block 0 as a placeholder ("null block") that is never
        # handed out, so it is not part of the usable pool.
        self.limit = pool.num_gpu_blocks - 1
        self.cached = sum(1 for block in pool.blocks if _is_cached_free(block))
        self.evictions = 0

    def on_freed(self, blocks: Iterable[Any]) -> None:
        """After ``free_blocks``: blocks whose last reference went and kept a hash."""
        pool = self.pool
        for block in blocks:
            if (block.pool is None or block.pool is pool) and _is_cached_free(block):
                self.cached += 1

    def on_touching(self, blocks: Iterable[Any]) -> None:
        """Before ``touch``: a prefix hit takes these blocks back out of the cache."""
        self.cached -= sum(1 for block in blocks if _is_cached_free(block))

    def before_allocating(self, num_blocks: int) -> int:
        """Before ``get_new_blocks(n)``: how many of the n blocks at the head of the
        free queue still hold a prefix; popping them evicts it."""
        evicted = 0
        block = self.pool.free_block_queue.fake_free_list_head.next_free_block
        for _ in range(num_blocks):
            if block is None or block.is_null:
                break
            if block.block_hash is not None:
                evicted += 1
            block = block.next_free_block
        return evicted

    def before_evicting(self, block_ids) -> int:
        """Before ``evict_blocks`` (a KV connector's): the free cached blocks among them."""
        blocks = self.pool.blocks
        return sum(1 for block_id in block_ids if _is_cached_free(blocks[block_id]))

    def on_evicted(self, evicted: int) -> None:
        self.evictions += evicted
        self.cached -= evicted

    def on_reset(self) -> None:
        self.cached = 0

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
