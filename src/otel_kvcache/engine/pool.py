"""The KV block pool's composition, kept up to date without scanning it.

vLLM's ``BlockPool`` knows how many blocks are free, but not how many of those
free blocks still hold a reusable prefix (they are evictable, yet a later
request may hit them), nor which it evicts. Scanning the pool for that is
O(blocks) per step, and hooking ``get_new_blocks`` (dozens of calls a step)
costs more than the rest of the instrumentation together, so ``PoolTracker``
mirrors the free queue's order instead.

vLLM's free queue is [blocks without a hash][blocks with one, least
recently freed first] (but for 0.34's ``evict_first``, below): ``free_blocks`` prepends the former and appends the
latter (``prepend_n``, ``append_n``), ``get_new_blocks`` pops from the head,
``touch`` takes prefix hits out of the back. The tracker keeps the back part
as runs, one per ``append_n`` call (blocks cached at the same instant, in
queue order). Whatever else left the free queue since the tracker last looked
was popped from the head: the pops beyond the front part evicted the back
part's first blocks, which gives the evictions and their ages exactly, at
O(runs) rather than O(blocks). The engine thread counts the pops, with the
time, once ``schedule()`` returns each step and before ``prepend_n`` grows the
front part (``note_pops``: a subtraction); it takes them off the runs, and
counts the evictions and their ages, about once a second (``catch_up_if_due``),
in one loop that stays in the CPU's caches instead of one that leaves them
each step.

Which run a block is in matters only when a prefix hit takes free blocks back
(or a connector evicts them), and writing it down is work per block on the
engine thread, dearer still once the blocks have left the CPU's caches
(``docs/overhead.md#pool-tracker``). So a run is indexed by block when it is appended
while prefix hits keep taking free blocks back (``EAGER_APPENDS``), and
otherwise its blocks wait, with those of the runs appended after it, in one
list (``_unindexed``), indexed only if a take-back comes.

A busy pool makes no objects for the garbage collector to count: the runs
taken off are kept as spares for the next appends, and the blocks waiting to
be indexed are copied into the one list rather than kept in vLLM's. A steady
vLLM allocates about as many such objects as it frees, so CPython seldom
collects its youngest generation; a second's worth of new runs (and vLLM's
lists with them) waiting to be settled would tip that balance, and each
collection walks vLLM's young requests and their token lists
(``docs/overhead.md#garbage-collections``).

From 0.34, ``free_blocks(..., evict_first=True)`` (only the CPU-offloading
connector in lazy mode, which takes cached blocks off the head to copy them,
then gives them back there) prepends cached blocks. They are kept by id, with
when they were freed (``_front``), and looked at each step while there are
any: one whose prefix changed, or that is in use again without a prefix hit,
was popped and evicted.

Entries of the back part that hold no prefix are dead: ``unpin_blocks``
(hisparse) appends blocks with or without a hash, and a KV connector's
``evict_blocks`` drops the hash of free blocks in place. Where the head pops
part of a run holding dead entries, the dead ones are taken to go first (their
places are not kept); the counts are exact again once the run is gone. Pops
are taken off the runs at once while the back part may hold dead entries.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from operator import attrgetter, countOf
from typing import Any, NamedTuple

from otel_kvcache.vllm_compat.blocks import block_hash_reader, block_references, free_queue, pool_size, usable_blocks

# Runs emptied by prefix hits are dropped when they outnumber this and the rest.
COMPACT_ABOVE = 64
# Appended runs are indexed at once for this many appends after a take-back.
EAGER_APPENDS = 64
# How often the pops counted each step are taken off the runs (and the evictions counted).
CATCH_UP_SECONDS = 1.0
_BLOCK_ID = attrgetter("block_id")


class Run:
    """Blocks one ``append_n`` call put at the back of the free queue (see the module's docstring)."""

    __slots__ = ("queued", "live", "cached_at", "unindexed")

    def __init__(self) -> None:
        self.queued = 0
        """Its entries still in vLLM's free queue."""
        self.live = 0
        """Those of them still cached (the rest are dead)."""
        self.cached_at = 0.0
        """When its blocks were freed (``time.monotonic()``)."""
        self.unindexed = 0
        """How many of its blocks wait in ``PoolTracker._unindexed`` (0 once indexed by block)."""

    def refill(self, queued: int, live: int, cached_at: float, unindexed: int) -> Run:
        self.queued, self.live, self.cached_at, self.unindexed = queued, live, cached_at, unindexed
        return self


class PoolCounts(NamedTuple):
    """The pool at one instant; ``used + cached + free == limit`` always."""

    used: int
    cached: int
    free: int
    limit: int

    @property
    def utilization(self) -> float:
        return self.used / self.limit if self.limit else 0.0


def pool_counts(free_total: int, cached: int, limit: int) -> PoolCounts:
    """The counts of a pool with ``free_total`` free blocks, ``cached`` of them evictable."""
    cached = min(max(cached, 0), free_total)
    return PoolCounts(used=limit - free_total, cached=cached, free=free_total - cached, limit=limit)


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
        "due",
        "_block_hash",
        "_runs",
        "_run_of",
        "_unindexed",
        "_spare_runs",
        "_queued",  # entries of the back part in vLLM's queue, dead ones included
        "_pops",  # entries popped off the back part, not yet taken off its runs, by step...
        "_popped_at",  # ...and when
        "_may_hold_dead",
        "_empty_runs",
        "_eager_appends",
        "_unpinning",
        "_hit",
        "_front",
        "on_cached_freed",
    )

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.queue = free_queue(pool)
        self.limit = usable_blocks(pool)
        self.evictions = 0
        self.eviction_age_sum = 0.0
        self.eviction_age_max = 0.0
        self._block_hash = block_hash_reader(pool.blocks[0])
        self._unpinning = False
        # Block id -> the block's hash (its prefix) when a prefix hit last reused it:
        # void once the block holds another hash, i.e. was evicted since.
        self._hit: dict[int, Any] = {}
        self._front: dict[int, tuple[Any, float]] = {}
        """Cached blocks vLLM put at the head of the queue (``evict_first``): id -> (hash, freed at)."""
        self.on_cached_freed: Any = None
        """Called with the blocks ``append_n`` is given, where the engine reads their prefixes
        (a hybrid model's: ``EngineTelemetry._entries_freed``); None elsewhere."""
        self._pops, self._popped_at = array("q"), array("d")
        self._spare_runs: list[Run] = []
        self.due = time.monotonic() + CATCH_UP_SECONDS
        self._rebuild()

    def _rebuild(self) -> None:
        """The back part from a walk of the free queue (at start, and after a prefix-cache reset)."""
        cached = [block for block in self.queue.get_all_free_blocks() if block.block_hash is not None]
        self._runs: deque[Run] = deque()
        if cached:
            self._runs.append(Run().refill(len(cached), len(cached), time.monotonic(), len(cached)))
        # Block id -> its run, for the runs indexed so far (always the oldest ones);
        # entries of runs gone (spares, perhaps reused) are stale but never read: a free
        # block with a hash is in the latest run that holds it, indexed before any read.
        self._run_of: list[Run | None] = [None] * pool_size(self.pool)
        # The blocks of the runs not yet indexed (always the newest ones), in queue order.
        self._unindexed: list = cached
        self.cached = self._queued = len(cached)
        del self._pops[:], self._popped_at[:]
        self._front.clear()
        self._may_hold_dead = False
        self._empty_runs = 0
        self._eager_appends = 0

    # --- what vLLM did -------------------------------------------------------------

    def note_pops(self, now: float) -> None:
        """Counts the blocks popped off the back part since the last look (once
        ``schedule()`` returns, and before ``prepend_n``: the front part must not
        grow over them); ``_take_pops_off_runs`` takes them off the runs (about once a
        second, at a ``catch_up``, or at once while the back part may hold dead entries)."""
        # The back part is free blocks: whatever it holds beyond them was popped.
        if self._front:
            self._settle_front(now)
        popped = self._queued - self.queue.num_free_blocks
        if popped > 0:
            self._pops.append(popped)  # first: a reading in between counts them twice, not never
            self._popped_at.append(now)
            self._queued -= popped
            if self._may_hold_dead:  # which entries the pops took depends on the runs
                self._take_pops_off_runs()

    def before_prepending(self, blocks: Any) -> None:
        """Before ``prepend_n``: pops not yet counted must be, before the front part grows.

        From 0.34, ``free_blocks(..., evict_first=True)`` (the CPU-offloading connector
        in lazy mode) prepends cached blocks too, to be evicted first. A request's first
        block is hashed before its later ones, and vLLM frees the last first: the list's
        last block tells, at one read, whether any of them holds a prefix."""
        if self._queued > self.queue.num_free_blocks:  # rarely: releases come after the step's pops
            self.note_pops(time.monotonic())
        if blocks and self._block_hash(blocks[-1]) is not None:
            self._cached_at_the_head(blocks)

    def _cached_at_the_head(self, blocks: Any) -> None:
        now, front, block_hash = time.monotonic(), self._front, self._block_hash
        for block in blocks:
            prefix = block_hash(block)
            if prefix is not None:
                front[block.block_id] = (prefix, now)
                self.cached += 1

    def _settle_front(self, now: float) -> None:
        """The cached blocks at the head that left the queue since the last look, but
        through a prefix hit (``on_touching``): popped for reuse, so evicted. O(such
        blocks), at each step while there are any: the head is popped first, so they
        seldom stay long."""
        blocks, block_hash = self.pool.blocks, self._block_hash
        gone = [(block_id, freed_at) for block_id, (prefix, freed_at) in self._front.items()
                if block_hash(blocks[block_id]) is not prefix or blocks[block_id].ref_cnt]  # fmt: skip
        if gone:
            oldest = max(now - freed_at for _, freed_at in gone)
            for block_id, _ in gone:
                del self._front[block_id]
            self._count_evictions(len(gone), sum(now - freed_at for _, freed_at in gone), oldest)

    def catch_up_if_due(self, now: float) -> None:
        if now >= self.due:
            self.due = now + CATCH_UP_SECONDS
            self._take_pops_off_runs()

    def catch_up(self) -> None:
        """Brings the evictions up to date (when the engine goes idle, before a
        connector's eviction and after a prefix-cache reset)."""
        self.note_pops(time.monotonic())
        self._take_pops_off_runs()

    def _take_pops_off_runs(self) -> None:
        """The pops counted since the last call evicted the back part's first live
        entries: whole runs, then part of one; each is as old as its run was when popped."""
        runs, spare_runs = self._runs, self._spare_runs
        evicted, age_sum, oldest_age, unindexed_gone = 0, 0.0, 0.0, 0
        for count, popped_at in zip(self._pops, self._popped_at):
            while count and runs:
                run = runs[0]
                queued, live = run.queued, run.live
                if queued <= count:
                    spare_runs.append(runs.popleft())
                    count -= queued
                    unindexed_gone += run.unindexed  # the first blocks of _unindexed: all runs are unindexed
                    if queued:
                        run.queued = run.live = 0
                    else:
                        self._empty_runs -= 1
                    taken = live
                else:
                    dead = queued - live  # taken to go first
                    taken = count - dead if count > dead else 0
                    run.queued = queued - count
                    run.live = live - taken
                    count = 0
                if taken:
                    age = popped_at - run.cached_at
                    if age > oldest_age:
                        oldest_age = age
                    evicted += taken
                    age_sum += taken * age
        if evicted:  # first, as above
            self._count_evictions(evicted, age_sum, oldest_age)
        del self._pops[:], self._popped_at[:]
        if unindexed_gone:
            del self._unindexed[:unindexed_gone]

    def _count_evictions(self, evicted: int, age_sum: float, oldest_age: float) -> None:
        self.eviction_age_sum += age_sum
        if oldest_age > self.eviction_age_max:
            self.eviction_age_max = oldest_age
        self.evictions += evicted
        self.cached -= evicted

    def before_unpinning(self, blocks: Any, on_reuse: Any = None) -> None:
        """Before ``unpin_blocks``: the blocks it appends may hold no prefix."""
        self._unpinning = True

    def on_appending(self, blocks: list) -> None:
        """Before ``append_n``: these blocks join the back, in the order vLLM will evict
        them (``free_blocks`` appends only blocks with a hash)."""
        if blocks:
            queued = live = len(blocks)
            if self._unpinning:
                self._unpinning = False
                live -= countOf(map(self._block_hash, blocks), None)
                self._may_hold_dead = self._may_hold_dead or live < queued
            run = self._spare_runs.pop() if self._spare_runs else Run()
            if self._eager_appends:
                self._eager_appends -= 1
                run.refill(queued, live, time.monotonic(), 0)
                run_of = self._run_of
                for block in blocks:
                    run_of[block.block_id] = run
            else:  # copied: vLLM drops its list after the call (see the module's docstring)
                run.refill(queued, live, time.monotonic(), queued)
                self._unindexed += blocks
            self._runs.append(run)
            self._queued += queued
            self.cached += live
            if self.on_cached_freed is not None:  # last: a failure there costs the pool nothing
                self.on_cached_freed(blocks)


    def _index_new_runs(self) -> None:
        """Which run each block of the runs not yet indexed (the newest ones) is in."""
        blocks = self._unindexed
        if not blocks:
            return
        new_runs = []
        for run in reversed(self._runs):
            if not run.unindexed:
                break
            new_runs.append(run)
        run_of, start = self._run_of, 0
        for run in reversed(new_runs):  # oldest first: a block popped and freed again is in the later run
            end = start + run.unindexed
            for block in blocks[start:end]:
                run_of[block.block_id] = run
            run.unindexed = 0
            start = end
        blocks.clear()

    def on_touching(self, blocks: Sequence[Any]) -> None:
        """Before ``touch``: a prefix hit takes these blocks back (out of the queue, if free).

        No settling first: a free block a hit takes back was behind whatever the
        head popped, so the pops come out the same when counted afterwards.

        A hit is a chain of prefix blocks. When its deepest block is marked with the
        hash it holds now, the hit that marked it marked the shallower ones too, and
        they still hold theirs: vLLM evicts a chain's deeper blocks first (a
        request's blocks are freed deepest first, and any holder of a block holds
        the blocks before it). Most hits reuse a marked chain (a shared system
        prompt), so they skip the marking. Where vLLM holds two blocks with one
        hash (a prefix computed twice before it was cached), a hit can reach a
        marked deepest block through an unmarked twin, which then goes uncounted
        by the hit-again gauge until that deepest block is evicted."""
        if not blocks:
            return
        deepest = blocks[-1]
        if self._hit.get(deepest.block_id) is not self._block_hash(deepest):
            self._hit.update(zip(map(_BLOCK_ID, blocks), map(self._block_hash, blocks)))
        # Some are free: in the back part. A loop, not ``countOf(map(attrgetter("ref_cnt"), ...))``:
        # CPython specializes the loop's attribute read, not the C getter's
        # (``docs/overhead.md#pool-tracker``).
        for block in blocks:
            if not block.ref_cnt:
                self._take_back(blocks)
                return

    def _take_back(self, blocks: Sequence[Any]) -> None:
        self._index_new_runs()
        self._eager_appends = EAGER_APPENDS
        run_of, front = self._run_of, self._front
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:  # null ones stand in for skipped blocks
                if front and front.pop(block.block_id, None) is not None:  # at the head (evict_first)
                    self.cached -= 1
                    continue
                run = run_of[block.block_id]
                if run is not None and run.live:
                    run_of[block.block_id] = None
                    run.live -= 1
                    run.queued -= 1
                    self._queued -= 1
                    self.cached -= 1
                    if not run.queued:
                        self._run_emptied()

    def _run_emptied(self) -> None:
        """Prefix hits emptied a run inside the queue: drop such runs now and then."""
        self._empty_runs += 1
        if self._empty_runs > COMPACT_ABOVE and 2 * self._empty_runs > len(self._runs):
            self._spare_runs.extend(run for run in self._runs if not run.queued)
            self._runs = deque(run for run in self._runs if run.queued)
            self._empty_runs = 0

    def before_evicting(self, block_ids: Iterable[int]) -> None:
        """Before ``evict_blocks`` (a KV connector's): free cached blocks among them
        lose their prefix but keep their place in the queue."""
        self.catch_up()
        self._index_new_runs()
        blocks, run_of, now = self.pool.blocks, self._run_of, time.monotonic()
        for block_id in block_ids:
            head = self._front.pop(block_id, None) if self._front else None
            if head is not None:  # at the head (evict_first): its place is the head's
                age = now - head[1]
                self._count_evictions(1, age, age)
                continue
            run = run_of[block_id]
            block = blocks[block_id]
            if run is not None and run.live and block.ref_cnt == 0 and self._block_hash(block) is not None:
                run_of[block_id] = None
                run.live -= 1
                self._may_hold_dead = True
                age = now - run.cached_at
                self._count_evictions(1, age, age)

    def on_reset(self) -> None:
        """After a successful ``reset_prefix_cache``: no block holds a prefix."""
        self.catch_up()  # the evictions before it
        self._hit.clear()
        self._rebuild()

    # --- readings ------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """Free blocks, and how many of them are cached, for the gauges: read on
        the metric reader's thread, without settling (that is the engine thread's).
        Entries popped off the back part and not yet taken off its runs are taken
        as evicted (while it may hold dead ones, they are taken off at each
        count); a read in the middle of a step sees the step so far."""
        free = self.queue.num_free_blocks
        return free, self.cached - max(self._queued - free, 0) - sum(self._pops)

    def take_eviction_age_max(self) -> float:
        """The oldest eviction since the last call (the gauge's reading), then reset."""
        oldest, self.eviction_age_max = self.eviction_age_max, 0.0
        return oldest

    def cached_blocks_hit_again(self) -> int:
        """Evictable cached blocks a prefix hit has reused (reconciliation only):
        O(blocks marked), dropping the marks of blocks evicted since their hit."""
        blocks, hit = self.pool.blocks, self._hit
        count = 0
        for block_id, hit_hash in list(hit.items()):
            block = blocks[block_id]
            if hit_hash is None or block.block_hash is not hit_hash:
                del hit[block_id]
            elif block.ref_cnt == 0:
                count += 1
        return count

    def references(self) -> int:
        """Block references (``ref_cnt``) over the pool, the null block's left out."""
        return block_references(self.pool)

    def used_blocks(self) -> int:
        return self.limit - self.pool.get_num_free_blocks()
