"""What an offload tier of another size would have served, from the prompts the GPU pool missed.

vLLM's offloading connector stores each full prompt block a request computes, and is
offered the blocks the GPU pool served too: those it holds already count as the
request's use of them (from 0.31, at the request's end). At an admission the tier is
asked, from the end of the GPU pool's hit on, for the blocks it holds, and serves them up
to the first it lacks. So each prompt block is used in the tier once per admission,
whatever the tier's size, and with LRU a tier of N blocks holds the N blocks used last:
a block is in a tier ``scale`` times as large where fewer than ``scale × capacity``
other blocks were used in the tier since its last use (its stack distance; Mattson et
al., 1970).

``TierReuse`` keeps that order for the sampled blocks (the GPU curve's sampling,
``whatif.py``: a block whose hash sorts below ``sample_rate`` of the hash space) and
at each admission walks the blocks the GPU pool missed, to the first sampled one that a
tier of each size would not hold. Where the engine has a tier, its own hit anchors the
curve: scale 1 is what it served, a larger tier serves that and what the walk finds
after it, a smaller one that up to the first block it would have lost. Where it has
none, the walk alone answers, for tiers of the GPU pool's size and its multiples: what a
first tier would give. The GPU pool's hits are the same at every scale (the tier does not
change what the GPU pool holds: a block loaded or computed again is cached there alike).

What it does not model: ARC (a tier with ARC is projected as LRU, anchored at what ARC
served), blocks a store could not take (all pinned by loads in flight), the decode
blocks a connector stores with ``offload_prompt_only`` off, and hybrid models (several KV
cache groups: no projection). The walk skips the unsampled blocks: with a sample rate
below 1, a run may reach past an unsampled block the tier lacks. Costs: the GPU curve's,
again, off the engine thread (``PrefixReuse.catch_up``): per looked-up block a comparison
in C, per sampled one a ``bisect`` and a deletion from a short list; memory, the stack up
to ``2 × max(scales)`` × capacity × ``sample_rate`` blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress, repeat
from operator import gt

from otel_kvcache.engine.sampling import RecencyStack, Window, sampled_below, sampling_threshold

TIER_SCALES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Tier sizes, as multiples of the engine's tier, projected where it has one (0: none)."""
FIRST_TIER_SCALES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
"""Tier sizes, as multiples of the GPU pool, projected where the engine has no tier."""

# A window bucket's fields: looked-up tokens, the GPU pool's hit tokens, the tier's at each scale.
_LOOKED_UP, _GPU_HIT, _TIER = 0, 1, 2


class TierReuse:
    """One engine's projection of the tokens a tier of each size would have served."""

    def __init__(self, capacity_blocks: int, sample_rate: float, measured: bool) -> None:
        self.capacity_blocks = capacity_blocks
        """The tier's blocks at scale 1 (GPU blocks: chunks × blocks per chunk), or the GPU pool's."""
        self.measured = measured
        """The engine has this tier: its own hits anchor scale 1."""
        self.scales = TIER_SCALES if measured else FIRST_TIER_SCALES
        self.sample_rate = sample_rate
        self._threshold = sampling_threshold(sample_rate)
        self._stack = RecencyStack()
        self._place_of: dict[bytes, int] = {}
        self._next_place = 0
        self._depth_limit = int(max(self.scales) * capacity_blocks * sample_rate) + 1
        self._window = Window(_TIER + len(self.scales))

    def lookup(self, keys: list, gpu_hit: int, tier_tokens: int, unit: int, queried_tokens: int, now: float) -> None:
        """An admission's lookup: its blocks' hashes, the first ``gpu_hit`` served by the GPU
        pool, then ``tier_tokens`` by the tier (0 where the engine has none)."""
        sums = self._window.bucket(now)
        sums[_LOOKED_UP] += queried_tokens
        sums[_GPU_HIT] += unit * gpu_hit
        missed = keys[gpu_hit:]
        tier_hit = min(tier_tokens // unit, len(missed))
        depths = [(at, self._depth(missed[at])) for at in self._sampled_positions(missed)]
        weight = unit / self.sample_rate
        for index, scale in enumerate(self.scales):
            if scale:
                sums[_TIER + index] += self._served(depths, tier_hit, tier_tokens, scale, weight)
        # Every prompt block is the tier's to keep, hit or not. vLLM's LRU ranks a request's
        # blocks last to first, so that its first ones stay longest: a block is never in the
        # tier without those before it, whose ranks are at least as recent.
        for key in reversed(list(self._sampled(keys))):
            self._use(key)
        if self._stack.size > 2 * self._depth_limit:
            self._drop_deepest()

    def _served(self, depths: list[tuple[int, int | None]], tier_hit: int, tier_tokens: int, scale: float,
                weight: float) -> float:  # fmt: skip
        """Tokens a tier ``scale`` times as large serves of the blocks the GPU pool missed. A
        block the tier holds is served (those before it are held too: see ``lookup``), so each
        sampled block counts for itself; each stands for ``1 / sample_rate`` blocks."""
        room = scale * self.capacity_blocks * self.sample_rate  # in sampled blocks
        if not self.measured:
            return weight * sum(depth is not None and depth < room for _, depth in depths)
        # LRU keeps what a smaller tier holds in a larger one: a larger tier serves the real
        # one's hit and the blocks after it that it holds; a smaller one, the real hit less
        # the blocks it would have lost.
        if scale == 1.0:  # what the tier served
            return tier_tokens
        if scale > 1.0:
            gained = sum(at >= tier_hit and depth is not None and depth < room for at, depth in depths)
            return tier_tokens + weight * gained
        lost = sum(at < tier_hit and (depth is None or depth >= room) for at, depth in depths)
        return max(tier_tokens - weight * lost, 0.0)

    def reset(self) -> None:
        """The tier was emptied."""
        self._stack = RecencyStack()
        self._place_of.clear()

    def projected_hit_ratios(self, now: float) -> dict[float, float]:
        """Scale -> the share of the window's looked-up tokens the GPU pool and a tier that
        size would have served together (empty before any lookup)."""
        totals = self._window.totals(now)
        looked_up = totals[_LOOKED_UP]
        if not looked_up:
            return {}
        return {
            scale: min(max((totals[_GPU_HIT] + totals[_TIER + index]) / looked_up, 0.0), 1.0)
            for index, scale in enumerate(self.scales)
        }

    # --- the sampled stack ---------------------------------------------------------

    def _sampled(self, keys: list) -> Iterable:
        return keys if self._threshold is None else sampled_below(self._threshold, keys)

    def _sampled_positions(self, keys: list) -> Iterable[int]:
        if self._threshold is None:
            return range(len(keys))
        return compress(range(len(keys)), map(gt, repeat(self._threshold), keys))

    def _depth(self, key: bytes) -> int | None:
        """How many sampled blocks were used in the tier since ``key``'s last use (None: never)."""
        place = self._place_of.get(key)
        return None if place is None else self._stack.count_above(place)

    def _use(self, key: bytes) -> None:
        place = self._place_of.get(key)
        if place is not None:
            self._stack.take(place)
        self._place_of[key] = self._next_place
        self._stack.push(self._next_place)
        self._next_place += 1

    def _drop_deepest(self) -> None:
        """Forgets the blocks deeper than any scale's tier holds (run when the stack doubled)."""
        deepest_kept = self._stack.keep_shallowest(self._depth_limit)
        self._place_of = {key: place for key, place in self._place_of.items() if place >= deepest_kept}
