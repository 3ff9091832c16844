"""Carries each HTTP request's trace context into the EngineCore, in the API server process.

vLLM reads ``traceparent`` from the HTTP headers, but ``AsyncLLM.add_request``
drops it unless ``--otlp-traces-endpoint`` is set, so the EngineCore never
sees a context. ``InputProcessor.assign_request_id`` runs later, in the
request's own coroutine, on the ``EngineCoreRequest`` that travels to the
engine: there we write the context into its ``trace_headers``. The context is
the current span (the HTTP server span, when FastAPI instrumentation runs),
else the incoming ``traceparent`` that ``add_request`` was given.

vLLM 0.30 and 0.31 drop the headers earlier, in the serving layer's
``_get_trace_headers``, which returns None unless tracing is on: there we keep
the caller's context ourselves (``recover_trace_headers_wrapper``), and vLLM's
own answer stays as it was.

Between a prefill and a decode engine, a producer's span travels as a W3C
``traceparent`` in the ``kv_transfer_params`` vLLM hands on (``connectors.py``):
``traceparent_for`` writes it and ``remote_span_context`` reads it, both through
the W3C propagator.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from otel_kvcache import config
from otel_kvcache.bounds import trace_headers_within
from otel_kvcache.errors import InstrumentationErrors

# Only the W3C trace context travels; baggage (user data) stays in the API server.
_TRACE_CONTEXT = TraceContextTextMapPropagator()


def first_argument(args: tuple, kwargs: dict, name: str) -> Any:
    return args[0] if args else kwargs[name]


_incoming_trace_headers: ContextVar[Mapping[str, str] | None] = ContextVar(
    "otel_kvcache_incoming_trace_headers", default=None
)


def remember_trace_headers_wrapper():
    """``AsyncLLM.add_request``: keep its ``trace_headers`` for the rest of the call."""

    async def wrapper(wrapped, instance, args, kwargs):
        # On 0.30/0.31 vLLM passes None here; the context kept from the HTTP headers stays.
        token = _incoming_trace_headers.set(kwargs.get("trace_headers") or _incoming_trace_headers.get())
        try:
            return await wrapped(*args, **kwargs)
        finally:
            _incoming_trace_headers.reset(token)

    return wrapper


def recover_trace_headers_wrapper(hook: str, errors: InstrumentationErrors):
    """vLLM 0.30/0.31's ``_get_trace_headers(headers)``: when vLLM keeps none (tracing off),
    keep the caller's ``traceparent`` / ``tracestate`` for the rest of the request's task."""

    async def wrapper(wrapped, instance, args, kwargs):
        result = await wrapped(*args, **kwargs)
        if result is None:
            try:
                headers = first_argument(args, kwargs, "headers")
                kept = {k: v for k in _TRACE_CONTEXT.fields if (v := headers.get(k)) is not None}
                if kept:
                    _incoming_trace_headers.set(kept)  # in the request's own task, as awaited
            except Exception as exc:  # noqa: BLE001
                errors.count(hook, exc)
        return result

    return wrapper


def trace_context_carrier() -> dict[str, str]:
    """``traceparent`` / ``tracestate`` of the current span, else of the incoming request."""
    carrier: dict[str, str] = {}
    if trace.get_current_span().get_span_context().is_valid:
        _TRACE_CONTEXT.inject(carrier)
        return carrier
    incoming = _incoming_trace_headers.get()
    if incoming:
        carrier.update({k: v for k in _TRACE_CONTEXT.fields if (v := incoming.get(k)) is not None})
    return carrier


def attach_trace_context_wrapper(hook: str, errors: InstrumentationErrors):
    """``InputProcessor.assign_request_id``: put the context on the request bound for the engine,
    within the bounds on what a client chooses (``bounds.py``)."""
    limit = config.client_value_length_limit()

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            carrier = trace_context_carrier()
            if carrier:
                request = first_argument(args, kwargs, "request")
                request.trace_headers = trace_headers_within({**(request.trace_headers or {}), **carrier}, limit)
        except Exception as exc:  # noqa: BLE001
            errors.count(hook, exc)
        return result

    return wrapper


def remote_span_context(traceparent: object) -> SpanContext | None:
    """The span a W3C ``traceparent`` names, or None where it names none (it may come
    from a client, as anything)."""
    if not isinstance(traceparent, str):
        return None
    context = _TRACE_CONTEXT.extract({"traceparent": traceparent})
    span_context = trace.get_current_span(context).get_span_context()
    return span_context if span_context.is_valid else None


def traceparent_for(trace_id: int, span_id: int, trace_flags: TraceFlags) -> str:
    """The W3C ``traceparent`` of a span in that trace, sampled as ``trace_flags`` say."""
    span = NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=False, trace_flags=trace_flags))
    carrier: dict[str, str] = {}
    _TRACE_CONTEXT.inject(carrier, trace.set_span_in_context(span))
    return carrier["traceparent"]
