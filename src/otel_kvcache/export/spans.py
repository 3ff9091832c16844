"""Where a finished request's tally becomes its span and its histogram points.

The engine thread never builds spans: building one through the SDK and
recording three histograms costs tens of microseconds, as much as the whole
budget of a scheduler step. At release it hands an exporter a ``RequestEnded``
(ids, the finish reason, the request's tally as bytes, ``tally.py``), which
``finished_request`` reads into a ``FinishedRequest``:

- ``RequestExporter`` builds the span and records the histograms where it is
  called. The engine uses it directly only when it was given its providers
  (``instrument(tracer_provider=...)``), which cannot leave the process.
- ``ExporterProcess`` (``exporter_process.py``) keeps the tuples' fields in one
  flat list and sends them in batches to a helper process that runs
  ``RequestExporter`` with an SDK configured from the same ``OTEL_*``
  environment, under the EngineCore's resource. The engine thread pays for a
  small tuple, dropped at once, and a share of one ``marshal`` call a second.

Leak findings for requests whose span has ended take the same road, so they
join the span's trace wherever the span was built.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, NamedTuple

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Meter
from opentelemetry.propagate import extract
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Tracer

from otel_kvcache import config, names
from otel_kvcache.engine import tally
from otel_kvcache.engine.connectors import ConnectorSummary
from otel_kvcache.engine.whatif import MissReasons
from otel_kvcache.vllm_compat.layouts import PrefixLayout
from otel_kvcache.wiring.propagation import baggage_entries, remote_span_context

_findings_logger = logging.getLogger("otel_kvcache.findings")

# Span contexts of recently ended requests, so a later leak finding joins their trace.
RECENTLY_ENDED = 4096

EVENT_DETAIL = {
    names.EVENT_ADMITTED: names.EVENT_PREFIX_HIT_TOKENS,
    names.EVENT_RESUMED: names.EVENT_PREFIX_HIT_TOKENS,
    names.EVENT_PREEMPTED: (names.RECOMPUTED_TOKENS, names.PREEMPTED_FOR, names.PREEMPTED_FOR_ORIGINAL_LENGTH),
    names.EVENT_RELEASED: names.FINISH_REASON,
    names.EVENT_LEAK: names.REQUEST_ID,
    names.EVENT_ZOMBIE: (names.REQUEST_ID, names.ZOMBIE_REASON),
    names.EVENT_STUCK: (names.STUCK_STEPS, names.STUCK_REASON),
    names.EVENT_REMOTE_KV_READY: names.CONNECTOR_WAIT_SECONDS,
    names.EVENT_LOAD_FAILED: names.CONNECTOR_FAILED_BLOCKS,
    names.EVENT_SEND_DONE: names.CONNECTOR_DELAYED_FREE_SECONDS,
}
"""The attribute each event's ``detail`` is exported as (besides its blocks); a tuple of
names for a detail that is a tuple of values, None among which is left out."""


def event_attributes(name: str, blocks: int, detail: Any) -> dict[str, Any]:
    exported_as = EVENT_DETAIL[name]
    if isinstance(exported_as, str):
        return {names.BLOCKS: blocks, exported_as: detail}
    attributes = {names.BLOCKS: blocks}
    attributes.update((key, value) for key, value in zip(exported_as, detail) if value is not None)
    return attributes


class FinishedRequest(NamedTuple):
    """What the span and the histograms of one finished request are built from.
    Counts, times and ids only: no prompt or output text, no token ids."""

    request_id: str
    trace_headers: dict[str, str] | None
    start_ns: int
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    block_size: int
    peak: int
    allocated: int
    prefix_hit_blocks: int
    freed: int
    preemptions: int
    recomputed_tokens: int
    stalls: int
    evicted_tokens: int
    """Prompt tokens that missed the prefix cache because their blocks were evicted."""
    cold_tokens: int
    """Prompt tokens whose blocks had never been cached."""
    finish_reason: str
    events: list[tuple]
    """Span events as flat tuples: ``(name, time_ns, blocks, detail, pool_free_blocks,
    pool_used_blocks)``, the detail exported under ``EVENT_DETAIL[name]``."""
    still_held: int
    """Blocks vLLM still attributes to the request after releasing it: a leak."""
    request_id_length: int
    """The length of the request id a client chose, when it was cut to ``request_id``; else 0."""
    occupancy_block_ns: int
    """The blocks the request held, integrated over its life (``tally.hold``)."""
    turn_gap_ns: int
    """From its session's previous release on this engine to its arrival; -1: none."""
    engine_attributes: dict[str, Any]
    connector: ConnectorSummary | None
    """What went through the engine's KV connector, on an engine that has one."""
    attribution: Attributed


class Attributed(NamedTuple):
    """Whose request it was: vLLM's ``Request`` fields, the session id bounded."""

    model: str | None = None
    """The served model's name, or the LoRA adapter's."""
    priority: int = 0
    session_id: str | None = None
    session_id_length: int = 0
    """The length of the session id a client chose, when it was cut; else 0."""


class RequestEnded(NamedTuple):
    """What the engine hands an exporter when a request ends: strings, bytes, numbers and
    objects that exist already, which ``marshal`` writes in one call. Flat: a tuple among
    the fields costs ``marshal`` more than the rest of the record (``benchmarks/RESULTS.md``).
    The engine hands over the fields in this order as a plain tuple (``EngineTelemetry.on_released``)."""

    request_id: str
    trace_headers: Mapping[str, str] | None
    """The request's trace headers, in vLLM's mapping as it is."""
    finish_reason: str
    tally: bytes
    """The request's tally (``tally.py``)."""
    events: list[tuple] | None
    """Events other than the first admission and the release, as in ``FinishedRequest.events``."""
    engine_index: int
    """The engine's data-parallel rank (``vllm.engine.index``)."""
    connector: tuple | None = None
    """A ``ConnectorSummary``'s fields, on an engine with a KV connector."""
    model: str | None = None
    priority: int = 0
    session_id: str | None = None
    """As ``Attributed`` has them; the cut session id's length is in the tally."""


def finished_request(ended: RequestEnded | tuple) -> FinishedRequest:
    """A ``RequestEnded`` (or its fields as a plain tuple) read back into a ``FinishedRequest``."""
    request_id, trace_headers, finish_reason, tally_bytes, more_events, engine_index, connector, model, priority, session = ended
    counts = list(tally.PACKED.unpack(tally_bytes))  # a list: a sum here may pass 64 bits
    # The last admission period, closed here rather than on the engine thread.
    tally.close_admission_period(counts, counts[tally.FREED])
    counts[tally.OCCUPANCY_BLOCK_NS] = tally.released_occupancy(counts)
    counts[tally.PEAK] = max(counts[tally.PEAK], counts[tally.ADMITTED_BLOCKS])
    limit = counts[tally.POOL_LIMIT]
    events = []
    if counts[tally.ADMITTED_NS]:
        free = counts[tally.ADMITTED_POOL_FREE]
        admitted = counts[tally.ADMITTED_BLOCKS], counts[tally.ADMITTED_HIT_TOKENS], free, limit - free
        events.append((names.EVENT_ADMITTED, counts[tally.ADMITTED_NS], *admitted))
    events.extend(more_events or ())
    released_ns, free = counts[tally.RELEASED_NS], counts[tally.RELEASED_POOL_FREE]
    used = limit - free
    events.append((names.EVENT_RELEASED, released_ns, counts[tally.FREED], finish_reason, free, used))
    if counts[tally.STILL_HELD]:  # vLLM's free path kept the request's blocks: a leak, seen at once
        events.append((names.EVENT_LEAK, released_ns, counts[tally.STILL_HELD], request_id, free, used))
    return FinishedRequest(
        request_id=request_id,
        trace_headers=dict(trace_headers) if trace_headers else None,
        finish_reason=finish_reason,
        events=events,
        engine_attributes={names.ENGINE_INDEX: engine_index},
        connector=ConnectorSummary._make(connector) if connector else None,
        attribution=Attributed(model, priority, session, counts[tally.SESSION_ID_LENGTH]),
        **dict(zip(tally.REPORTED, counts)),
    )


def connector_attributes(connector: ConnectorSummary) -> dict[str, Any]:
    attributes = {
        names.CONNECTOR_NAME: connector.name,
        names.CONNECTOR_HIT_TOKENS: connector.hit_tokens,
        names.CONNECTOR_WAIT_SECONDS: connector.wait_ns / 1e9,
        names.CONNECTOR_FAILED_BLOCKS: connector.failed_blocks,
        names.CONNECTOR_RECOMPUTED_TOKENS: connector.recomputed_tokens,
    }
    if connector.role is not None:
        attributes[names.CONNECTOR_ROLE] = connector.role
    if connector.delayed_free_ns >= 0:
        attributes[names.CONNECTOR_DELAYED_FREE_SECONDS] = connector.delayed_free_ns / 1e9
    return attributes


def attribution_attributes(finished: FinishedRequest) -> dict[str, Any]:
    """Whose request it was and what it cost: model, priority, session, block-seconds."""
    attributed = finished.attribution
    attributes: dict[str, Any] = {
        names.PRIORITY: attributed.priority,
        names.OCCUPANCY: finished.occupancy_block_ns / 1e9,
    }
    if attributed.model is not None:
        attributes[names.MODEL] = attributed.model
    if attributed.session_id is not None:
        attributes[names.SESSION_ID] = attributed.session_id
        if attributed.session_id_length:
            attributes[names.SESSION_ID_ORIGINAL_LENGTH] = attributed.session_id_length
    if finished.turn_gap_ns >= 0:
        attributes[names.SESSION_TURN_GAP] = finished.turn_gap_ns / 1e9
    return attributes


def _producer_link(connector: ConnectorSummary) -> list[Link]:
    """A consumer's link to the producer's span, from the ``traceparent`` the producer
    put in its ``kv_transfer_params`` (``connectors.py``)."""
    producer = remote_span_context(connector.producer_traceparent)
    return [Link(producer, {names.CONNECTOR_ROLE: names.ROLE_PRODUCER})] if producer is not None else []


class PresetSpanIds(IdGenerator):
    """Gives the next span the id a producer promised its consumer, then the tracer's own.

    A producer's span is built when its blocks come back, after the consumer has
    taken its KV and linked to it: the id must be chosen first. The SDK's ``Tracer``
    asks its ``id_generator`` attribute for each span id; this one stands in front of
    the tracer's own (ours alone: the SDK makes a ``Tracer`` per ``get_tracer``). That
    attribute is undocumented: the SDK's only public way to choose ids is the provider's
    ``id_generator``, and the provider is the user's, shared with every other span. A
    tracer that is not the SDK's gets no preset ids, and consumers' links to its
    producers' spans point at no span.
    """

    def __init__(self, inner: IdGenerator | None) -> None:
        self.inner = inner
        self._next = 0

    @classmethod
    def install(cls, tracer: Tracer) -> PresetSpanIds:
        ids = cls(getattr(tracer, "id_generator", None))
        if ids.inner is not None:
            tracer.id_generator = ids
        return ids

    def preset(self, span_id: int) -> None:
        self._next = span_id

    def generate_span_id(self) -> int:
        span_id, self._next = self._next, 0
        return span_id or self.inner.generate_span_id()

    def generate_trace_id(self) -> int:
        return self.inner.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return getattr(self.inner, "is_trace_id_random", lambda: True)()


class Finding(NamedTuple):
    """A leak finding about a request whose span has already ended."""

    request_id: str
    event: str
    attributes: dict[str, Any]
    message: str


class RequestHistograms:
    """The per-request distributions, recorded where the spans are built."""

    def __init__(self, meter: Meter) -> None:
        self.blocks = meter.create_histogram(
            names.REQUEST_BLOCKS,
            unit="{block}",
            description="Peak KV blocks held per finished request.",
            explicit_bucket_boundaries_advisory=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096],
        )
        self.prefix_hit_ratio = meter.create_histogram(
            names.REQUEST_PREFIX_HIT_RATIO,
            unit="1",
            description="Prefix-cache hit tokens over prompt tokens per finished request.",
            explicit_bucket_boundaries_advisory=[0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0],
        )
        self.preemptions = meter.create_histogram(
            names.REQUEST_PREEMPTIONS,
            unit="{preemption}",
            description="Preemptions per finished request.",
            explicit_bucket_boundaries_advisory=[0, 1, 2, 4, 8, 16, 32],
        )
        self.turn_gap = meter.create_histogram(
            names.SESSION_TURN_GAP,
            unit="s",
            description="Seconds from a session's previous request's release to its next request's arrival, "
            "by whether the next one found its prefix.",
            explicit_bucket_boundaries_advisory=[0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200],
        )
        self.connector_wait = meter.create_histogram(
            names.REQUEST_CONNECTOR_WAIT,
            unit="s",
            description="Seconds each finished request waited for remote KV (requests that waited).",
            explicit_bucket_boundaries_advisory=[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300],
        )


class RequestExporter:
    """Builds ``vllm.kv_cache.request`` spans, histogram points and finding spans."""

    def __init__(self, tracer: Tracer, histograms: RequestHistograms) -> None:
        self.tracer = tracer
        self.histograms = histograms
        self.recently_ended: OrderedDict[str, SpanContext] = OrderedDict()
        self._span_ids = PresetSpanIds.install(tracer)
        self.baggage_keys = tuple(config.baggage_keys())
        self.value_limit = config.client_value_length_limit()

    def miss_reasons(self, pool_blocks: int, layout: PrefixLayout) -> MissReasons:
        """Where an engine's requests' miss reasons are found: on its engine thread, the
        spans being built there."""
        return MissReasons(pool_blocks, layout)

    def request_ended(self, ended: RequestEnded | tuple) -> None:
        """A finished request, as ``RequestEnded``'s fields (the engine hands a plain tuple)."""
        finished = finished_request(ended)
        headers, connector = finished.trace_headers, finished.connector
        links = self._preemptors(finished.events)
        cache_read_tokens = finished.cache_read_tokens
        if connector is not None:
            links += _producer_link(connector)
            cache_read_tokens += connector.hit_tokens  # the prefix cache's and the connector's
            self._span_ids.preset(connector.span_id)  # promised to the consumer; 0: any
        span = self.tracer.start_span(
            names.KV_REQUEST_SPAN,
            context=extract(headers, context=Context()) if headers else Context(),
            kind=SpanKind.INTERNAL,
            links=links,
            start_time=finished.start_ns,
            attributes={
                **baggage_entries(headers, self.baggage_keys, self.value_limit),
                names.REQUEST_ID: finished.request_id,
                names.INPUT_TOKENS: finished.input_tokens,
                names.OUTPUT_TOKENS: finished.output_tokens,
                names.CACHE_READ_INPUT_TOKENS: cache_read_tokens,
                names.BLOCK_SIZE: finished.block_size,
                names.BLOCKS_PEAK: finished.peak,
                names.BLOCKS_ALLOCATED: finished.allocated,
                names.BLOCKS_PREFIX_HIT: finished.prefix_hit_blocks,
                names.BLOCKS_FREED: finished.freed,
                names.PREEMPTIONS: finished.preemptions,
                names.RECOMPUTED_TOKENS: finished.recomputed_tokens,
                names.ALLOCATION_STALLS: finished.stalls,
                names.PREFIX_EVICTED_TOKENS: finished.evicted_tokens,
                names.PREFIX_COLD_TOKENS: finished.cold_tokens,
                names.FINISH_REASON: finished.finish_reason,
                **({names.REQUEST_ID_ORIGINAL_LENGTH: finished.request_id_length} if finished.request_id_length else {}),
                **(connector_attributes(connector) if connector is not None else {}),
                **attribution_attributes(finished),
            },
        )
        for name, timestamp, blocks, detail, free, used in finished.events:
            attributes = event_attributes(name, blocks, detail)
            attributes[names.POOL_FREE_BLOCKS] = free
            attributes[names.POOL_USED_BLOCKS] = used
            span.add_event(name, attributes, timestamp)
        span.end(finished.events[-1][1])
        # Recorded in the span's context so exporters can attach it as an exemplar.
        context = trace.set_span_in_context(span)
        histograms, attributes = self.histograms, finished.engine_attributes
        histograms.blocks.record(finished.peak, attributes, context=context)
        histograms.preemptions.record(finished.preemptions, attributes, context=context)
        if finished.input_tokens:
            ratio = min(cache_read_tokens / finished.input_tokens, 1.0)
            histograms.prefix_hit_ratio.record(ratio, attributes, context=context)
        if connector is not None and connector.wait_ns:
            histograms.connector_wait.record(connector.wait_ns / 1e9, attributes, context=context)
        if finished.turn_gap_ns >= 0:
            kept = {**attributes, names.SESSION_PREFIX_KEPT: finished.evicted_tokens == 0}
            histograms.turn_gap.record(finished.turn_gap_ns / 1e9, kept, context=context)
        span_context = span.get_span_context()
        self.recently_ended[finished.request_id] = span_context
        if len(self.recently_ended) > RECENTLY_ENDED:
            self.recently_ended.popitem(last=False)
        if finished.still_held:
            log_in_trace(
                span_context,
                "otel-kvcache: request %s was released but vLLM still attributes %d KV blocks to it",
                finished.request_id,
                finished.still_held,
            )

    def _preemptors(self, events: list[tuple]) -> list[Link]:
        """Links to the spans of the requests that preempted this one, those that ended
        before it (a link is set when a span starts: a request still running has none yet)."""
        links = []
        for name, _, _, detail, _, _ in events:
            if name == names.EVENT_PREEMPTED and detail[1] in self.recently_ended:
                links.append(Link(self.recently_ended[detail[1]], {names.REQUEST_ID: detail[1]}))
        return links

    def finding(self, finding: Finding) -> None:
        """A finding span in the ended request's trace, and a log record in its context."""
        context = self.recently_ended.get(finding.request_id)
        if context is not None:
            parent = trace.set_span_in_context(NonRecordingSpan(context))
            span = self.tracer.start_span(names.FINDING_SPAN, context=parent, attributes=finding.attributes)
            span.add_event(finding.event, finding.attributes)
            span.end()
        log_in_trace(context, "otel-kvcache: request %s %s", finding.request_id, finding.message)

    due = math.inf
    """Nothing is ever pending here (the ``ExporterProcess`` interface)."""

    def flush_if_due(self, now: float) -> None:
        """Nothing is ever pending here."""

    def flush(self) -> None:
        """Nothing is ever pending here."""

    def went_idle(self) -> None:
        """Nothing is ever pending here."""


def log_in_trace(context: SpanContext | None, message: str, *args) -> None:
    """A warning that carries the request's trace context, for a log backend to link."""
    if context is None:
        _findings_logger.warning(message, *args)
        return
    with trace.use_span(NonRecordingSpan(context)):
        _findings_logger.warning(message, *args)
