"""The KV block pool's composition, kept up to date without scanning it.

vLLM's ``BlockPool`` knows how many blocks are free, but not how many of those
free blocks still hold a reusable prefix (they are evictable, yet a later
request may hit them), nor which it evicts. Scanning the pool for that is
O(blocks) per step, and hooking ``get_new_blocks`` (dozens of calls a step)
costs more than the rest of the instrumentation together, so ``PoolTracker``
mirrors the free queue's order instead.

vLLM's free queue is always [blocks without a hash][blocks with one, least
recently freed first]: ``free_blocks`` prepends the former and appends the
latter, ``get_new_blocks`` pops from the head, ``touch`` takes prefix hits out
of the back. The tracker keeps the back part as an ordered map of block ids,
fed by ``free_blocks`` and ``touch`` (per request, not per step). Whatever
left the free queue since the tracker last looked was popped from the head
(``settle``, at each of those calls and at the end of each step): the pops
beyond the front part evicted the back part's first blocks, which gives the
evictions and their ages exactly, at O(evictions).

Not mirrored: ``unpin_blocks`` (hisparse) appends to the queue without a hook;
with it, the cached count can drift until the next prefix-cache reset.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from itertools import repeat
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
    """Counts the evictable cached blocks of one vLLM ``BlockPool``, and its evictions."""

    __slots__ = (
        "pool",
        "queue",
        "limit",
        "cached",
        "evictions",
        "eviction_age_sum",
        "eviction_age_max",
        "_free_seen",  # free blocks at the last settle, for the snapshot
        "_back",
        "_dead",
        "_hit",
    )

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.queue = pool.free_block_queue
        # vLLM reserves block 0 as a placeholder ("null block") that is never
        # handed out, so it is not part of the usable pool.
        self.limit = pool.num_gpu_blocks - 1
        self.evictions = 0
        self.eviction_age_sum = 0.0
        self.eviction_age_max = 0.0
        self._hit = bytearray(pool.num_gpu_blocks)  # reused by a prefix hit since it was cached
        self._rebuild()

    def _rebuild(self) -> None:
        """The back part from a walk of the free queue (at start, and after a prefix-cache reset)."""
        now = time.monotonic()
        # Block id -> when it was cached (None once a KV connector evicted it in place),
        # in queue order: the next to be evicted first.
        self._back: OrderedDict[int, float | None] = OrderedDict(
            (block.block_id, now) for block in self.queue.get_all_free_blocks() if block.block_hash is not None
        )
        self.cached = len(self._back)
        self._dead = 0
        self._free_seen = self.queue.num_free_blocks

    # --- what vLLM did -------------------------------------------------------------

    def settle(self) -> None:
        """Blocks that left the free queue since the last look were popped from its
        head; those past the front (hashless) part were evicted from the prefix cache."""
        free = self._free_seen = self.queue.num_free_blocks
        # The back part is free blocks: whatever it holds beyond them was popped.
        popped_from_back = len(self._back) - free
        if popped_from_back > 0:
            self._evict(popped_from_back)

    def _evict(self, count: int) -> None:
        back, hit = self._back, self._hit
        count = min(count, len(back))
        if not count:
            return
        if self._dead:
            return self._evict_with_dead(count)
        oldest = next(iter(back.values()))  # blocks joined the back part in the order they were cached
        cached_at_sum = 0.0
        for _ in range(count):
            block_id, cached_at = back.popitem(last=False)
            hit[block_id] = 0
            cached_at_sum += cached_at
        self._count_evictions(count, cached_at_sum, oldest)

    def _evict_with_dead(self, count: int) -> None:
        """``_evict`` where a KV connector evicted blocks in place (counted then)."""
        back, hit = self._back, self._hit
        evicted, cached_at_sum, oldest = 0, 0.0, None
        for _ in range(count):
            block_id, cached_at = back.popitem(last=False)
            hit[block_id] = 0
            if cached_at is None:
                self._dead -= 1
                continue
            oldest = cached_at if oldest is None else oldest
            cached_at_sum += cached_at
            evicted += 1
        if evicted:
            self._count_evictions(evicted, cached_at_sum, oldest)

    def _count_evictions(self, evicted: int, cached_at_sum: float, oldest: float) -> None:
        now = time.monotonic()
        self.eviction_age_sum += evicted * now - cached_at_sum
        self.eviction_age_max = max(self.eviction_age_max, now - oldest)
        self.evictions += evicted
        self.cached -= evicted

    def before_freeing(self) -> Any:
        """Before ``free_blocks``: settles, and returns the queue's last block."""
        self.settle()
        return self.queue.fake_free_list_tail.prev_free_block

    def on_freed(self, last_before: Any) -> None:
        """After ``free_blocks``: the blocks it appended after ``last_before`` are the
        ones whose last reference went and that kept a hash, in the order vLLM
        will evict them. (The hashless ones went to the head, other pools' blocks
        to their own queues.)"""
        block = self.queue.fake_free_list_tail.prev_free_block
        appended = []
        if last_before is self.queue.fake_free_list_head:
            # The queue was empty: the hashless blocks vLLM prepended come first.
            while block is not last_before and block.block_hash is not None:
                appended.append(block.block_id)
                block = block.prev_free_block
        else:
            while block is not last_before:
                appended.append(block.block_id)
                block = block.prev_free_block
        if appended:
            appended.reverse()
            self._back.update(zip(appended, repeat(time.monotonic())))
            self.cached += len(appended)

    def on_touching(self, blocks: list[Any]) -> None:
        """Before ``touch``: a prefix hit takes these blocks back (out of the queue, if free)."""
        self.settle()
        hit, back = self._hit, self._back
        for block in blocks:
            if block.is_null:  # hits are hashed blocks; null ones stand in for skipped blocks
                continue
            hit[block.block_id] = 1
            if block.ref_cnt == 0:  # free: in the back part
                cached_at = back.pop(block.block_id, False)
                if cached_at is None:
                    self._dead -= 1
                elif cached_at:
                    self.cached -= 1

    def before_evicting(self, block_ids: Iterable[int]) -> None:
        """Before ``evict_blocks`` (a KV connector's): free cached blocks among them
        lose their prefix but keep their place in the queue."""
        self.settle()
        back, now = self._back, time.monotonic()
        for block_id in block_ids:
            cached_at = back.get(block_id)
            if cached_at is not None:
                back[block_id] = None
                self._dead += 1
                self._hit[block_id] = 0
                self.eviction_age_sum += now - cached_at
                self.eviction_age_max = max(self.eviction_age_max, now - cached_at)
                self.evictions += 1
                self.cached -= 1

    def on_reset(self) -> None:
        """After a successful ``reset_prefix_cache``: no block holds a prefix."""
        self._hit = bytearray(len(self._hit))
        self._rebuild()

    # --- readings ------------------------------------------------------------------

    def take_eviction_age_max(self) -> float:
        """The oldest eviction since the last call (the gauge's reading), then reset."""
        oldest, self.eviction_age_max = self.eviction_age_max, 0.0
        return oldest

    def cached_blocks_hit_again(self) -> int:
        """Evictable cached blocks a prefix hit has reused (a scan: reconciliation only)."""
        hit = self._hit
        return sum(1 for block in self.pool.blocks if hit[block.block_id] and _is_cached_free(block))

    def used_blocks(self) -> int:
        return self.limit - self.pool.get_num_free_blocks()

    def snapshot(self) -> PoolSnapshot:
        """As of the last ``settle``."""
        free_total = self._free_seen
        cached = min(max(self.cached, 0), free_total)
        return PoolSnapshot(
            used=self.limit - free_total,
            cached=cached,
            free=free_total - cached,
            limit=self.limit,
        )
