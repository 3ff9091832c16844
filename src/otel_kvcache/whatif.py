"""Why prefix lookups missed, and what a pool of another size would have hit.

vLLM's prefix cache is an LRU cache of block hashes: a freed block that holds a
prefix joins the back of the free queue and is evicted when the queue's head
reaches it. Two questions follow from the order blocks were freed in.

**Miss reasons.** ``recently_freed`` remembers the hashes of the last
``HISTORY_PER_BLOCK`` × pool-size distinct blocks that were freed into the
prefix cache (a 64-bit hash each, not vLLM's objects). A looked-up block that
missed is ``evicted`` if its hash is remembered (it was cached, and gone by the
time this request asked), ``cold`` if not. A block freed longer ago than the
history reaches counts as cold: the history's only error, bounded by its size.
Tokens vLLM never serves from the cache (the tail that does not fill a block,
the last token, everything when a request skips the cache) are
``uncacheable``. The three add up to vLLM's queries minus its hits.

**The what-if curve**, a miss-ratio curve built the way caches build one
online (SHARDS, Waldspurger et al., FAST '15): a block hash is sampled when
its hash falls under ``sample_rate`` of the hash space, the same blocks every
time. For the sampled blocks, ``_stack`` orders the blocks not in use by their
last free, most recent on top. A looked-up block ``d`` sampled blocks deep
has about ``d / sample_rate`` blocks freed after it: with a pool ``scale``
times as large, and the same requests running (their blocks take room first),
it would still be cached if ``d / sample_rate + used < scale × pool``. LRU
keeps what a smaller cache holds in a larger one, so the measured hit or miss
of each block anchors the curve: a block vLLM hit counts as hit at every
larger scale, one it missed as missed at every smaller one. The projection
for scale s is vLLM's own hit tokens plus the sampled blocks' gain at s,
scaled by ``1 / sample_rate``, over the window's looked-up tokens. What it
does not model: a bigger pool admitting more requests at once (their blocks
would take more room), and a hit stopping at the first missing block of a
chain (vLLM frees a request's deepest block first, so a chain's deeper blocks
go first anyway).

Costs: per freed block, one dict update (in C); per sampled block, a few
Fenwick-tree steps (``log2`` of the sampled blocks remembered). Memory:
``recently_freed`` holds up to ``HISTORY_PER_BLOCK`` × pool blocks entries,
the stack up to ``max(SCALES)`` × pool × ``sample_rate`` blocks.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Iterable, Sequence

SCALES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Pool sizes, as multiples of the real one, that the curve is projected for."""
HISTORY_PER_BLOCK = 4
"""``recently_freed`` remembers this many freed block hashes per block of the pool."""
WINDOW_SECONDS = 600.0
"""The curve and the peak demand are over the last ten minutes of lookups."""
BUCKET_SECONDS = 10.0
SAMPLED_BLOCKS = 1024
"""By default, the sample rate keeps about this many sampled blocks per pool's worth."""
_HASH_SPACE = 1 << 32


def default_sample_rate(pool_blocks: int) -> float:
    return min(1.0, SAMPLED_BLOCKS / max(pool_blocks, 1))


class _Fenwick:
    """Counts of positions 1..size, with prefix sums in ``log2(size)`` steps."""

    __slots__ = ("size", "tree")

    def __init__(self, size: int) -> None:
        self.size = size
        self.tree = array("l", bytes(8 * (size + 1)))

    def add(self, position: int, delta: int) -> None:
        tree, size = self.tree, self.size
        while position <= size:
            tree[position] += delta
            position += position & -position

    def up_to(self, position: int) -> int:
        tree, total = self.tree, 0
        while position > 0:
            total += tree[position]
            position -= position & -position
        return total


class _Window:
    """Sums over the last ``WINDOW_SECONDS``, in buckets of ``BUCKET_SECONDS``: looked-up
    tokens, vLLM's hit tokens, the projected gain at each scale, and peak demand."""

    def __init__(self) -> None:
        self._buckets: deque[tuple[float, array]] = deque()

    def bucket(self, now: float) -> array:
        buckets = self._buckets
        if not buckets or now - buckets[-1][0] >= BUCKET_SECONDS:
            buckets.append((now, array("d", bytes(8 * (3 + len(SCALES))))))
            while now - buckets[0][0] > WINDOW_SECONDS:
                buckets.popleft()
        return buckets[-1][1]

    def totals(self, now: float) -> array:
        total = array("d", bytes(8 * (3 + len(SCALES))))
        for started, sums in self._buckets:
            if now - started <= WINDOW_SECONDS:
                for index, value in enumerate(sums):
                    total[index] = max(total[index], value) if index == _PEAK else total[index] + value
        return total


# A window bucket's fields.
_LOOKED_UP, _HIT, _PEAK, _GAIN = 0, 1, 2, 3


class PrefixReuse:
    """One engine's history of freed prefix blocks: miss reasons and the what-if curve."""

    def __init__(self, pool_blocks: int, sample_rate: float) -> None:
        self.pool_blocks = pool_blocks
        self.sample_rate = sample_rate
        self._threshold = int(sample_rate * _HASH_SPACE)
        self.recently_freed: dict[int, int] = {}
        """Hash of a block freed into the prefix cache -> its place in the free order."""
        self._freed = 0  # blocks freed so far
        self._history = HISTORY_PER_BLOCK * pool_blocks
        # Sampled blocks not in use, by their last free: a position each in the tree.
        self._depth_limit = int(max(SCALES) * pool_blocks * sample_rate) + 1
        self._position_of: dict[int, int] = {}
        self._tree = _Fenwick(4 * self._depth_limit + 64)
        self._next_position = 1
        self._window = _Window()
        # Cumulative miss reasons, in tokens (observable counters).
        self.evicted_tokens = 0
        self.cold_tokens = 0
        self.uncacheable_tokens = 0

    # --- what vLLM did ---------------------------------------------------------------

    def on_freed(self, block_hashes: Iterable) -> None:
        """Blocks with these hashes joined the back of the free queue, in this order."""
        hashes = list(map(hash, block_hashes))
        start = self._freed
        self._freed += len(hashes)
        self.recently_freed.update(zip(hashes, range(start, self._freed)))
        if len(self.recently_freed) > 2 * self._history:
            self._forget_oldest()
        threshold = self._threshold
        for key in hashes:
            if key % _HASH_SPACE < threshold:
                self._push(key)

    def on_lookup(self, keys: Sequence[bytes], hit_blocks: int, block_size: int, queried_tokens: int,
                  used_blocks: int, now: float) -> tuple[int, int, int]:  # fmt: skip
        """A counted prefix lookup of a request whose blocks that could hit have these
        keys (``vllm_compat.cached_block_keys``); the first ``hit_blocks`` did. Returns
        the missed tokens as (evicted, cold, uncacheable). The looked-up blocks are in
        use from now on."""
        recently_freed = self.recently_freed
        evicted = cold = 0
        for key in keys[hit_blocks:]:
            if hash(key) in recently_freed:
                evicted += block_size
            else:
                cold += block_size
        uncacheable = queried_tokens - block_size * len(keys)
        self.evicted_tokens += evicted
        self.cold_tokens += cold
        self.uncacheable_tokens += uncacheable

        sums = self._window.bucket(now)
        sums[_LOOKED_UP] += queried_tokens
        sums[_HIT] += block_size * hit_blocks
        threshold, rate = self._threshold, self.sample_rate
        for index, key in enumerate(keys):
            hashed = hash(key)
            if hashed % _HASH_SPACE < threshold:
                self._project(self._depth_and_take(hashed), index < hit_blocks, used_blocks, sums, block_size / rate)
        return evicted, cold, uncacheable

    def _project(self, depth: int | None, hit: bool, used_blocks: int, sums: array, weight: float) -> None:
        """One sampled block's gain or loss at each scale against vLLM's outcome.
        ``depth`` None: not in the stack, so in use now (if hit: hit at every scale) or
        never freed (missed at every scale)."""
        if depth is None:
            return
        for index, scale in enumerate(SCALES):
            fits = depth / self.sample_rate + used_blocks < scale * self.pool_blocks
            # Anchored at vLLM's outcome (scale 1 is it): LRU keeps a smaller cache's
            # blocks in a larger one.
            would_hit = (fits or hit) if scale > 1.0 else (fits and hit)
            if scale != 1.0 and would_hit != hit:
                sums[_GAIN + index] += weight if would_hit else -weight

    def on_demand(self, used_blocks: int, waiting_for_blocks: int, now: float) -> None:
        """Blocks in use, and held by preempted requests waiting to run again."""
        sums = self._window.bucket(now)
        demand = used_blocks + waiting_for_blocks
        if demand > sums[_PEAK]:
            sums[_PEAK] = demand

    def on_reset(self) -> None:
        """The prefix cache was emptied: no freed block is cached any more, at any size.
        (The history stays: a lookup of a block cached before the reset missed as evicted.)"""
        self._position_of = {}
        self._tree = _Fenwick(self._tree.size)
        self._next_position = 1

    # --- readings -----------------------------------------------------------------

    def projected_hit_ratios(self, now: float | None = None) -> dict[float, float]:
        """Scale -> the share of the window's looked-up tokens a pool that many times as
        large would have served from the prefix cache (empty before any lookup)."""
        totals = self._window.totals(time.monotonic() if now is None else now)
        looked_up = totals[_LOOKED_UP]
        if not looked_up:
            return {}
        return {
            scale: min(max((totals[_HIT] + totals[_GAIN + index]) / looked_up, 0.0), 1.0)
            for index, scale in enumerate(SCALES)
        }

    def preemption_free_scale(self, now: float | None = None) -> float | None:
        """The smallest pool, as a multiple of this one, that the window's peak demand fits."""
        peak = self._window.totals(time.monotonic() if now is None else now)[_PEAK]
        return peak / self.pool_blocks if peak and self.pool_blocks else None

    # --- the sampled stack ---------------------------------------------------------

    def _push(self, key: int) -> None:
        """A sampled block freed: on top of the stack (taken out of its old place)."""
        self._depth_and_take(key)
        if self._next_position > self._tree.size:
            self._renumber()
        position = self._next_position
        self._next_position += 1
        self._position_of[key] = position
        self._tree.add(position, 1)

    def _depth_and_take(self, key: int) -> int | None:
        """How many sampled blocks were freed after ``key``'s block (None if it is not
        in the stack); the block leaves the stack (it is in use, or freed again)."""
        position = self._position_of.pop(key, None)
        if position is None:
            return None
        tree = self._tree
        depth = len(self._position_of) - tree.up_to(position) + 1  # those above it, after its removal below
        tree.add(position, -1)
        return depth

    def _renumber(self) -> None:
        """Positions used up: the stack's blocks get 1..n again, deepest first, and
        those deeper than any scale could hold are dropped."""
        kept = sorted(self._position_of.items(), key=lambda item: item[1])[-self._depth_limit :]
        self._tree = _Fenwick(self._tree.size)
        self._position_of = {}
        for position, (key, _) in enumerate(kept, start=1):
            self._position_of[key] = position
            self._tree.add(position, 1)
        self._next_position = len(kept) + 1

    def _forget_oldest(self) -> None:
        """Keeps the history to the last ``HISTORY_PER_BLOCK`` × pool frees (run when it
        doubled: amortized one dict entry per free)."""
        oldest_kept = self._freed - self._history
        self.recently_freed = {key: order for key, order in self.recently_freed.items() if order >= oldest_kept}
