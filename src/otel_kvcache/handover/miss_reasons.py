"""Why each request's prefix lookups missed: ``evicted`` or ``cold``, found once per request.

Whether a missed unit was ``evicted`` (cached, and gone by the time this request
asked) or ``cold`` (never cached) follows from the prefixes vLLM gave back to its free
queue before the lookup (``FreedHistory``, ``engine.whatif``'s docstring). The engine
counts each request's missed tokens in its tally (``MISSED_TOKENS``); the evicted ones
among them are found where the request's span is built, and the cold ones are the rest
(``record.finished_request``):

- where spans are built in the engine's process, at once, on the engine thread
  (``MissReasons``);
- where the helper process builds them, there: the engine hands it, ahead of each
  frame's records, each free's hashes and each missed lookup's keys in the order vLLM
  made them (``MissesForTheHelper``, one flat list of events: ``FREED``, ``ENTRIES``,
  ``MISSED`` and their fields), and the helper keeps the history
  (``MissReasonsFromTheEngine``), so that the engine thread neither hashes a freed
  block's hash nor grows a set per free (``docs/overhead.md#miss-reasons``).

What the helper's history does not see: the events of frames lost on the way (with
their records, counted; or alone, where the engine's end of the pipe drops prefix
events first to keep records flowing to a slow helper), and those handed to a helper
that died: one started in its place remembers nothing. A lookup the history never saw
leaves its misses cold, so misses lean cold there, and still add up, with the
uncacheable tokens, to vLLM's.

Memory: the history holds between ``HISTORY_PER_BLOCK / 2`` and ``HISTORY_PER_BLOCK``
pool-fulls of distinct hashes (in the helper, unmarshalled copies of about 100 bytes
each: about 40 MB for a pool of 100,000 blocks).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from itertools import count as serial_numbers
from typing import NamedTuple, Protocol

from otel_kvcache.handover.tally import EVICTED_TOKENS, LOOKUP_SERIAL, MISSED_TOKENS, PACKED, Tally
from otel_kvcache.vllm_compat.layouts import PrefixLayout

_logger = logging.getLogger(__name__)

HISTORY_PER_BLOCK = 4
"""The freed-block history holds up to this many distinct hashes per block of the pool
(two generations of half as many each)."""


class PrefixEventSink(Protocol):
    """What the engine tells about its prefixes, for its requests' miss reasons."""

    def freed(self, hashes: list) -> None:
        """A request gave back its blocks, whose units' hashes these are."""

    def entries_freed(self, keys: list) -> None:
        """vLLM gave back blocks holding these entries of a hybrid model's checked groups."""

    def missed(self, tally: Tally, keys: list, present: int) -> None:
        """These looked-up units of the request missed, the first ``present`` of them with
        their attention blocks in the cache (``layouts``)."""


class FreedHistory:
    """The prefixes freed lately, in two generations: the current one, and the one before
    it, dropped when the current one fills up. It holds what vLLM gave back to its free
    queue with a prefix: the units' hashes of a request's blocks, and, on a hybrid model,
    the entries of the other groups (``layouts.PrefixLayout``)."""

    def __init__(self, pool_blocks: int) -> None:
        self._generation = max(1, HISTORY_PER_BLOCK * pool_blocks // 2)
        self._lately: set = set()
        self._before: set = set()

    def freed(self, hashes: Iterable) -> None:
        self._lately.update(hashes)
        if len(self._lately) >= self._generation:
            self._before, self._lately = self._lately, set()

    def evicted(self, missed: list, present: int, layout: PrefixLayout) -> int:
        """How many of a lookup's missed blocks (its units after the hit, shallowest first)
        a cache that had kept what it was given would have served: those up to the deepest
        one vLLM could have resumed at, by what it gave back lately. The first ``present``
        of them are still in the first full-attention group's cache (``layouts``)."""
        lately, before = self._lately, self._before
        if not layout.checked:  # every unit ends a hit: a freed chain is remembered whole
            if lately.isdisjoint(missed) and before.isdisjoint(missed):  # all cold: no loop
                return 0
            for index in range(len(missed) - 1, -1, -1):
                if missed[index] in lately or missed[index] in before:
                    return index + 1
            return 0
        for index in range(len(missed) - 1, -1, -1):
            if self.resumable(missed[index], index < present, layout):
                return index + 1
        return 0

    def resumable(self, key: bytes, attention_present: bool, layout: PrefixLayout) -> bool:
        """Whether a hybrid model's lookup could have ended at the unit with this hash, by
        what vLLM gave back lately: every checked group's entry there, the first
        full-attention group's aside where its blocks are in the cache now
        (``attention_present``)."""
        lately, before = self._lately, self._before
        for suffix in layout.checked:
            if suffix == layout.attention and attention_present:
                continue
            entry = key + suffix
            if entry not in lately and entry not in before:
                return False
        return True


class MissReasons:
    """Each request's missed tokens that were evicted, found on the engine thread, for spans
    built in the engine's process. Where the helper process builds them, the engine tells
    ``MissesForTheHelper`` the same instead."""

    __slots__ = ("_history", "_layout")

    def __init__(self, pool_blocks: int, layout: PrefixLayout) -> None:
        self._history = FreedHistory(pool_blocks)
        self._layout = layout

    def freed(self, hashes: list) -> None:
        """A request gave back its blocks, whose units' hashes these are."""
        self._history.freed(hashes)

    def entries_freed(self, keys: list) -> None:
        """vLLM gave back blocks holding these entries of the checked groups (hybrid models)."""
        self._history.freed(keys)

    def missed(self, tally: Tally, keys: list, present: int) -> None:
        """These looked-up units of the request missed (``tally.py``'s tally, written here)."""
        unit = self._layout.unit
        tally[MISSED_TOKENS] += unit * len(keys)
        tally[EVICTED_TOKENS] += unit * self._history.evicted(keys, present, self._layout)


FREED, MISSED, ENTRIES, HELD, LOOKUP, DEMAND, RESET, TIER_RESET = range(-1, -9, -1)
"""The kinds of prefix events, in the flat lists the engine thread fills: each event's kind
and fields in one call, its hashes in the next. Negative, as no count, serial, time or hash
is, so that a reader finds the next event where one's hashes never came (``next_event``).

To the helper (``MissesForTheHelper``): ``FREED, count, *hashes`` (a request gave back its
blocks, whose units' hashes these are), ``MISSED, lookup serial, present, count, *keys`` (a
lookup's units that missed, the first ``present`` of them with their attention blocks in
the cache) and ``ENTRIES, count, *keys`` (a hybrid model's checked groups' entries that
reached the free queue, or that a lookup found held: ``layouts.PrefixLayout``). To the
what-if curve (``engine.whatif.PrefixReuse``): ``FREED`` and ``ENTRIES`` alike, ``HELD``
for the entries a lookup found held, and ``LOOKUP``, ``DEMAND``, ``RESET`` and ``TIER_RESET``."""


def next_event(events: list, at: int, end: int) -> int:
    """Where the first event after ``at`` begins, before ``end`` (``end`` if none does)."""
    for index in range(at + 1, end):
        entry = events[index]
        if type(entry) is int and entry < 0:
            return index
    return end


class PrefixEvents(NamedTuple):
    """A frame's prefix events, as the helper reads them (``frames.py``)."""

    pool_blocks: int
    layout: tuple
    """The engine's ``PrefixLayout``'s fields."""
    events: list


class MissesForTheHelper:
    """What the engine tells about its prefixes, as events for the helper, which keeps the
    history and finds each request's evicted tokens (``MissReasonsFromTheEngine``). A
    request's missed lookups are known there by its lookup serial, which its tally carries."""

    __slots__ = ("events", "_serials", "unit")

    def __init__(self, events: list) -> None:
        self.unit = 1
        """Tokens per prefix hash (``PrefixLayout.unit``), set with the engine's layout."""
        self.events = events
        """The prefix events since the last hand-over (the engine's end of the pipe takes the list)."""
        self._serials = serial_numbers(1)

    def freed(self, hashes: list) -> None:
        """A request gave back its blocks, whose units' hashes these are (perhaps vLLM's own
        list: copied now, as it grows again when a preempted request resumes)."""
        events = self.events
        events.extend((FREED, len(hashes)))
        events.extend(hashes)

    def entries_freed(self, keys: list) -> None:
        """vLLM gave back blocks holding these entries of a hybrid model's checked groups."""
        events = self.events
        events.extend((ENTRIES, len(keys)))
        events.extend(keys)

    def missed(self, tally: Tally, keys: list, present: int) -> None:
        """These looked-up units of the request missed; the helper finds which of them it
        remembers (a helper that never saw the lookup finds none: they are cold)."""
        tally[MISSED_TOKENS] += self.unit * len(keys)
        serial = tally[LOOKUP_SERIAL]
        if not serial:
            serial = tally[LOOKUP_SERIAL] = next(self._serials)
        events = self.events
        events.extend((MISSED, serial, present, len(keys)))
        events.extend(keys)


MOST_AWAITED = 1 << 18
"""Requests whose missed lookups may wait for their records (a few tens of MB at most);
beyond, the oldest lookup's go: a record that never comes (a request that left vLLM
without a release, or whose span was suppressed), or a request still running after that
many newer lookups, whose misses then stay cold."""


class MissReasonsFromTheEngine:
    """The engine's prefix events taken in order, and each request's misses until its record."""

    def __init__(self) -> None:
        self._history: FreedHistory | None = None
        self._layout = PrefixLayout(unit=1)
        self._awaited: OrderedDict[int, int] = OrderedDict()
        """Lookup serial -> the request's missed units the history found evicted."""
        self._told_lost = False

    def took(self, item: object) -> bool:
        """Takes ``item`` in if it is a frame's prefix events (True), else leaves it (False)."""
        if type(item) is not PrefixEvents:
            return False
        if self._history is None:
            self._history = FreedHistory(item.pool_blocks)
            self._layout = PrefixLayout(*item.layout)
        try:
            self._take(item.events)
        except Exception:  # noqa: BLE001 - the records must still go out
            _logger.exception("otel-kvcache: could not take in a frame's prefix events")
        return True

    def _take(self, events: list) -> None:
        history, awaited, layout = self._history, self._awaited, self._layout
        at, end = 0, len(events)
        while at < end:
            kind = events[at]
            if kind in (FREED, ENTRIES) and type(kind) is int:
                count = events[at + 1]
                hashes = events[at + 2 : at + 2 + count]
                if _all_hashes(hashes, count):
                    history.freed(hashes)
                    at += 2 + count
                    continue
            elif kind == MISSED and type(kind) is int:
                serial, present, count = events[at + 1 : at + 4]
                keys = events[at + 4 : at + 4 + count]
                if _all_hashes(keys, count):
                    if serial not in awaited and len(awaited) >= MOST_AWAITED:
                        awaited.popitem(last=False)
                    awaited[serial] = awaited.get(serial, 0) + history.evicted(keys, present, layout)
                    at += 4 + count
                    continue
            # An event's hashes never came (the engine's call failed between its two
            # halves): the reading goes on at the next event (a kind is no count, serial
            # or hash); the lookup lost stays cold.
            at = next_event(events, at, end)
            if not self._told_lost:
                self._told_lost = True
                _logger.warning("otel-kvcache: prefix events lost their order; a lookup's misses there stay cold")

    def filled_in(self, tally_bytes: bytes) -> bytes:
        """A released request's tally (``PACKED``), with the missed tokens the history
        remembered counted as evicted."""
        counts = PACKED.unpack(tally_bytes)
        remembered = self._awaited.pop(counts[LOOKUP_SERIAL], 0) if counts[LOOKUP_SERIAL] else 0
        if not remembered:
            return tally_bytes
        counts = list(counts)
        counts[EVICTED_TOKENS] += self._layout.unit * remembered
        return PACKED.pack(*counts)


def _all_hashes(entries: list, count: int) -> bool:
    """Whether ``entries`` are the ``count`` block hashes of one event (bytes, as vLLM's are)."""
    return len(entries) == count and set(map(type, entries)) <= {bytes}
