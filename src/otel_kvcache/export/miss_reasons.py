"""Each request's miss reasons, found in the helper process from what its engine hands over.

Whether a missed block was ``evicted`` or ``cold`` follows from the blocks freed
before the lookup (``whatif.py``). Keeping that history on the engine thread
meant hashing each freed block's hash and adding it to a set, the dearest thing
the engine did per request. So the engine hands the helper, ahead of each
frame's records, each free's hashes and each missed lookup's keys, in the order
vLLM made them (``exporter_process._HandedOverMisses``), and the history is kept
here, the same one the engine's process keeps for its counters (off its engine
thread, with the what-if curve). The engine counts a request's missed tokens as
cold; how many of its missed blocks the history remembers waits here by its lookup
serial until its record comes, whose tokens they move from cold to evicted.

What this history does not see: the events of frames lost on the way (with their
records, counted; or alone, where the engine drops prefix events first to keep
records flowing to a slow helper: ``ExporterProcess``), and those handed to a
helper that died: one started in its place remembers nothing. A lookup the history
never saw leaves its misses cold, so misses lean cold there, and still add up, with
the uncacheable tokens, to vLLM's.

Memory: the history holds the hashes (about 100 bytes each, unmarshalled copies),
between 2 and 4 pool-fulls of distinct blocks: about 40 MB for a pool of 100,000
blocks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from otel_kvcache.engine.tally import COLD_TOKENS, EVICTED_TOKENS, LOOKUP_SERIAL, PACKED
from otel_kvcache.engine.whatif import FreedHistory
from otel_kvcache.export.exporter_process import ENTRIES, FREED, MISSED, PrefixEvents
from otel_kvcache.export.spans import RequestEnded
from otel_kvcache.vllm_compat.layouts import PrefixLayout

_logger = logging.getLogger(__name__)

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

    def took(self, item: RequestEnded | PrefixEvents | object) -> bool:
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
            # or hash); the lookup lost stays cold, as the engine counted it.
            at = _next_event(events, at)
            if not self._told_lost:
                self._told_lost = True
                _logger.warning("otel-kvcache: prefix events lost their order; a lookup's misses there stay cold")

    def filled_in(self, record: RequestEnded) -> RequestEnded:
        """The record, with the missed tokens the history remembered moved from cold to
        evicted in its tally."""
        counts = PACKED.unpack(record.tally)
        remembered = self._awaited.pop(counts[LOOKUP_SERIAL], 0) if counts[LOOKUP_SERIAL] else 0
        if not remembered:
            return record
        counts = list(counts)
        counts[EVICTED_TOKENS] += self._layout.unit * remembered
        counts[COLD_TOKENS] -= self._layout.unit * remembered
        return record._replace(tally=PACKED.pack(*counts))


def _next_event(events: list, at: int) -> int:
    """Where the first event after ``at`` begins (the end if none does)."""
    for index in range(at + 1, len(events)):
        entry = events[index]
        if type(entry) is int and entry in (FREED, MISSED, ENTRIES):
            return index
    return len(events)


def _all_hashes(entries: list, count: int) -> bool:
    """Whether ``entries`` are the ``count`` block hashes of one event (bytes, as vLLM's are)."""
    return len(entries) == count and set(map(type, entries)) <= {bytes}
