"""What the what-if curves share: SHARDS sampling, a recency stack of sampled blocks, a window.

A block is sampled when its hash (vLLM's, uniform bytes) sorts below ``sample_rate`` of the
hash space: the same blocks every time and in every process (Waldspurger et al., FAST '15).
Each curve keeps its sampled blocks in a ``RecencyStack`` (the GPU pool's in the order of
their last free, ``whatif.py``; a tier's in the order of their last use, ``tier_whatif.py``),
and sums what it projects in a ``Window`` of the last ten minutes.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Iterable
from itertools import compress, repeat
from operator import gt

WINDOW_SECONDS = 600.0
"""The curves and the peak demand are over the last ten minutes of lookups."""
BUCKET_SECONDS = 10.0
SAMPLED_BLOCKS = 256
"""By default, the sample rate keeps about this many sampled blocks per pool's worth."""


def default_sample_rate(pool_blocks: int) -> float:
    return min(1.0, SAMPLED_BLOCKS / max(pool_blocks, 1))


def sampling_threshold(sample_rate: float) -> bytes | None:
    """The bound a sampled block's hash sorts below (None: every block is sampled)."""
    bound = int(sample_rate * (1 << 64))
    return bound.to_bytes(8, "big") if bound < 1 << 64 else None


def sampled(threshold: bytes | None, hashes: list) -> Iterable:
    """The sampled ones among ``hashes``, picked in C (``sampling_threshold``'s None: all)."""
    return hashes if threshold is None else compress(hashes, map(gt, repeat(threshold), hashes))


def sampled_positions(threshold: bytes | None, hashes: list) -> Iterable[int]:
    """Where the sampled ones are among ``hashes``, picked in C."""
    positions = range(len(hashes))
    return positions if threshold is None else compress(positions, map(gt, repeat(threshold), hashes))


class RecencyStack:
    """Places (increasing numbers) of sampled blocks, deepest (least recent) first, with
    the count of those above any one. In chunks: a deletion from one plain list moves
    the whole list's tail, thousands of pointers for a sample of thousands of blocks
    (``docs/overhead.md#what-if-curve``)."""

    def __init__(self, chunk: int = 128) -> None:
        self.chunk = chunk
        self._chunks: list[list[int]] = []
        self._firsts: list[int] = []  # each chunk's first place when made: a lower bound of its places
        self._sizes: list[int] = []
        self.size = 0

    def push(self, place: int) -> None:
        """``place`` is larger than every place pushed before."""
        if not self._chunks or len(self._chunks[-1]) >= self.chunk:
            if len(self._chunks) > 2 * (self.size // self.chunk) + 4:
                self.keep_shallowest(self.size)  # mostly emptied chunks: repack
            self._chunks.append([])
            self._firsts.append(place)
            self._sizes.append(0)
        self._chunks[-1].append(place)
        self._sizes[-1] += 1
        self.size += 1

    def take(self, place: int) -> int:
        """Removes ``place`` (which is in the stack); returns how many places are above it."""
        index = bisect_right(self._firsts, place) - 1
        chunk = self._chunks[index]
        within = bisect_left(chunk, place)
        del chunk[within]
        self._sizes[index] -= 1
        self.size -= 1
        return len(chunk) - within + sum(self._sizes[index + 1 :])

    def count_above(self, place: int) -> int:
        """How many places in the stack are above (later than) ``place``."""
        index = bisect_right(self._firsts, place) - 1
        if index < 0:
            return self.size
        chunk = self._chunks[index]
        return len(chunk) - bisect_right(chunk, place) + sum(self._sizes[index + 1 :])

    def keep_shallowest(self, count: int) -> int:
        """Keeps the ``count`` latest places; returns the deepest kept (0 if none)."""
        places = [place for chunk in self._chunks for place in chunk][-count:] if count else []
        self._chunks = [places[start : start + self.chunk] for start in range(0, len(places), self.chunk)]
        self._firsts = [chunk[0] for chunk in self._chunks]
        self._sizes = [len(chunk) for chunk in self._chunks]
        self.size = len(places)
        return places[0] if places else 0


class Window:
    """Sums of ``fields`` numbers over the last ``WINDOW_SECONDS``, in buckets of
    ``BUCKET_SECONDS``; the field ``peak``, if any, is a maximum."""

    def __init__(self, fields: int, peak: int | None = None) -> None:
        self._fields = fields
        self._peak = peak
        self._buckets: deque[tuple[float, array]] = deque()

    def bucket(self, now: float) -> array:
        buckets = self._buckets
        if not buckets or now - buckets[-1][0] >= BUCKET_SECONDS:
            buckets.append((now, array("d", bytes(8 * self._fields))))
            while now - buckets[0][0] > WINDOW_SECONDS:
                buckets.popleft()
        return buckets[-1][1]

    def totals(self, now: float) -> array:
        total, peak = array("d", bytes(8 * self._fields)), self._peak
        for started, sums in list(self._buckets):  # one C call: a catch-up elsewhere may append meanwhile
            if now - started <= WINDOW_SECONDS:
                for index, value in enumerate(sums):
                    total[index] = max(total[index], value) if index == peak else total[index] + value
        return total
