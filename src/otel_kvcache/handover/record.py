"""The contract between the engine and the span builder: a released request's record.

When a request ends, the engine hands whatever builds its span (``RecordSink``: the
span builder itself, or the engine's end of the pipe to the helper process) one
``RequestEnded``'s fields, in that order, as a plain tuple: strings, bytes, numbers and
objects that exist already, so that ``marshal`` writes it in one call and what waits
for the next hand-over adds no object the garbage collector tracks. Its counts are the
request's tally as bytes (``tally.PACKED``). ``finished_request`` reads such a record
back into a ``FinishedRequest``, the span's and histograms' input, closing what the
engine left open at the release (``tally.close_admission_period``,
``tally.released_occupancy``). A ``Finding`` (a leak seen after the span ended) takes
the same road.

Both sides import this module and nothing of each other's: the engine fills the
tally and the tuple, and the exporter decodes them here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from otel_kvcache import names
from otel_kvcache.handover import tally
from otel_kvcache.handover.miss_reasons import PrefixEventSink
from otel_kvcache.vllm_compat.layouts import PrefixLayout


class ConnectorSummary(NamedTuple):
    """What a finished request's span reports about its connector (``RequestEnded.connector``)."""

    name: str
    role: str | None
    hit_tokens: int
    wait_ns: int
    failed_blocks: int
    recomputed_tokens: int
    delayed_free_ns: int
    """-1 when the connector did not delay the free."""
    producer_traceparent: str | None
    """The producer's span, for a consumer's link."""
    span_id: int
    """The span id promised to the consumer (a producer's), or 0 for any."""
    offload_stored_blocks: int
    """The request's blocks the connector's offload tier accepted for storing; -1: no tier."""


class RequestEnded(NamedTuple):
    """What the engine hands an exporter when a request ends: strings, bytes, numbers and
    objects that exist already, which ``marshal`` writes in one call. Flat: no tuple among the
    fields, which ``marshal`` would write as an object of its own (``docs/overhead.md#record``).
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
        cold_tokens=counts[tally.MISSED_TOKENS] - counts[tally.EVICTED_TOKENS],
        **{field: count for field, count in zip(tally.REPORTED, counts) if field != "missed_tokens"},
    )


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


class Finding(NamedTuple):
    """A leak finding about a request whose span has already ended."""

    request_id: str
    event: str
    attributes: dict[str, Any]
    message: str


class RecordSink(Protocol):
    """Where the engine hands its released requests and findings: the span builder in the
    engine's process (``export.spans.SpanBuilder``), or the engine's end of the pipe to the
    helper process that builds them (``export.helper_pipe.HelperPipe``)."""

    due: float
    """When the engine next calls ``flush_if_due`` (``math.inf``: never)."""

    def request_ended(self, fields: tuple) -> None:
        """A released request: ``RequestEnded``'s fields, in order, as a plain tuple."""

    def finding(self, finding: Finding) -> None: ...

    def miss_reasons(self, pool_blocks: int, layout: PrefixLayout) -> PrefixEventSink:
        """Where the engine's requests' miss reasons are found (``miss_reasons.py``)."""

    def flush_if_due(self, now: float) -> None: ...

    def flush(self) -> None:
        """Hands over, now, whatever is pending."""

    def went_idle(self) -> None: ...

