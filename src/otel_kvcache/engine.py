"""Per-engine and per-request KV accounting, driven by the wrappers in ``patch.py``.

One ``EngineTelemetry`` lives beside each vLLM ``Scheduler`` (one per
EngineCore, i.e. per data-parallel rank). Everything here runs on the engine
thread; the only thing other threads read is ``snapshot``, which is replaced
whole once per step.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagate import extract
from opentelemetry.trace import SpanKind, Tracer

from otel_kvcache import names
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.instruments import KVCacheInstruments
from otel_kvcache.pool import PoolTracker
from otel_kvcache.vllm_compat import engine_index, finish_reason

# Requests that leave the scheduler without passing a release hook (a path a
# future vLLM adds, say) are swept this often, so our state stays bounded.
SWEEP_EVERY_STEPS = 512


class RequestRecord:
    """What one live request did to the pool so far."""

    __slots__ = (
        "span",
        "held",
        "peak",
        "allocated",
        "prefix_hit_blocks",
        "cache_read_tokens",
        "preemptions",
        "recomputed_tokens",
        "stalls",
        "last_stall_step",
    )

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.held = 0
        self.peak = 0
        self.allocated = 0
        self.prefix_hit_blocks = 0
        self.cache_read_tokens = 0
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.stalls = 0
        self.last_stall_step = -1


def count_blocks(kv_cache_blocks: Any) -> int:
    """Real blocks in a ``KVCacheBlocks`` (all groups), null placeholders skipped."""
    return sum(1 for group in kv_cache_blocks.blocks for block in group if not block.is_null)


class EngineTelemetry:
    """KV telemetry of one scheduler: live request records and the pool tracker."""

    def __init__(
        self,
        scheduler: Any,
        tracer: Tracer,
        instruments: KVCacheInstruments,
        errors: InstrumentationErrors,
    ) -> None:
        manager = scheduler.kv_cache_manager
        self.tracer = tracer
        self.instruments = instruments
        self.errors = errors
        self.block_size: int = scheduler.block_size
        self.attributes = {names.ENGINE_INDEX: engine_index(scheduler.vllm_config)}
        self.pool = PoolTracker(manager.block_pool)
        self.requests: dict[str, RequestRecord] = {}
        self.step = 0
        self.snapshot = self.pool.snapshot()
        self._type_managers = tuple(manager.coordinator.single_type_managers)
        self._scheduler_requests: dict[str, Any] = scheduler.requests
        instruments.engines.add(self)

    # --- helpers ------------------------------------------------------------

    def held_blocks(self, request_id: str) -> int:
        """Blocks the KV manager holds for a request now, across all groups."""
        held = 0
        for manager in self._type_managers:
            blocks = manager.req_to_blocks.get(request_id)
            if blocks:
                held += sum(1 for block in blocks if not block.is_null)
        return held

    def _pool_attributes(self) -> dict[str, int]:
        free = self.pool.pool.get_num_free_blocks()
        return {names.POOL_FREE_BLOCKS: free, names.POOL_USED_BLOCKS: self.pool.limit - free}

    # --- request lifecycle ----------------------------------------------------

    def on_request_added(self, request: Any) -> None:
        if request.request_id in self.requests:
            return  # a streaming-input session adding its next chunk
        headers = request.trace_headers
        parent = extract(headers, context=Context()) if headers else Context()
        span = self.tracer.start_span(
            names.KV_REQUEST_SPAN,
            context=parent,
            kind=SpanKind.INTERNAL,
            start_time=int(request.arrival_time * 1e9),
            attributes={
                names.REQUEST_ID: request.request_id,
                names.INPUT_TOKENS: request.num_prompt_tokens,
                names.BLOCK_SIZE: self.block_size,
            },
        )
        self.requests[request.request_id] = RequestRecord(span)

    def on_allocated(
        self, request: Any, new_blocks: Any, hit_blocks: Any, hit_tokens: int, admission: bool
    ) -> None:
        """After a successful ``allocate_slots``: at admission, or when a running request grew."""
        record = self.requests.get(request.request_id)
        if record is None:
            return
        record.allocated += count_blocks(new_blocks)
        record.held = self.held_blocks(request.request_id)
        if record.held > record.peak:
            record.peak = record.held
        if not admission:
            return
        if hit_blocks is not None:
            record.prefix_hit_blocks += count_blocks(hit_blocks)
        event = names.EVENT_RESUMED if record.preemptions else names.EVENT_ADMITTED
        record.span.add_event(
            event,
            {names.BLOCKS: record.held, names.EVENT_PREFIX_HIT_TOKENS: hit_tokens, **self._pool_attributes()},
        )

    def on_stall(self, request: Any) -> None:
        record = self.requests.get(request.request_id)
        if record is None or record.last_stall_step == self.step:
            return
        record.last_stall_step = self.step
        record.stalls += 1
        self.instruments.allocation_stalls.add(1, self.attributes)

    def on_prefix_cache_lookup(self, request: Any, num_hits: int, counted: bool) -> None:
        record = self.requests.get(request.request_id)
        if record is not None:
            record.cache_read_tokens += num_hits
        if counted:
            self.instruments.prefix_cache_queries.add(request.num_tokens, self.attributes)
            self.instruments.prefix_cache_hits.add(num_hits, self.attributes)

    def before_preempt(self, request: Any) -> tuple[int, int]:
        return self.held_blocks(request.request_id), request.num_computed_tokens

    def on_preempted(self, request: Any, held_and_computed: tuple[int, int]) -> None:
        released, computed = held_and_computed
        self.instruments.preemptions.add(1, self.attributes)
        record = self.requests.get(request.request_id)
        if record is None:
            return
        record.preemptions += 1
        record.recomputed_tokens += computed
        record.held = 0
        record.span.add_event(
            names.EVENT_PREEMPTED,
            {names.BLOCKS: released, names.RECOMPUTED_TOKENS: computed, **self._pool_attributes()},
        )

    def before_release(self, request: Any) -> int:
        return self.held_blocks(request.request_id)

    def on_released(self, request: Any, freed: int) -> None:
        record = self.requests.pop(request.request_id, None)
        if record is not None:
            self._end(record, request, freed)
        # An abort can free blocks while the engine idles, with no step to follow.
        self.snapshot = self.pool.snapshot()

    def _end(self, record: RequestRecord, request: Any, freed: int) -> None:
        reason = finish_reason(request.status)
        span = record.span
        span.add_event(
            names.EVENT_RELEASED,
            {names.BLOCKS: freed, names.FINISH_REASON: reason, **self._pool_attributes()},
        )
        span.set_attributes(
            {
                names.OUTPUT_TOKENS: request.num_output_tokens,
                names.CACHE_READ_INPUT_TOKENS: record.cache_read_tokens,
                names.BLOCKS_PEAK: record.peak,
                names.BLOCKS_ALLOCATED: record.allocated,
                names.BLOCKS_PREFIX_HIT: record.prefix_hit_blocks,
                names.BLOCKS_FREED: freed,
                names.PREEMPTIONS: record.preemptions,
                names.RECOMPUTED_TOKENS: record.recomputed_tokens,
                names.ALLOCATION_STALLS: record.stalls,
                names.FINISH_REASON: reason,
            }
        )
        span.end()
        # Recorded in the span's context so exporters can attach it as an exemplar.
        context = trace.set_span_in_context(span)
        instruments = self.instruments
        instruments.request_blocks.record(record.peak, self.attributes, context=context)
        instruments.request_preemptions.record(record.preemptions, self.attributes, context=context)
        prompt_tokens = request.num_prompt_tokens
        if prompt_tokens:
            ratio = min(record.cache_read_tokens / prompt_tokens, 1.0)
            instruments.request_prefix_hit_ratio.record(ratio, self.attributes, context=context)

    # --- pool -------------------------------------------------------------------

    def on_evicted(self, was_cached_free: bool) -> None:
        self.pool.on_evicted(was_cached_free)
        self.instruments.evictions.add(1, self.attributes)

    def on_step_end(self) -> None:
        """Once per engine step: publish the pool snapshot for the gauges."""
        self.step += 1
        self.snapshot = self.pool.snapshot()
        if self.step % SWEEP_EVERY_STEPS == 0:
            self._sweep()

    def _sweep(self) -> None:
        live = self._scheduler_requests
        for request_id in [rid for rid in self.requests if rid not in live]:
            record = self.requests.pop(request_id)
            record.span.set_attribute(names.FINISH_REASON, "unknown")
            record.span.end()
