"""Which requests get a row in the timeline, when a run has more than fit.

The rule, stated in the report itself: at most ``cap`` rows; requests that were
preempted or named by a leak finding come first (a uniform sample of them if
they alone are more than ``cap``), then a uniform sample of the others fills
the rest. Both samples are reservoirs (Vitter's algorithm R), so memory is
``2 × cap`` rows whatever the number of requests, and a fixed seed makes the
same files give the same report.
"""

from __future__ import annotations

import random
from typing import Generic, TypeVar

T = TypeVar("T")

TIMELINE_ROWS = 200
"""More rows than this no longer read as rows on a screen."""


class Reservoir(Generic[T]):
    """A uniform sample of at most ``cap`` of the items offered, in one pass."""

    def __init__(self, cap: int, seed: int) -> None:
        self.cap = cap
        self.seen = 0
        self.items: list[T] = []
        self._random = random.Random(seed)

    def offer(self, item: T) -> None:
        self.seen += 1
        if len(self.items) < self.cap:
            self.items.append(item)
            return
        slot = self._random.randrange(self.seen)
        if slot < self.cap:
            self.items[slot] = item

    def take(self, count: int) -> list[T]:
        """``count`` of the sample, chosen at random: the reservoir's slots are not
        (its first slots hold the first items more often than the others)."""
        if count >= len(self.items):
            return list(self.items)
        return self._random.sample(self.items, count)


class RowSample(Generic[T]):
    """Requests of interest first, then the others, ``cap`` rows in all."""

    def __init__(self, cap: int = TIMELINE_ROWS) -> None:
        self.cap = cap
        self.of_interest: Reservoir[T] = Reservoir(cap, seed=1)
        self.others: Reservoir[T] = Reservoir(cap, seed=2)

    def offer(self, item: T, interesting: bool) -> None:
        (self.of_interest if interesting else self.others).offer(item)

    @property
    def seen(self) -> int:
        return self.of_interest.seen + self.others.seen

    def rows(self) -> list[T]:
        kept = self.of_interest.take(self.cap)
        return kept + self.others.take(self.cap - len(kept))

    def rule(self) -> str:
        """The sampling rule in words, for the chart's subtitle."""
        if self.seen <= self.cap:
            return f"every request ({self.seen})"
        return (
            f"{min(self.seen, self.cap)} of {self.seen} requests: the preempted and leaked ones first "
            f"({self.of_interest.seen}), then a uniform sample of the others"
        )
