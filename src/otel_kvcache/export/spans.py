"""Where a finished request's record becomes its span and its histogram points.

The engine thread never builds spans: building one through the SDK and
recording three histograms costs tens of microseconds, as much as the whole
budget of a scheduler step. At release it hands a ``RecordSink`` a ``RequestEnded``
(``handover.record``: ids, the finish reason, the request's tally as bytes), which
``finished_request`` reads back into a ``FinishedRequest``:

- ``SpanBuilder`` builds the span and records the histograms where it is
  called. The engine hands it its records directly only when it was given its
  providers (``instrument(tracer_provider=...)``), which cannot leave the process.
- ``HelperPipe`` (``helper_pipe.py``) keeps the records' fields in one
  flat list and sends them in batches to a helper process that runs
  ``SpanBuilder`` with an SDK configured from the same ``OTEL_*``
  environment, under the EngineCore's resource.

Leak findings for requests whose span has ended take the same road, so they
join the span's trace wherever the span was built.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.metrics import Meter
from opentelemetry.propagate import extract
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Tracer

from otel_kvcache import config, names
from otel_kvcache.handover.miss_reasons import MissReasons
from otel_kvcache.handover.record import (
    ConnectorSummary,
    Finding,
    FinishedRequest,
    RequestEnded,
    event_attributes,
    finished_request,
)
from otel_kvcache.trace_context import baggage_entries, log_in_trace, remote_span_context
from otel_kvcache.vllm_compat.layouts import PrefixLayout

# Span contexts of recently ended requests, so a later leak finding joins their trace.
RECENTLY_ENDED = 4096

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
    if connector.offload_stored_blocks >= 0:  # an offloading connector: what it loads comes from its tier
        attributes[names.OFFLOAD_HIT_TOKENS] = connector.hit_tokens
        attributes[names.OFFLOAD_STORED_BLOCKS] = connector.offload_stored_blocks
        attributes[names.OFFLOAD_LOAD_SECONDS] = connector.wait_ns / 1e9
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


class SpanBuilder:
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
    """Nothing is ever pending here (a ``RecordSink``)."""

    def flush_if_due(self, now: float) -> None:
        """Nothing is ever pending here."""

    def flush(self) -> None:
        """Nothing is ever pending here."""

    def went_idle(self) -> None:
        """Nothing is ever pending here."""
