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
``whatif.py``: a block whose hash sorts below ``sample_rate`` of the hash space), used in
each prompt's order reversed, as vLLM's LRU ranks them, so that a block is never in the
tier without those before it: each sampled block the GPU pool missed counts for itself,
served by a tier of each size that holds it, and stands for ``1 / sample_rate`` blocks,
no more than its lookup had. Where the engine has a tier, its own hit anchors the curve:
scale 1 is what it served, a larger tier serves that and the blocks after it that it
holds, a smaller one that less the blocks it would have lost (LRU keeps what a smaller
tier holds in a larger one). Where it has none, the stack alone answers, for tiers of the
GPU pool's size and its multiples: what a first tier would give. The GPU pool's hits are
the same at every scale: a block loaded from the tier or computed again is cached there
alike.

What it does not model: ARC (a tier with ARC is projected as LRU, anchored at what ARC
served), blocks a store could not take (all pinned by loads in flight), the decode
blocks a connector stores with ``offload_prompt_only`` off, and hybrid models (several KV
cache groups: no projection). Costs: off the engine thread, with the GPU curve's events
(``PrefixReuse.catch_up``): per looked-up block a comparison in C, per sampled one a
``bisect`` and a deletion from a list of ``STACK_CHUNK``, and per lookup with a sampled
block the GPU pool missed, a pass over those at each scale; memory, the stack up to
``2 × max(scales)`` × capacity × ``sample_rate`` blocks.
"""

from __future__ import annotations


from otel_kvcache.engine.sampling import RecencyStack, Window, sampled, sampled_positions, sampling_threshold

TIER_SCALES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Tier sizes, as multiples of the engine's tier, projected where it has one (0: none)."""
FIRST_TIER_SCALES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
"""Tier sizes, as multiples of the GPU pool, projected where the engine has no tier."""

STACK_CHUNK = 512
"""Places per chunk of the recency stack: a first tier's reaches 64 pools' sample, 32 k places,
which chunks of 128 would make 256 chunks to sum for a depth."""

# A window bucket's fields: looked-up tokens, the GPU pool's hit tokens, the engine's tier's, and
# what a tier of each scale would have served beyond (or short of) the engine's tier.
_LOOKED_UP, _GPU_HIT, _TIER_HIT, _GAIN = 0, 1, 2, 3


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
        self._stack = RecencyStack(STACK_CHUNK)
        self._place_of: dict[bytes, int] = {}
        self._next_place = 0
        self._depth_limit = int(max(self.scales) * capacity_blocks * sample_rate) + 1
        self._window = Window(_GAIN + len(self.scales))

    def lookup(self, keys: list, gpu_hit: int, tier_tokens: int, unit: int, queried_tokens: int, now: float) -> None:
        """An admission's lookup: its blocks' hashes, the first ``gpu_hit`` served by the GPU
        pool, then ``tier_tokens`` by the tier (0 where the engine has none)."""
        sums = self._window.bucket(now)
        sums[_LOOKED_UP] += queried_tokens
        sums[_GPU_HIT] += unit * gpu_hit
        sums[_TIER_HIT] += tier_tokens
        missed = keys[gpu_hit:]
        depths = [(at, self._depth(missed[at])) for at in sampled_positions(self._threshold, missed)]
        if depths:  # with a sample of a few hundred blocks a tier, most lookups have none
            tier_hit, weight = min(tier_tokens // unit, len(missed)), unit / self.sample_rate
            # A sampled block stands for 1 / sample_rate: no more than the lookup had, either way.
            least, most = -tier_tokens, unit * (len(missed) - tier_hit)
            for index, scale in enumerate(self.scales):
                if scale and not (self.measured and scale == 1.0):  # scale 1: what the tier served
                    gained = weight * self._gained(depths, tier_hit, scale)
                    sums[_GAIN + index] += min(max(gained, least), most)
        # Every prompt block is the tier's to keep, hit or not. vLLM's LRU ranks a request's
        # blocks last to first, so that its first ones stay longest: a block is never in the
        # tier without those before it, whose ranks are at least as recent.
        for key in reversed(list(sampled(self._threshold, keys))):
            self._use(key)
        if self._stack.size > 2 * self._depth_limit:
            self._drop_deepest()

    def _gained(self, depths: list[tuple[int, int | None]], tier_hit: int, scale: float) -> int:
        """The sampled blocks a tier ``scale`` times as large serves of those the GPU pool
        missed, less those the engine's tier served (each stands for ``1 / sample_rate``
        blocks). A block the tier holds is served (those before it are held too: see
        ``lookup``), so each counts for itself."""
        room = scale * self.capacity_blocks * self.sample_rate  # in sampled blocks
        if not self.measured:
            return sum(depth is not None and depth < room for _, depth in depths)
        # LRU keeps what a smaller tier holds in a larger one: a larger tier serves the real
        # one's hit and the blocks after it that it holds; a smaller one, the real hit less
        # the blocks it would have lost.
        if scale > 1.0:
            return sum(at >= tier_hit and depth is not None and depth < room for at, depth in depths)
        return -sum(at < tier_hit and (depth is None or depth >= room) for at, depth in depths)

    def reset(self) -> None:
        """The tier was emptied."""
        self._stack = RecencyStack(STACK_CHUNK)
        self._place_of.clear()

    def projected_hit_ratios(self, now: float) -> dict[float, float]:
        """Scale -> the share of the window's looked-up tokens the GPU pool and a tier that
        size would have served together (empty before any lookup)."""
        totals = self._window.totals(now)
        looked_up = totals[_LOOKED_UP]
        if not looked_up:
            return {}
        tier_hit = totals[_TIER_HIT]
        return {
            scale: min((totals[_GPU_HIT] + (tier_hit + totals[_GAIN + index] if scale else 0.0)) / looked_up, 1.0)
            for index, scale in enumerate(self.scales)
        }

    # --- the sampled stack ---------------------------------------------------------


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
