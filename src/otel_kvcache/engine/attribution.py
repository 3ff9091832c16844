"""Who holds the KV cache: blocks and block-seconds by model or adapter, priority and
tenant, and whether a session finds its context again at its next turn.

One ``Attribution`` lives beside each engine's telemetry, used by three threads:

- the engine thread, once per request at its release: its tally's bytes, model, priority
  and trace headers join a list (``request_ended``), and a request of a session gets its turn
  gap from the session table. Nothing per step.
- the metric reader's thread, at each collection: the released requests' block-seconds
  (``tally.released_occupancy``) join their series' count (``catch_up``); the fair share of the blocks held
  now, read from vLLM's block lists and reference counts (a block k requests share
  counts 1/k to each, so the series sum to the used blocks), and the live requests'
  block-seconds so far, so that a rate over a long request is right. That walks every
  held block once a collection, off the step path.
- the live snapshot's thread (``live_snapshot.py``), at most once a second: the same
  fair share by key, without the series limit, for ``otel-kvcache top``.

**Series.** A request's series is the values of the attributes ``OTEL_KVCACHE_ATTRIBUTION``
names (``gen_ai.request.model`` by default). At most ``OTEL_KVCACHE_ATTRIBUTION_LIMIT``
series exist per engine; the first ones seen keep theirs (a counter cannot give its
series away without a reset), live ones at a collection admitted largest first, and the
rest fold into one series marked ``otel.metric.overflow=true``, as the metrics SDK
marks its own. A session id is never a series attribute.

**Sessions.** The table maps a hash of each session id to its last release here, the
least recently seen dropped first: about 110 bytes a session (tracemalloc), 7.3 MB at the
default 65536 sessions.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from otel_kvcache import config, names
from otel_kvcache.handover.tally import PACKED, Tally, occupancy_until, released_occupancy
from otel_kvcache.trace_context import baggage_entries
from otel_kvcache.vllm_compat.blocks import blocks_by_request, reference_counts
from otel_kvcache.vllm_compat.readers import model_name_reader, priority_reader, served_model_name, trace_headers_reader

OVERFLOW = object()
"""The overflow series' key: no key of values can equal it."""

Key = tuple
"""The values of the attribution attributes, in ``config.attribution()``'s order (None: absent)."""
MOST_ENDED = 1 << 16
"""Released requests waiting to join their series' count before the engine thread folds
them in itself, where nothing collects for long: their tallies' bytes, about 300 each."""
_ENDED_FIELDS = 4  # a released request's tally, model, priority and trace headers (``request_ended``)


def fair_share(blocks: Any, may_hold_null: bool = True) -> float:
    """A request's blocks, each counted 1 / its reference count (``ref_cnt``: how many
    block lists hold it), vLLM's null block left out. Most blocks have one holder: they
    are counted in one C call (``list.count``), the shared ones one by one: run over every
    held block at each collection, it costs less than a division per block even with a
    fifth of them shared (``docs/overhead.md#attribution``)."""
    references = reference_counts(blocks, may_hold_null)
    alone = references.count(1)
    if alone == len(references):
        return float(alone)
    return alone + sum(1 / count for count in references if count > 1)


class SessionTable:
    """Each session's last release on this engine, least recently seen dropped first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._released_ns: dict[int, int] = {}  # insertion order: least recently seen first

    def turn_gap_ns(self, session_id: str, arrival_ns: int, released_ns: int) -> int:
        """The gap from the session's previous release here to this request's arrival, or
        -1 (a session first seen, or a turn that arrived before the previous one ended);
        this release is the session's latest from now on."""
        key = hash(session_id)
        previous = self._released_ns.pop(key, None)
        self._released_ns[key] = released_ns
        if len(self._released_ns) > self.size:
            del self._released_ns[next(iter(self._released_ns))]
        if previous is None or previous > arrival_ns:
            return -1
        return arrival_ns - previous


_HELD_SINCE_FORK: weakref.WeakSet[Attribution] = weakref.WeakSet()


def _unlock_in_a_forked_child() -> None:
    """A fork copies the locks of a collection under way, not the thread collecting: the
    child's collections would wait on them for ever, and export nothing. Each starts unlocked."""
    for attribution in list(_HELD_SINCE_FORK):
        attribution._admission = threading.Lock()
        attribution._folding = threading.Lock()


os.register_at_fork(after_in_child=_unlock_in_a_forked_child)


class Attribution:
    """Series of one engine's requests, and their block-seconds and blocks held."""

    def __init__(self, scheduler: Any, engine_attributes: Mapping[str, Any], value_limit: int) -> None:
        self.attribute_names = tuple(config.attribution())
        self.limit = config.attribution_limit()
        self.value_limit = value_limit
        self.served_model = served_model_name(scheduler.vllm_config)
        self.model_of = model_name_reader(self.served_model)
        self.priority_of = priority_reader()
        self._trace_headers_of = trace_headers_reader()
        self.baggage_keys = tuple(config.baggage_keys())
        """Every baggage key carried to the engine (the span's; ``top`` shows them too)."""
        self._series_baggage_keys = tuple(n for n in self.attribute_names if n not in names.ATTRIBUTION_CHOICES)
        self._model_only = self.attribute_names == (names.MODEL,)
        self.sessions = SessionTable(config.session_table_size())
        self._engine_attributes = dict(engine_attributes)
        self._series: dict[Key, dict[str, Any]] = {}
        """Each admitted series' metric attributes, by key."""
        self._admission = threading.Lock()
        self.overflow_attributes = {**self._engine_attributes, names.METRIC_OVERFLOW: True}
        self.finished_block_ns: dict[Key, int] = {}
        """Block-nanoseconds of finished requests, by series (``OVERFLOW`` included)."""
        self._ended: list = []
        """Released requests not yet in ``finished_block_ns``, their fields one after
        another (``request_ended``): no object per request for the garbage collector."""
        self._folding = threading.Lock()
        _HELD_SINCE_FORK.add(self)
        self._reported_seconds: dict[Key, float] = {}
        self._live_keys: dict[str, Key] = {}
        """Live requests' keys, by request id, as the last collections found them."""
        self._unknown = tuple(None for _ in self.attribute_names)
        """The key of blocks whose request vLLM no longer knows (see ``vllm.kv_cache.orphaned_blocks``)."""

    # --- keys and series ----------------------------------------------------------

    def key_of(self, request: Any) -> Key:
        return self._key(self._trace_headers_of(request), self.model_of(request), self.priority_of(request))

    def key_of_live(self, request: Any | None) -> Key:
        """A request's key; where vLLM no longer knows the request (None), the unknown one."""
        return self._unknown if request is None else self.key_of(request)

    def _key(self, trace_headers: Any, model: str, priority: int) -> Key:
        if self._model_only:
            return (model,)
        baggage = (
            baggage_entries(trace_headers, self._series_baggage_keys, self.value_limit)
            if self._series_baggage_keys
            else {}
        )
        known = {names.MODEL: model, names.PRIORITY: priority}
        return tuple(known[name] if name in known else baggage.get(name) for name in self.attribute_names)

    def series_of(self, key: Key) -> Key:
        """The series a key counts in: its own, while there is room, else the overflow."""
        if key in self._series:
            return key
        with self._admission:  # both threads admit
            if key not in self._series:
                if len(self._series) >= self.limit:
                    return OVERFLOW
                attributes = dict(self._engine_attributes)
                attributes.update((n, v) for n, v in zip(self.attribute_names, key) if v is not None)
                self._series[key] = attributes
        return key

    def attributes_of(self, series: Key) -> dict[str, Any]:
        return self.overflow_attributes if series is OVERFLOW else self._series[series]

    # --- the engine thread ----------------------------------------------------------

    def request_ended(self, request: Any, tally: bytes, trace_headers: Any) -> tuple[str, int]:
        """A released request, with its tally's bytes and its trace headers (as vLLM keeps
        them: read once, by the caller): its block-seconds join its series at the next
        collection (``catch_up``). Returns its model and priority (read once: its span
        carries them)."""
        model, priority = self.model_of(request), self.priority_of(request)
        self._ended.extend((tally, model, priority, trace_headers))  # one C call
        return model, priority

    def catch_up_if_behind(self) -> None:
        """Once a step, on the engine thread: where nothing has collected for long (more
        than ``MOST_ENDED`` released requests wait), folds them in, unless a collection is."""
        if len(self._ended) > MOST_ENDED * _ENDED_FIELDS:
            self.catch_up(wait=False)

    def catch_up(self, wait: bool = True) -> None:
        """Released requests' block-seconds join their series' counts (at a collection; on
        the engine thread only where too many wait, never waiting for a collection). A
        request that fails is dropped with those before it (the error reaches the caller)."""
        if not self._folding.acquire(blocking=wait):
            return
        try:
            ended, at = self._ended, 0
            end = len(ended)  # whole requests: each came in one call
            finished = self.finished_block_ns
            try:
                while at < end:
                    tally, model, priority, trace_headers = ended[at : at + _ENDED_FIELDS]
                    at += _ENDED_FIELDS
                    series = self.series_of(self._key(trace_headers, model, priority))
                    block_ns = released_occupancy(PACKED.unpack(tally))
                    finished[series] = finished.get(series, 0) + block_ns
            finally:
                del ended[:at]
        finally:
            self._folding.release()

    # --- the metric reader's thread ---------------------------------------------------

    def _live_key(self, request_id: str, requests: Mapping[str, Any]) -> Key:
        key = self._live_keys.get(request_id)
        if key is None:
            request = requests.get(request_id)
            key = self._unknown if request is None else self.key_of(request)
            self._live_keys[request_id] = key
        return key

    def _by_series(self, by_key: dict[Key, float]) -> dict[Key, float]:
        """Values by key, summed by series; keys without one yet admitted largest first."""
        by_series: dict[Key, float] = {}
        for key, value in sorted(by_key.items(), key=lambda item: -item[1]):
            series = self.series_of(key)
            by_series[series] = by_series.get(series, 0.0) + value
        return by_series

    def _held_by_key(
        self, type_managers: Iterable[tuple[Any, bool]], requests: Mapping[str, Any]
    ) -> tuple[dict[Key, float], dict[str, Key]]:
        """Blocks held now, by key: each request's blocks, each counted 1 / its reference
        count (vLLM's ``ref_cnt``: how many block lists hold it); and the keys by request id."""
        by_key: dict[Key, float] = {}
        seen: dict[str, Key] = {}
        for manager, may_hold_null in type_managers:
            for request_id, blocks in list(blocks_by_request(manager).items()):
                if not blocks:
                    continue
                share = fair_share(list(blocks), may_hold_null)
                key = seen[request_id] = self._live_key(request_id, requests)
                by_key[key] = by_key.get(key, 0.0) + share
        return by_key, seen

    def held_blocks(self, type_managers: Iterable[tuple[Any, bool]], requests: Mapping[str, Any]) -> list[tuple[dict, float]]:
        """Blocks held now, by series."""
        by_key, seen = self._held_by_key(type_managers, requests)
        self._live_keys = seen  # requests that hold no block are looked up again when they do
        return [(self.attributes_of(series), value) for series, value in self._by_series(by_key).items()]

    def holders_now(self, type_managers: Iterable[tuple[Any, bool]], requests: Mapping[str, Any]) -> list[tuple[dict, float]]:
        """Blocks held now by every key apart, largest first, as attribution attributes
        (no engine's, no series limit: ``otel-kvcache top`` shows the largest)."""
        by_key, _ = self._held_by_key(type_managers, requests)
        return [
            (self.named(key), blocks) for key, blocks in sorted(by_key.items(), key=lambda item: -item[1])
        ]

    def named(self, key: Key) -> dict[str, Any]:
        """A key's attribution attributes by name, those without a value left out."""
        return {name: value for name, value in zip(self.attribute_names, key) if value is not None}

    def occupancy_seconds(self, tallies: Mapping[str, Tally], requests: Mapping[str, Any]) -> list[tuple[dict, float]]:
        """Block-seconds by series: finished requests', and live ones' up to now."""
        self.catch_up()
        by_series = {series: block_ns / 1e9 for series, block_ns in list(self.finished_block_ns.items())}
        now_ns = time.time_ns()
        live: dict[Key, float] = {}
        for request_id, tally in list(tallies.items()):
            request = requests.get(request_id)
            if request is None:
                continue
            block_ns = occupancy_until(tally, now_ns, request.num_computed_tokens)
            if block_ns:
                key = self._live_key(request_id, requests)
                live[key] = live.get(key, 0.0) + block_ns / 1e9
        for series, seconds in self._by_series(live).items():
            by_series[series] = by_series.get(series, 0.0) + seconds
        observed = []
        for series, seconds in by_series.items():
            # A request ending during the collection is in neither reading: never go back.
            seconds = max(seconds, self._reported_seconds.get(series, 0.0))
            self._reported_seconds[series] = seconds
            observed.append((self.attributes_of(series), seconds))
        return observed
