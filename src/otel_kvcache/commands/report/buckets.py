"""Time series folded into a bounded number of equal time buckets while streaming.

A day-long run exported every second has 86,400 readings per series, far more
than a chart a screen wide can show, and the length of the run is not known
until the last line is read. ``TimeBuckets`` starts with fine buckets and, each
time there would be more than ``limit`` of them, doubles their width and merges
neighbours: memory stays at ``limit`` values per series whatever the file's
size, and a short run keeps every reading (one per bucket).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")

FINEST_NS = 1_000_000
"""1 ms: finer than any export interval or scheduler step worth telling apart."""


class TimeBuckets(Generic[V]):
    """Values by time, at most ``limit`` buckets; ``merge`` folds two values of one bucket.

    ``merge`` must not care about order or grouping (a maximum, a sum), since
    buckets merge again whenever the width doubles.
    """

    def __init__(self, merge: Callable[[V, V], V], limit: int = 1000) -> None:
        self.merge = merge
        self.limit = limit
        self.width = FINEST_NS
        self.origin: int | None = None
        self._buckets: dict[int, V] = {}

    def add(self, time_ns: int, value: V) -> None:
        if self.origin is None:
            self.origin = time_ns
        key = (time_ns - self.origin) // self.width
        held = self._buckets.get(key)
        self._buckets[key] = value if held is None else self.merge(held, value)
        if len(self._buckets) > self.limit:
            self._coarsen()

    def _coarsen(self) -> None:
        while len(self._buckets) > self.limit:
            self.width *= 2
            merged: dict[int, V] = {}
            for key, value in self._buckets.items():
                held = merged.get(key // 2)
                merged[key // 2] = value if held is None else self.merge(held, value)
            self._buckets = merged

    def __len__(self) -> int:
        return len(self._buckets)

    def __iter__(self) -> Iterator[tuple[int, int, V]]:
        """(bucket start, bucket end, value) in time order, times in ns."""
        for key in sorted(self._buckets):
            start = self.origin + key * self.width
            yield start, start + self.width, self._buckets[key]


@dataclass
class TimeRange:
    """The first and last timestamps seen (ns), None before any."""

    first: int | None = None
    last: int | None = None

    def saw(self, time_ns: int) -> None:
        if time_ns:
            self.first = time_ns if self.first is None else min(self.first, time_ns)
            self.last = time_ns if self.last is None else max(self.last, time_ns)
