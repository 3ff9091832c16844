"""Per-engine and per-request KV accounting, driven by the wrappers in ``patch.py``.

One ``EngineTelemetry`` lives beside each vLLM ``Scheduler`` (one per
EngineCore, i.e. per data-parallel rank). Everything here runs on the engine
thread, so it is written for the scheduler's hot loop:

- nothing runs per scheduled request per step: a request is looked at when it
  is admitted, preempted or released (its tally is made at its first
  admission, or its first failed attempt), or, on a model whose blocks come and
  go while a request runs (sliding window, Mamba), when a step gives it blocks
  (its peak: ``_read_peaks``); and a step costs, after
  ``schedule()``, a clock read and a count of what the step's allocations
  popped off the free queue (``PoolTracker.note_pops``); the chores (the
  evictions those pops made, reconciliation, the hand-over of released requests)
  run when one is due;
- counters are plain integers, and the pool's counts are read as they are,
  by observable instruments on the metric reader's thread (``pool_counts``);
- a live request costs a tally, one flat list of counts (``handover.tally``),
  not an SDK span. At release its record goes to the ``record_sink``
  (``handover.record``), which builds the span, in a helper process when the SDK
  was configured from the environment.
- whether instrumentation is suppressed (``suppress_instrumentation``) is asked
  once a step, when ``schedule()`` returns, for the releases until the next one
  (the step's, and aborts before the next step): the pool's accounting never pauses.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_kvcache import config, names
from otel_kvcache.bounds import cut, trace_headers_within
from otel_kvcache.engine.attribution import Attribution
from otel_kvcache.engine.leaks import Reconciler
from otel_kvcache.engine.pool import PoolCounts, PoolTracker, pool_counts
from otel_kvcache.engine.sampling import default_sample_rate
from otel_kvcache.engine.whatif import PrefixReuse
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.handover.record import RecordSink
from otel_kvcache.handover.tally import (
    ADMITTED_BLOCKS,
    ADMITTED_HIT_TOKENS,
    ADMITTED_NS,
    ADMITTED_POOL_FREE,
    FREED,
    INPUT_TOKENS,
    LAST_STALL_STEP,
    OUTPUT_TOKENS,
    PACKED,
    PEAK,
    PERIOD_HIT_BLOCKS,
    PERIOD_HIT_TOKENS,
    PREEMPTIONS,
    RECOMPUTED_TOKENS,
    RELEASED_NS,
    RELEASED_POOL_FREE,
    RELEASED_TOKENS,
    REQUEST_ID_LENGTH,
    SESSION_ID_LENGTH,
    STALLS,
    START_NS,
    STILL_HELD,
    STRETCH_START_BLOCKS,
    STRETCH_START_NS,
    STRETCH_START_TOKENS,
    TURN_GAP_NS,
    Tally,
    blank_tally,
    close_admission_period,
    count_period_hits,
    hold,
    packed_clamped,
)
from otel_kvcache.vllm_compat.blocks import held_blocks_counter, may_hold_null_blocks
from otel_kvcache.vllm_compat.layouts import (
    attention_reach_reader,
    cached_entries_reader,
    entries_reader,
    hit_blocks_counter,
    prefix_layout,
)
from otel_kvcache.vllm_compat.readers import (
    arrival_time_reader,
    engine_index,
    finish_reasons_by_status,
    grown_requests_reader,
    kv_bytes_per_block,
    lookup_keys_reader,
    new_requests_reader,
    prefix_cache_lookup_test,
    resumed_request_ids_reader,
    scheduler_block_size,
    session_id_reader,
    statuses_waiting_for_blocks,
    trace_headers_reader,
)
from otel_kvcache.vllm_compat.schedule_frame import allocation_failed, allocation_watch, request_being_scheduled

if TYPE_CHECKING:
    from otel_kvcache.engine.connectors import ConnectorTelemetry
    from otel_kvcache.engine.offload_tier import OffloadTier


PACKING = "tally_packing"
"""What a released tally that did not fit ``PACKED`` is counted as (``InstrumentationErrors``)."""
HELD_ENTRIES = "held_prefix_entries"
"""What a failure to read the prefix entries running requests hold, at a hybrid model's
lookup, is counted as (its misses then lean cold)."""


class EngineTelemetry:
    """KV telemetry of one scheduler: live requests' tallies, the pool tracker, counters."""

    # Slotted: an instance dict of more than 30 keys is no longer shared (CPython 3.11's
    # SHARED_KEYS_MAX_SIZE), and a method load from an object with a dict of its own is never
    # specialized: each ``self.<method>()`` in the hooks would take CPython's generic lookup
    # (``docs/overhead.md#engine-state``).
    __slots__ = (
        "__weakref__",  # the instruments and the snapshot publisher hold engines weakly
        "record_sink", "errors", "block_size", "index", "attributes", "pool", "bytes_per_block",
        "requests", "extra_events", "_blank_tally", "step", "spans_enabled",
        "preemptions", "prefix_cache_queries", "prefix_cache_hits", "allocation_stalls",
        "computed_tokens", "recomputed_tokens", "last_attempt", "_watch_allocation",
        "_schedule_frame", "pending_hits", "type_managers", "held_blocks", "scheduler_requests",
        "_finish_reasons", "_waiting_for_blocks", "_lookup_enabled", "_lookup_keys", "trace_headers_of",
        "value_limit", "attribution", "_session_of", "_arrival_of", "_new_requests_of",
        "_resumed_ids_of", "reconciler", "reuse", "preempted_blocks", "preempted_demand",
        "_catch_up_due", "connectors", "misses", "layout", "_attention_reach", "_hit_blocks", "pending_hit_blocks",
        "_entries_of", "_cached_entries", "_grown_of",
    )  # fmt: skip

    def __init__(
        self,
        scheduler: Any,
        record_sink: RecordSink,
        errors: InstrumentationErrors,
    ) -> None:
        manager = scheduler.kv_cache_manager
        self.record_sink = record_sink
        """Where released requests and findings go, to become spans (``handover.record``)."""
        self.errors = errors
        self.block_size: int = scheduler_block_size(scheduler)
        self.layout = prefix_layout(scheduler)
        """Where a prefix hit can end, and the unit prefix numbers are counted in (``layouts.py``)."""
        self.index: int = engine_index(scheduler.vllm_config)
        self.attributes = {names.ENGINE_INDEX: self.index}
        self.pool = PoolTracker(manager.block_pool)
        self.bytes_per_block = kv_bytes_per_block(scheduler.kv_cache_config)
        self.requests: dict[str, Tally] = {}
        """Live requests' tallies (``tally.py``), by request id."""
        self.extra_events: dict[str, list[tuple]] = {}
        """Live requests' events other than the first admission (preempted, resumed, stuck, zombie)."""
        self._blank_tally = blank_tally(self.block_size, self.pool.limit)
        self.step = 0
        self.spans_enabled = is_instrumentation_enabled()
        """Whether released requests get spans: not while instrumentation is suppressed
        (asked once a step, in ``on_scheduled``)."""
        # Cumulative counters, exported by observable counters.
        self.preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.allocation_stalls = 0
        self.computed_tokens = 0
        self.recomputed_tokens = 0
        self.last_attempt: Any = None
        """The step's last admission attempt, the only one that can stall (set by its hook, ``patch.py``)."""
        self._watch_allocation = allocation_watch(scheduler.vllm_config)
        self._schedule_frame: Any = None
        """The running ``schedule()``'s frame, from the step's attempts until it returned."""
        self.pending_hits: dict[str, int] = {}  # prefix-hit tokens of admissions under way, by request id
        self.type_managers = tuple(
            (type_manager, may_hold_null_blocks(type_manager))
            for type_manager in manager.coordinator.single_type_managers
        )
        """Each KV cache group's manager, and whether its block lists may hold the null block."""
        self.held_blocks = held_blocks_counter(self.type_managers)
        """Blocks the KV manager holds for a request now, across all groups."""
        self.scheduler_requests: dict[str, Any] = scheduler.requests
        """vLLM's own live requests, by id: those still ours to account for."""
        self._finish_reasons = finish_reasons_by_status()
        self._waiting_for_blocks = statuses_waiting_for_blocks()
        self._lookup_enabled = prefix_cache_lookup_test(manager)
        self._lookup_keys = lookup_keys_reader()
        self.trace_headers_of = trace_headers_reader()
        self.value_limit = config.client_value_length_limit()
        """The bound on what a client chooses, request ids and trace headers (``bounds.py``)."""
        self.attribution = Attribution(scheduler, self.attributes, self.value_limit)
        """Who holds the blocks: series by model, priority, tenant; sessions' turn gaps."""
        self._session_of = session_id_reader()
        self._arrival_of = arrival_time_reader()
        self._new_requests_of = new_requests_reader()
        self._resumed_ids_of = resumed_request_ids_reader()
        self._grown_of = grown_requests_reader() if any(with_null for _, with_null in self.type_managers) else None
        """On a layout whose blocks come and go while a request runs (sliding window, Mamba):
        the requests a step gave new blocks, whose peak is read then."""
        self.reconciler = Reconciler(self, scheduler)
        rate = config.whatif_sample_rate()
        rate = default_sample_rate(self.pool.limit) if rate is None else rate
        self.reuse = PrefixReuse(self.pool.limit, rate, self.layout)
        """The what-if curve and the miss reasons' counters, fed by the lookups and the frees here."""
        self.misses = record_sink.miss_reasons(self.pool.limit, self.layout)
        """Each request's miss reasons, found where its span is built (``whatif.py``)."""
        self._attention_reach = attention_reach_reader() if self.layout.hybrid else None
        self._hit_blocks = hit_blocks_counter(manager.coordinator.single_type_managers)
        """Blocks a prefix hit gave a request, on a model of several groups (None on one)."""
        self.pending_hit_blocks: dict[str, int] = {}
        self._cached_entries = cached_entries_reader(
            manager.block_pool, manager.coordinator.single_type_managers, self.layout
        )
        self._entries_of = entries_reader(manager.block_pool, self.layout)
        if self._entries_of is not None:  # a hybrid model: where its hits can end reaches the free queue
            self.pool.on_cached_freed = self._entries_freed
        self.preempted_blocks: dict[str, int] = {}
        """Blocks each preempted request gave back, until it runs again: demand the pool lacked."""
        self.preempted_demand = 0
        self._catch_up_due = 0.0
        self.connectors: ConnectorTelemetry | None = None
        """The KV connector's accounting, for an engine that has one (set by ``patch.py``)."""

    # --- helpers ------------------------------------------------------------

    def event(self, request_id: str, name: str, blocks: int, detail: Any) -> None:
        """An event on the request's span to come, other than its first admission and its
        release (which its tally holds), as ``FinishedRequest.events`` holds it."""
        free = self.pool.queue.num_free_blocks  # BlockPool.get_num_free_blocks(), without the call
        event = (name, time.time_ns(), blocks, detail, free, self.pool.limit - free)
        self.extra_events.setdefault(request_id, []).append(event)  # rare: preemptions, findings

    def reported_id(self, request_id: str) -> str:
        """A request id as our records carry it: a client may choose it (``bounds.py``)."""
        return cut(request_id, self.value_limit)

    # --- request lifecycle ----------------------------------------------------

    def _tally_of(self, request: Any) -> Tally:
        """The request's tally, made at its first admission or failed attempt (a
        streaming-input session's later chunks keep it)."""
        tally = self.requests.get(request.request_id)
        if tally is None:
            tally = self.requests[request.request_id] = self._new_tally(request)
        return tally

    def _new_tally(self, request: Any) -> Tally:
        tally = self._blank_tally[:]
        tally[START_NS] = int(self._arrival_of(request) * 1e9)
        return tally

    def forget_departed(self) -> None:
        """Drops what we hold for requests that left the scheduler without a release
        (a path a future vLLM may add), so that our state stays bounded."""
        live = self.scheduler_requests
        for request_id in [rid for rid in self.requests if rid not in live]:
            del self.requests[request_id]
            self.extra_events.pop(request_id, None)
        for request_id in [rid for rid in self.pending_hits if rid not in live]:
            del self.pending_hits[request_id]
        for request_id in [rid for rid in self.pending_hit_blocks if rid not in live]:
            del self.pending_hit_blocks[request_id]
        for request_id in [rid for rid in self.preempted_blocks if rid not in live]:
            self.preempted_demand -= self.preempted_blocks.pop(request_id)
        if self.connectors is not None:
            self.connectors.forget_departed(live)

    def on_admission_attempt(self, request: Any, *_later: Any, **_named: Any) -> None:
        """After ``_get_local_prefix_cache_hit``: the step's latest admission attempt (its
        later parameters vary between vLLM releases, and none is ours)."""
        self.last_attempt = request
        if self._watch_allocation is not None:
            self._schedule_frame = self._watch_allocation()

    def on_prefix_cache_lookup(self, request: Any, num_hits: int) -> None:
        """After ``record_prefix_cache_stats``: an admission's local prefix-hit tokens
        (vLLM's arguments, as it passes them), once its blocks are allocated."""
        request_id = request.request_id
        self.pending_hits[request_id] = num_hits  # taken once the step's admissions are known
        if self._hit_blocks is not None:
            self.pending_hit_blocks[request_id] = self._hit_blocks(request_id, num_hits)
        tier = self.offload_tier
        tier_tokens = tier.admitted_tokens.pop(request_id, 0) if tier is not None else 0
        if self._lookup_enabled(request):  # vLLM's own test for counting the lookup
            queried, unit = request.num_tokens, self.layout.unit
            self.prefix_cache_queries += queried
            self.prefix_cache_hits += num_hits
            used = self.pool.limit - self.pool.queue.num_free_blocks
            keys = self._lookup_keys(request, unit)
            hit_blocks = num_hits // unit
            # Missed units whose attention blocks are in the cache (a hybrid model's), and the
            # other groups' entries there that running requests hold.
            present = 0 if self._attention_reach is None else max(self._attention_reach(request) // unit - hit_blocks, 0)
            if present and self._cached_entries is not None:
                try:
                    held = self._cached_entries(request_id, keys[hit_blocks : hit_blocks + present])
                    self._entries_cached(held, self.reuse.on_entries_held)
                except Exception as exc:  # noqa: BLE001 - ours: the lookup's own events still go
                    self.errors.count(HELD_ENTRIES, exc)
            try:  # each whatever the other does (a try costs nothing until it catches)
                self.reuse.on_lookup(keys, hit_blocks, unit, queried, used, time.monotonic(), present, tier_tokens)
            finally:
                if hit_blocks < len(keys):
                    self.misses.missed(self._tally_of(request), keys[hit_blocks:], present)

    def on_scheduled(self, output: Any) -> None:
        """After ``schedule()``, once a step: the step's admissions, the attempt that
        found no blocks (vLLM stops admitting there: only the last one can have),
        what its allocations popped off the free queue; chores when due."""
        for new_request in self._new_requests_of(output):
            self._admitted(new_request.req_id)
        for request_id in self._resumed_ids_of(output):
            self._admitted(request_id)
        attempt = self.last_attempt
        if attempt is not None:
            self.last_attempt = None
            schedule_frame, self._schedule_frame = self._schedule_frame, None  # its locals go with it
            # Not admitted (it would be running now), and not skipped or held back by vLLM.
            if attempt.status in self._waiting_for_blocks and allocation_failed(schedule_frame):
                self.on_stall(attempt)
        if self.connectors is not None:
            self.connectors.after_schedule()
        self.step += 1
        self.spans_enabled = is_instrumentation_enabled()
        now = time.monotonic()
        self.pool.note_pops(now)
        self.reuse.on_demand(self.pool.limit - self.pool.queue.num_free_blocks, self.preempted_demand, now)
        if now >= self._catch_up_due:
            self._catch_up(now)
        self.attribution.catch_up_if_behind()
        try:  # last, each whatever the other does: a failure there costs the curve, or the peaks
            self.reuse.catch_up_if_behind()
        finally:
            if self._grown_of is not None:
                self._read_peaks(output)

    def _admitted(self, request_id: str) -> None:
        """An admission opens a period; its prefix hits count when the period closes
        (``tally.close_admission_period``: at a preemption, or where the record is read back)."""
        request = self.scheduler_requests[request_id]
        tally = self._tally_of(request)
        hit_tokens = self.pending_hits.pop(request_id, 0)  # 0: admitted without a prefix-cache lookup
        if self._hit_blocks is None:  # one full-attention group: the blocks the hit's tokens fill
            hit_blocks = -(-hit_tokens // self.block_size)
        else:
            hit_blocks = self.pending_hit_blocks.pop(request_id, 0)
        held = self.held_blocks(request_id)
        if tally[ADMITTED_NS] or tally[PREEMPTIONS]:  # resumed, or a streaming session's next chunk
            if self.preempted_blocks:
                self.preempted_demand -= self.preempted_blocks.pop(request_id, 0)
            hold(tally, time.time_ns(), request.num_computed_tokens, held)
            count_period_hits(tally)
            if held > tally[PEAK]:
                tally[PEAK] = held
            event = names.EVENT_RESUMED if tally[PREEMPTIONS] else names.EVENT_ADMITTED
            self.event(request_id, event, held, hit_tokens)
        else:  # the first admission's blocks count towards the peak where the record is read back
            tally[ADMITTED_NS] = tally[STRETCH_START_NS] = time.time_ns()
            tally[ADMITTED_BLOCKS] = tally[STRETCH_START_BLOCKS] = held
            tally[STRETCH_START_TOKENS] = request.num_computed_tokens  # this step's included
            tally[ADMITTED_HIT_TOKENS] = hit_tokens
            tally[ADMITTED_POOL_FREE] = self.pool.queue.num_free_blocks
        tally[PERIOD_HIT_TOKENS] = hit_tokens
        tally[PERIOD_HIT_BLOCKS] = hit_blocks

    def _read_peaks(self, output: Any) -> None:
        """The blocks held by each running request the step gave new blocks: a sliding-window
        or Mamba group frees blocks while a request runs (a Mamba group holds two state
        blocks for the step in which it crosses a block boundary), so the most it holds
        comes right after an allocation, not when it is preempted or ends."""
        requests = self.requests
        for request_id in self._grown_of(output):
            tally = requests.get(request_id)
            if tally is not None:
                held = self.held_blocks(request_id)
                if held > tally[PEAK]:
                    tally[PEAK] = held

    def on_stall(self, request: Any) -> None:
        """The scheduler tried to give this request blocks in this step and found none."""
        tally = self._tally_of(request)
        if tally[LAST_STALL_STEP] == self.step:
            return
        tally[LAST_STALL_STEP] = self.step
        tally[STALLS] += 1
        self.allocation_stalls += 1

    def before_preempt(self, request: Any) -> tuple[int, int, str | None]:
        """Before ``_preempt_request``: a preemption inside ``schedule()`` makes room
        for a request whose allocation failed, a stall of that request."""
        stalled = request_being_scheduled()
        if stalled is not None:
            self.on_stall(stalled)
        # None when vLLM preempted the very request it was scheduling (the lowest in priority).
        preempted_for = stalled.request_id if stalled is not None and stalled is not request else None
        return self.held_blocks(request.request_id), request.num_computed_tokens, preempted_for

    def on_preempted(self, request: Any, before: tuple[int, int, str | None]) -> None:
        released, computed, preempted_for = before
        self.preempted_blocks[request.request_id] = released
        self.preempted_demand += released
        self.preemptions += 1
        self.recomputed_tokens += computed
        tally = self.requests.get(request.request_id)
        if tally is None:
            return
        tally[PREEMPTIONS] += 1
        tally[RECOMPUTED_TOKENS] += computed
        close_admission_period(tally, released)
        hold(tally, time.time_ns(), computed, 0)
        detail = (computed, preempted_for, None)
        if preempted_for is not None and (reported := self.reported_id(preempted_for)) is not preempted_for:
            detail = (computed, reported, len(preempted_for))
        self.event(request.request_id, names.EVENT_PREEMPTED, released, detail)
        # The prefix's frees last: a failure there costs them, not the span's event.
        self._prefix_freed(request.block_hashes, computed // self.layout.unit)

    def before_release(self, request: Any) -> int:
        return self.held_blocks(request.request_id)

    def on_released(self, request: Any, freed: int) -> None:
        request_id = request.request_id
        tally = self.requests.pop(request_id, None)
        if self.preempted_blocks:  # released while preempted (aborted)
            self.preempted_demand -= self.preempted_blocks.pop(request_id, 0)
        if tally is None:  # never admitted nor stalled: aborted while waiting
            tally = self._new_tally(request)
        # The last admission period is closed where the record is read back (record.finished_request).
        tally[FREED] = freed
        tally[RELEASED_NS] = released_ns = time.time_ns()
        # Its last stretch of held blocks is closed off the engine thread (tally.released_occupancy).
        tally[RELEASED_TOKENS] = computed = request.num_computed_tokens
        tally[RELEASED_POOL_FREE] = self.pool.queue.num_free_blocks
        # Still attributed to the request after vLLM's free path: a leak, seen at once.
        tally[STILL_HELD] = self.held_blocks(request_id)
        tally[INPUT_TOKENS] = request.num_prompt_tokens
        tally[OUTPUT_TOKENS] = request.num_output_tokens
        self.computed_tokens += computed + tally[RECOMPUTED_TOKENS]
        events = self.extra_events.pop(request_id, None) if self.extra_events else None
        if self.pending_hits:  # looked up, then aborted while its remote KV was loading
            self.pending_hits.pop(request_id, None)
            if self.pending_hit_blocks:
                self.pending_hit_blocks.pop(request_id, None)
        connector = self.connectors.on_released(request_id) if self.connectors is not None else None
        session_id = self._session_of(request)
        if session_id is not None:
            tally[TURN_GAP_NS] = self.attribution.sessions.turn_gap_ns(session_id, tally[START_NS], released_ns)
            reported_session = cut(session_id, self.value_limit)
            if reported_session is not session_id:
                tally[SESSION_ID_LENGTH] = len(session_id)
            session_id = reported_session
        reported_id = self.reported_id(request_id)
        if reported_id is not request_id:  # a client's, as vLLM adopted it (bounds.py)
            tally[REQUEST_ID_LENGTH] = len(request_id)
        # The tally's last state, as bytes: the list is an object the garbage collector
        # tracks, and the series' count holds the request until the next collection.
        try:
            counts = PACKED.pack(*tally)
        except struct.error as exc:  # a count past 64 bits, or not an int: counted, the record kept
            self.errors.count(PACKING, exc)
            counts = packed_clamped(tally)
        trace_headers = self.trace_headers_of(request)
        model, priority = self.attribution.request_ended(request, counts, trace_headers)
        if self.spans_enabled:
            # record.RequestEnded's fields, in its order, as a plain tuple: building the
            # named tuple would cost the engine thread a Python call per release
            # (handover/record.py).
            self.record_sink.request_ended(
                (
                    reported_id,
                    trace_headers_within(trace_headers, self.value_limit),
                    self._finish_reasons[request.status],
                    counts,
                    events,
                    self.index,
                    connector,
                    model,
                    priority,
                    session_id,
                )
            )
        if not self.scheduler_requests:
            # An idle engine takes no steps (an abort can free blocks then): look now.
            self.pool.catch_up()
            self.reconciler.run()
            self.record_sink.went_idle()
        # The prefix's frees last: a failure there costs them, not the span nor the idle pass.
        if freed:  # the blocks vLLM cached (full, computed), as it frees them: deepest first
            self._prefix_freed(request.block_hashes, computed // self.layout.unit)

    def _prefix_freed(self, hashes: list, count: int) -> None:
        """A request's cached blocks freed, whose units' hashes are the first ``count`` of
        these (vLLM's own list, read now and not kept): to the curve and to where the miss
        reasons are found, each whatever the other does."""
        layout = self.layout
        if count < len(hashes):
            hashes = hashes[:count]
        try:
            self.reuse.on_freed(hashes if layout.stride == 1 else hashes[layout.stride - 1 :: layout.stride])
        finally:
            if not layout.checked:  # a hybrid model's hits end where its entries say (_entries_freed)
                self.misses.freed(hashes)

    def _entries_freed(self, blocks: list) -> None:
        """Before vLLM appends these blocks to its free queue, with their prefixes (a hybrid
        model's): the entries of the checked groups among them."""
        self._entries_cached(self._entries_of(blocks), self.reuse.on_entries_freed)

    def _entries_cached(self, entries: list, to_the_curve: Callable[[list], None]) -> None:
        """Entries of a hybrid model's checked groups in vLLM's cache: given back to its free
        queue (``_entries_freed``), or found by a lookup, held by running requests. To the
        curve, as ``to_the_curve`` tells it, and to where the miss reasons are found, which
        knows them alike."""
        if entries:
            try:
                to_the_curve(entries)
            finally:
                self.misses.entries_freed(entries)

    # --- catching up and readings ----------------------------------------------------

    def _catch_up(self, now: float) -> None:
        self.pool.catch_up_if_due(now)
        self.reconciler.maybe_run(now)
        self.record_sink.flush_if_due(now)
        self._catch_up_due = min(self.pool.due, self.reconciler.due, self.record_sink.due)

    def on_prefix_cache_reset(self, succeeded: bool) -> None:
        """After ``reset_prefix_cache``: if it succeeded, no block holds a prefix."""
        if succeeded:
            self.pool.on_reset()
            self.reuse.on_reset()

    @property
    def offload_tier(self) -> OffloadTier | None:
        """The connector's offload tier, where the engine has one we can read (``offload_tier.py``)."""
        return self.connectors.tier if self.connectors is not None else None

    @property
    def pool_counts(self) -> PoolCounts:
        """The pool now (read on the metric reader's thread, see ``PoolTracker.counts``)."""
        return pool_counts(*self.pool.counts(), self.pool.limit)
