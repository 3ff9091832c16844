"""W3C trace context and baggage, read and written where our telemetry needs them.

Below the engine, the exporter and the API server's wiring alike: the API server
writes a request's context into the request bound for the engine
(``wiring.propagation``); the engine reads its baggage for the attribution metrics
(``engine.attribution``) and a producer's ``traceparent`` between a prefill and a
decode engine (``engine.connectors``); the span builder reads both for the span
(``export.spans``). Every value a client chooses is bounded as ``bounds`` says.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_kvcache.bounds import cut

_findings_logger = logging.getLogger("otel_kvcache.findings")

TRACE_CONTEXT = TraceContextTextMapPropagator()
BAGGAGE = W3CBaggagePropagator()
BAGGAGE_HEADER = "baggage"


def baggage_header(entries: Mapping[str, str], limit: int) -> str | None:
    context = Context()
    for key, value in entries.items():
        context = baggage.set_baggage(key, cut(value, limit), context)
    carrier: dict[str, str] = {}
    BAGGAGE.inject(carrier, context)
    return carrier.get(BAGGAGE_HEADER)


def baggage_entries(headers: Mapping[str, str] | None, keys: tuple[str, ...], limit: int) -> dict[str, str]:
    """The entries named ``keys`` of the W3C ``baggage`` header in ``headers``, their
    values cut to ``limit`` (the propagator bounds the header and its entries)."""
    header = headers.get(BAGGAGE_HEADER) if headers and keys else None
    if not isinstance(header, str):
        return {}
    entries = baggage.get_all(BAGGAGE.extract({BAGGAGE_HEADER: header}, context=Context()))
    return {key: cut(str(value), limit) for key in keys if (value := entries.get(key)) is not None}


def remote_span_context(traceparent: object) -> SpanContext | None:
    """The span a W3C ``traceparent`` names, or None where it names none (it may come
    from a client, as anything)."""
    if not isinstance(traceparent, str):
        return None
    context = TRACE_CONTEXT.extract({"traceparent": traceparent})
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def traceparent_for(trace_id: int, span_id: int, trace_flags: TraceFlags) -> str:
    """The W3C ``traceparent`` of a span in that trace, sampled as ``trace_flags`` say."""
    span = NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=False, trace_flags=trace_flags))
    carrier: dict[str, str] = {}
    TRACE_CONTEXT.inject(carrier, trace.set_span_in_context(span))
    return carrier["traceparent"]


def log_in_trace(context: SpanContext | None, message: str, *args) -> None:
    """A warning that carries the request's trace context, for a log backend to link."""
    if context is None:
        _findings_logger.warning(message, *args)
        return
    with trace.use_span(NonRecordingSpan(context)):
        _findings_logger.warning(message, *args)
