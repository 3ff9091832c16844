"""Why prefix lookups missed, and what a pool of another size would have hit.

vLLM's prefix cache is an LRU cache of block hashes: a request's blocks join
the back of the free queue when it ends (or is preempted), deepest first, and
a block is evicted when the queue's head reaches it. Both answers here follow
from that order, fed by the engine at each release, preemption and lookup.

**Miss reasons.** Two generations of hash sets remember the blocks freed
lately (``handover.miss_reasons.FreedHistory``; here, references to vLLM's own hash
objects, about 80 bytes each). A looked-up block that missed is ``evicted`` if
it is remembered (it was cached, and gone by the time this request asked),
``cold`` if not; a block freed longer ago than the history reaches counts as
cold, the history's only error. Tokens vLLM never serves from the cache (the
tail that does not fill a block, the last token) are ``uncacheable``. The
three add up to vLLM's queries minus its hits. The history is kept where it
costs the engine thread nothing: for the counters, by the curve's reader
(``catch_up``), from the same events; for each request's span, where the span
is built (``handover.miss_reasons``).

**The what-if curve**, a miss-ratio curve built the way caches build one
online (SHARDS, Waldspurger et al., FAST '15): a block is sampled when its
hash (vLLM's, uniform bytes) sorts below ``sample_rate`` of the hash space,
the same blocks every time and in every process. For the sampled blocks,
``_stack`` orders those not in use by their last free, latest on top. A
looked-up block ``d`` sampled blocks deep has about ``d / sample_rate`` blocks
freed after it: with a pool ``scale`` times as large, and the same requests
running (their blocks take room first), it would still be cached if
``d / sample_rate + used < scale × pool``. LRU keeps what a smaller cache
holds in a larger one, so vLLM's own hit or miss of each block anchors the
curve: a block vLLM hit counts as hit at every larger scale, one it missed as
missed at every smaller one, and scale 1 is vLLM's measured ratio. The
projection for scale s is vLLM's hit tokens plus the sampled blocks' gain at
s, scaled by ``1 / sample_rate``, over the window's looked-up tokens. What it
does not model: preemptions a smaller pool would add (their recomputation
misses), a bigger pool admitting more requests at once (their blocks would
take more room), and a hit stopping at the first missing block of a chain.

**Hybrid models** (``vllm_compat.layouts``). Everything is counted in vLLM's hash unit
(``hash_block_size``), which on a model of several KV cache groups can be finer than its
block size, and a hit ends only where every group holds the prefix: a Mamba group's
checkpoints, a sliding window's last blocks. There the history holds the entries of
those groups that vLLM gave back to its free queue (and those a lookup found running
requests holding), and a missed unit is ``evicted`` up to the deepest one vLLM could
have resumed at by them. The curve follows each lookup to the deepest such checkpoint
whose entries a pool ``scale`` times as large would still hold (``_Checkpoints``: their
places in the free order, unsampled, few per prompt), in tokens, for every lookup; the
sampled blocks (the first full-attention group's, and the checked groups') measure
the depth.

Costs. On the engine thread, per lookup, release and step, an event's fields
and its blocks' hashes appended to one flat list (and, where spans are built in
the engine's process, ``MissReasons``' set operations per freed or missed block). The curve's own work waits in that list
until the curve is read (``catch_up``: at metric collection, or a snapshot for
``otel-kvcache top``), off the engine thread: per block, a set operation and a comparison in C
(``itertools.compress`` picks the sampled ones without a Python step per
block; the keys are vLLM's own hash objects, not Python ``hash`` ints, which would
cost a ``hash`` call and a new int per block), and per sampled block a ``bisect``
and a deletion from a short list (``docs/overhead.md#what-if-curve``). Where
nothing reads the curve for long, the engine thread takes in a slice at each
step once ``MOST_PENDING`` entries wait (``catch_up_if_behind``), at the cost it would
have paid event by event. Memory: the history above, the entries waiting and
what they keep (about 20 MB at most), and the stack up to ``2 × max(SCALES)`` ×
pool × ``sample_rate`` blocks.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from array import array
from collections.abc import Iterable

from otel_kvcache.engine.sampling import RecencyStack, Window, sampled, sampling_threshold
from otel_kvcache.engine.tier_whatif import TierReuse
from otel_kvcache.handover.miss_reasons import (
    DEMAND,
    ENTRIES,
    FREED,
    HELD,
    LOOKUP,
    RESET,
    TIER_RESET,
    FreedHistory,
    next_event,
)
from otel_kvcache.vllm_compat.layouts import PrefixLayout

SCALES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Pool sizes, as multiples of the real one, that the curve is projected for."""
MOST_PENDING = 1 << 18
"""Entries (an event's fields, the hashes of its blocks) the curve may have yet to take
in before the engine thread takes some in itself, where nothing reads the curve for
long: 2 MB of references, and at most about 20 MB of the hashes and numbers they keep."""
ENGINE_SLICE = 1 << 14
"""Entries the engine thread takes in at a step when too many wait: a few milliseconds."""


_IN_USE = -1
"""A checkpoint's place while a hit holds it."""


class _Checkpoints:
    """A hybrid model's entries of its checked groups (``layouts.PrefixLayout.checked``) that
    vLLM gave back to its free queue, by key: where in the free order (``RecencyStack``'s places),
    or ``_IN_USE`` once a hit took them back. Not sampled: where a hit can end is few units
    of a prompt (a Mamba group's checkpoints), and each counts."""

    def __init__(self, layout: PrefixLayout) -> None:
        self._checked = layout.checked
        self._attention = layout.attention
        self._place_of: dict[bytes, int] = {}

    def freed(self, entries: list, place: int) -> None:
        place_of = self._place_of
        for key in entries:
            place_of[key] = place

    def held(self, entries: list) -> None:
        """Entries a lookup found held by running requests: in use, where not known free."""
        place_of = self._place_of
        for key in entries:
            place_of.setdefault(key, _IN_USE)

    def taken(self, keys: list, hit_blocks: int) -> list:
        """A hit took the entries at its end back into use, and the attention blocks before:
        returns those it took from the free queue."""
        if not hit_blocks:
            return []
        place_of, end = self._place_of, keys[hit_blocks - 1]
        entries = [end + suffix for suffix in self._checked]
        if self._attention is not None:
            entries += [key + self._attention for key in keys[: hit_blocks - 1]]
        taken = [entry for entry in entries if place_of.get(entry, _IN_USE) != _IN_USE]
        for entry in taken:
            place_of[entry] = _IN_USE
        return taken

    def depth(self, key: bytes, stack: RecencyStack, present: bytes | None = None) -> int | None:
        """How many sampled blocks were freed after the shallowest entry at this unit, where
        every checked group's is known (None otherwise), but ``present``'s, in the cache now:
        0 where all are in use."""
        deepest = None
        for suffix in self._checked:
            if suffix == present:
                continue
            place = self._place_of.get(key + suffix)
            if place is None:
                return None
            if place != _IN_USE and (deepest is None or place < deepest):
                deepest = place
        return 0 if deepest is None else stack.count_above(deepest)

    def forget_deeper_than(self, place: int, most_in_use: int) -> None:
        """Drops the entries freed before ``place`` (deeper than any scale holds), and those
        in use if more than ``most_in_use`` are (requests gone unreleased)."""
        kept = {key: at for key, at in self._place_of.items() if at >= place or at == _IN_USE}
        if sum(at == _IN_USE for at in kept.values()) > most_in_use:
            kept = {key: at for key, at in kept.items() if at != _IN_USE}
        self._place_of = kept


# A window bucket's fields.
_LOOKED_UP, _HIT, _PEAK, _GAIN = 0, 1, 2, 3


_READ_SINCE_FORK: weakref.WeakSet[PrefixReuse] = weakref.WeakSet()


def _unlock_in_a_forked_child() -> None:
    """A fork copies the lock of a reading under way, not the thread reading: the child's
    collections would wait on it for ever, and export nothing. Each starts unlocked."""
    for reuse in list(_READ_SINCE_FORK):
        reuse._catching_up = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_a_forked_child)


class PrefixReuse:
    """One engine's history of freed prefix blocks: miss reasons and the what-if curve."""

    def __init__(self, pool_blocks: int, sample_rate: float, layout: PrefixLayout | None = None) -> None:
        self.pool_blocks = pool_blocks
        self.sample_rate = sample_rate
        self.layout = layout or PrefixLayout(unit=1)
        """Where a hit can end (``layouts.py``): the curve of a hybrid model follows where
        vLLM could resume (``_Checkpoints``)."""
        self._threshold = sampling_threshold(sample_rate)
        self._history = FreedHistory(pool_blocks)
        """The miss reasons' history, for the counters (taken in with the curve's events)."""
        # Sampled blocks not in use, by their last free: their places in the free order
        # (increasing numbers, deepest first), and each block's place.
        self._stack = RecencyStack()
        self._place_of: dict[bytes, int] = {}
        self._next_place = 0
        self._holders: dict[bytes, int] = {}
        """Sampled blocks in use: how many requests hold each (a block joins the queue when
        its last holder lets go)."""
        self._depth_limit = int(max(SCALES) * pool_blocks * sample_rate) + 1
        self._checkpoints = _Checkpoints(self.layout) if self.layout.hybrid else None
        self._window = Window(_GAIN + len(SCALES), peak=_PEAK)
        self.tier = None if self.layout.hybrid else TierReuse(pool_blocks, sample_rate, measured=False)
        """What a tier of each size would have served with this pool (``tier_whatif.py``): a
        first tier's, multiples of this pool, until ``measure_tier`` finds the engine's own."""
        self._curve_events: list = []
        """What vLLM did that the curve has yet to take in, in order (``catch_up``): each
        event's kind and fields one after another in one list, so that the events waiting
        add no object for the garbage collector to count (a tuple and a list each had it
        collect the young generation four times as often on churn). Only the engine thread
        writes here (``catch_up`` relies on it: an event is half written only between its
        two calls)."""
        self._catching_up = threading.Lock()
        _READ_SINCE_FORK.add(self)
        # Cumulative miss reasons, in tokens (observable counters), as of the last ``catch_up``.
        self.evicted_tokens = 0
        self.cold_tokens = 0
        self.uncacheable_tokens = 0

    # --- what vLLM did (on the engine thread) ------------------------------------------

    def on_freed(self, hashes: list) -> None:
        """A request gave back its blocks, whose hashes these are (its units' at the first
        full-attention group's block ends: ``PrefixLayout.stride``), shallowest first (read
        now and not kept: vLLM frees the deepest first, and the curve takes them in in
        that order): cached now, or still in use by another."""
        events = self._curve_events
        events.extend((FREED, len(hashes)))  # the hashes apart: see catch_up
        events.extend(hashes)

    def on_entries_freed(self, keys: list) -> None:
        """vLLM gave back blocks holding these entries of a hybrid model's checked groups
        (``layouts.entries_reader``), cached in its free queue from now on."""
        events = self._curve_events
        events.extend((ENTRIES, len(keys)))
        events.extend(keys)

    def on_entries_held(self, keys: list) -> None:
        """A lookup found these entries of a hybrid model's checked groups in vLLM's cache,
        held by running requests (``layouts.cached_entries_reader``)."""
        events = self._curve_events
        events.extend((HELD, len(keys)))
        events.extend(keys)

    def on_lookup(self, keys: list, hit_blocks: int, unit: int, queried_tokens: int,
                  used_blocks: int, now: float, present: int = 0, tier_tokens: int = 0) -> None:  # fmt: skip
        """A counted prefix lookup of a request whose units that could hit have these
        hashes (``vllm_compat.readers.lookup_keys_reader``, a list of its own); the first ``hit_blocks``
        did, and the ``present`` after them are in the full-attention group's cache
        (``layouts.attention_reach_reader``), and ``tier_tokens`` came from the engine's offload
        tier. The looked-up blocks are in use from now on."""
        events = self._curve_events
        events.extend((LOOKUP, hit_blocks, unit, queried_tokens, used_blocks, now, present, tier_tokens, len(keys)))
        events.extend(keys)

    def on_demand(self, used_blocks: int, waiting_for_blocks: int, now: float) -> None:
        """Blocks in use, and held by preempted requests waiting to run again."""
        self._curve_events.extend((DEMAND, used_blocks + waiting_for_blocks, now))

    def on_reset(self) -> None:
        """The prefix cache was emptied: no freed block is cached any more, at any size.
        (The history stays: a lookup of a block cached before the reset missed as evicted.)"""
        self._curve_events.append(RESET)

    def on_tier_reset(self) -> None:
        """The engine's offload tier was emptied."""
        self._curve_events.append(TIER_RESET)

    def measure_tier(self, capacity_blocks: int, sample_rate: float) -> None:
        """The engine has an offload tier of ``capacity_blocks`` GPU blocks: the projection is
        of that tier's multiples, anchored at what it serves (before the engine's first step)."""
        if self.tier is not None:
            self.tier = TierReuse(capacity_blocks, sample_rate, measured=True)

    def catch_up_if_behind(self) -> None:
        """Once a step, on the engine thread: where nothing has read the curve for long
        (more than ``MOST_PENDING`` entries wait), takes in the oldest ``ENGINE_SLICE``
        entries or more, back to the bound, at the cost it would have paid event by
        event; never waits for a reader that is taking them in already."""
        waiting = len(self._curve_events)
        if waiting > MOST_PENDING:  # at least back to the bound, however much a step added
            self.catch_up(most=max(ENGINE_SLICE, waiting - MOST_PENDING), wait=False)

    # --- the curve, where it is read ------------------------------------------------

    def catch_up(self, most: int | None = None, wait: bool = True) -> None:
        """Takes what vLLM did since the last reading into the curve, in order: all of
        it, or the events that begin within the first ``most`` entries. With ``wait``
        False, nothing if another thread is taking them in. An event that fails is
        dropped with those before it (the error reaches the caller). Where an event's
        hashes never came, the reading goes on at the next event, the curve starts
        again, and a ``ValueError`` says so."""
        if not self._catching_up.acquire(blocking=wait):
            return
        try:
            events = self._curve_events
            # Whole events only: the engine thread adds more meanwhile, each event's fields
            # in one call and its blocks' hashes in the next (no list and tuple built around
            # the hashes), so the last event may still lack its hashes.
            written = len(events)
            end = written if most is None else min(written, most)
            at, lost = 0, False
            try:
                while at < end:
                    kind = events[at]
                    if kind == LOOKUP:
                        hit_blocks, unit, queried_tokens, used_blocks, now, present, tier_tokens, count = events[
                            at + 1 : at + 9
                        ]
                        if at + 9 + count > written:
                            break
                        keys = events[at + 9 : at + 9 + count]
                        at += 9 + count
                        self._curve_lookup(keys, hit_blocks, unit, queried_tokens, used_blocks, now, present)
                        if self.tier is not None:
                            self.tier.lookup(keys, hit_blocks, tier_tokens, unit, queried_tokens, now)
                    elif kind == FREED:
                        count = events[at + 1]
                        if at + 2 + count > written:
                            break
                        hashes = events[at + 2 : at + 2 + count]
                        at += 2 + count
                        hashes.reverse()  # in the order vLLM freed them: deepest first
                        self._curve_freed(hashes)
                    elif kind == ENTRIES or kind == HELD:
                        count = events[at + 1]
                        if at + 2 + count > written:
                            break
                        entries = events[at + 2 : at + 2 + count]
                        at += 2 + count
                        (self._curve_entries_freed if kind == ENTRIES else self._curve_entries_held)(entries)
                    elif kind == DEMAND:
                        demand, now = events[at + 1 : at + 3]
                        at += 3
                        self._curve_demand(demand, now)
                    elif kind == RESET:
                        at += 1
                        self._curve_reset()
                    elif kind == TIER_RESET:
                        at += 1
                        if self.tier is not None:
                            self.tier.reset()
                    else:  # a field or a hash: an earlier event's hashes never came
                        at = next_event(events, at, written)
                        self._curve_reset()
                        lost = True
                if lost:  # counted by the caller; the events after the loss were taken in
                    raise ValueError("the what-if curve's events lost their order; it starts again")
            finally:
                del events[:at]  # up to the end of the last event begun, taken in or failed
        finally:
            self._catching_up.release()

    def _curve_freed(self, hashes: list) -> None:
        if not self.layout.hybrid:  # where its units are where hits end (``layouts.py``)
            self._history.freed(hashes)
        holders = self._holders
        for key in self._sampled(hashes):
            held_by = holders.pop(key, 1) - 1
            if held_by:  # another request still holds it: not in the free queue yet
                holders[key] = held_by
                continue
            self._push(key)
        if self._stack.size > 2 * self._depth_limit:
            self._drop_deepest()

    def _push(self, key: bytes) -> None:
        """A sampled block joins the free queue's back (leaving its earlier place, if any)."""
        self._take(key)
        self._place_of[key] = self._next_place
        self._stack.push(self._next_place)
        self._next_place += 1

    def _curve_entries_freed(self, entries: list) -> None:
        self._history.freed(entries)
        self._checkpoints.freed(entries, self._next_place)
        attention = self.layout.attention
        for key in self._sampled(entries):  # blocks of the pool too, freed when no one holds them
            if attention is None or not key.endswith(attention):  # those the units stand for (_curve_freed)
                self._push(key)
        if self._stack.size > 2 * self._depth_limit:
            self._drop_deepest()

    def _curve_entries_held(self, entries: list) -> None:
        self._history.freed(entries)
        self._checkpoints.held(entries)

    def _sampled(self, hashes: list) -> Iterable:
        """The sampled ones among ``hashes``, picked in C."""
        return sampled(self._threshold, hashes)

    def _curve_lookup(self, keys: list, hit_blocks: int, unit: int, queried_tokens: int,
                      used_blocks: int, now: float, present: int) -> None:  # fmt: skip
        missed = keys[hit_blocks:]
        evicted = unit * self._history.evicted(missed, present, self.layout)
        self.evicted_tokens += evicted
        self.cold_tokens += unit * len(missed) - evicted
        self.uncacheable_tokens += queried_tokens - unit * len(keys)
        sums = self._window.bucket(now)
        sums[_LOOKED_UP] += queried_tokens
        sums[_HIT] += unit * hit_blocks
        stride = self.layout.stride
        weight = unit * stride / self.sample_rate
        checkpoints = self._checkpoints
        if checkpoints is not None:  # where vLLM could resume, before this hit takes its end into use
            self._project_resumption(keys, hit_blocks, present, used_blocks, sums)
            for entry in checkpoints.taken(keys, hit_blocks):
                self._take(entry)
        ends = keys if stride == 1 else keys[stride - 1 :: stride]  # the units that end a block
        split = hit_blocks // stride
        holders = self._holders
        for hit, blocks in ((True, ends[:split]), (False, ends[split:])):
            for key in self._sampled(blocks):
                depth = self._take(key)
                if checkpoints is None:
                    self._project(depth, hit, used_blocks, sums, weight)
                holders[key] = holders.get(key, 0) + 1

    def _project_resumption(self, keys: list, hit_blocks: int, present: int, used_blocks: int,
                            sums: array) -> None:  # fmt: skip
        """A hybrid model's lookup at each scale: its hit ends at the deepest unit where vLLM
        could resume whose checked entries a pool that large would still hold (their depth:
        the sampled blocks freed after the shallowest of them). Beyond vLLM's hit, where it
        gave them all back, as deep as the curve reaches; a smaller pool's hit ends short of
        vLLM's where the entries at its end would have gone. Counted for every lookup, in tokens:
        where a hit can end is no block's own property, so sampling blocks says nothing of it."""
        checkpoints, attention = self._checkpoints, self.layout.attention
        larger = [at for at, scale in enumerate(SCALES) if scale > 1.0]
        smaller = [at for at, scale in enumerate(SCALES) if scale < 1.0]
        reach = [hit_blocks] * len(SCALES)

        def fitting(at: int, depth: int) -> bool:
            return depth / self.sample_rate + used_blocks < SCALES[at] * self.pool_blocks

        # Beyond the hit: the deepest unit vLLM could have resumed at whose entries still fit.
        for index in range(len(keys) - 1, hit_blocks - 1, -1):
            if not larger:
                break
            depth = checkpoints.depth(keys[index], self._stack, attention if index - hit_blocks < present else None)
            if depth is not None:
                for at in [at for at in larger if fitting(at, depth)]:
                    reach[at] = index + 1
                    larger.remove(at)
        # Within it: where the entries at its end would have gone, the deepest that stayed.
        if hit_blocks:
            end = checkpoints.depth(keys[hit_blocks - 1], self._stack)
            lost = [at for at in smaller if end is not None and not fitting(at, end)]
            for at in lost:
                reach[at] = 0
            for index in range(hit_blocks - 2, -1, -1):
                if not lost:
                    break
                depth = checkpoints.depth(keys[index], self._stack)
                if depth is not None:
                    for at in [at for at in lost if fitting(at, depth)]:
                        reach[at] = index + 1
                        lost.remove(at)
        unit = self.layout.unit
        for at in range(len(SCALES)):
            if reach[at] != hit_blocks:
                sums[_GAIN + at] += unit * (reach[at] - hit_blocks)

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

    def _curve_demand(self, demand: int, now: float) -> None:
        sums = self._window.bucket(now)
        if demand > sums[_PEAK]:
            sums[_PEAK] = demand

    def _curve_reset(self) -> None:
        self._stack = RecencyStack()
        self._place_of.clear()
        if self._checkpoints is not None:
            self._checkpoints = _Checkpoints(self.layout)

    # --- readings -----------------------------------------------------------------

    def missed_tokens(self) -> tuple[int, int, int]:
        """vLLM's missed lookup tokens so far, as (evicted, cold, uncacheable)."""
        self.catch_up()
        return self.evicted_tokens, self.cold_tokens, self.uncacheable_tokens

    def projected_hit_ratios(self, now: float | None = None) -> dict[float, float]:
        """Scale -> the share of the window's looked-up tokens a pool that many times as
        large would have served from the prefix cache (empty before any lookup)."""
        self.catch_up()
        totals = self._window.totals(time.monotonic() if now is None else now)
        looked_up = totals[_LOOKED_UP]
        if not looked_up:
            return {}
        return {
            scale: min(max((totals[_HIT] + totals[_GAIN + index]) / looked_up, 0.0), 1.0)
            for index, scale in enumerate(SCALES)
        }

    def projected_tier_hit_ratios(self, now: float | None = None) -> dict[float, float]:
        """Scale -> the share of the window's looked-up tokens the pool and an offload tier of
        that scale would have served together (``tier_whatif.py``; empty on a hybrid model)."""
        self.catch_up()
        if self.tier is None:
            return {}
        return self.tier.projected_hit_ratios(time.monotonic() if now is None else now)

    def preemption_free_scale(self, now: float | None = None) -> float | None:
        """The smallest pool, as a multiple of this one, that the window's peak demand fits."""
        self.catch_up()
        peak = self._window.totals(time.monotonic() if now is None else now)[_PEAK]
        return peak / self.pool_blocks if peak and self.pool_blocks else None

    # --- the sampled stack ---------------------------------------------------------

    def _take(self, key: bytes) -> int | None:
        """How many sampled blocks were freed after ``key``'s block (None if it is not in
        the stack); the block leaves the stack (it is in use, or freed again)."""
        place = self._place_of.pop(key, None)
        return None if place is None else self._stack.take(place)

    def _drop_deepest(self) -> None:
        """Forgets the blocks deeper than any scale could hold (run when the stack doubled)."""
        deepest_kept = self._stack.keep_shallowest(self._depth_limit)
        if len(self._holders) > self._depth_limit:  # more than the pool holds: requests gone unreleased
            self._holders.clear()
        self._place_of = {key: place for key, place in self._place_of.items() if place >= deepest_kept}
        if self._checkpoints is not None:
            self._checkpoints.forget_deeper_than(deepest_kept, self._depth_limit)
