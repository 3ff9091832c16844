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

W3C baggage travels the same way, on every release, but only its entries that
``OTEL_KVCACHE_BAGGAGE_KEYS`` names (baggage may carry user data), each value
bounded as client values are: from the current context (FastAPI's
instrumentation extracts it), else from the caller's ``baggage`` header, which
``_get_trace_headers`` sees (vLLM itself keeps only ``traceparent`` and
``tracestate``). The engine reads them for the attribution metrics, the helper
copies them onto the span (``baggage_entries``).

Between a prefill and a decode engine, a producer's span travels as a W3C
``traceparent`` in the ``kv_transfer_params`` vLLM hands on (``engine.connectors``),
through the helpers this shares with the engine and the exporter (``otel_kvcache.trace_context``).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from opentelemetry import baggage, trace

from otel_kvcache import config
from otel_kvcache.bounds import trace_headers_within
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.trace_context import BAGGAGE_HEADER, TRACE_CONTEXT, baggage_entries, baggage_header

# The W3C trace context travels, and of the baggage (user data) only the entries named.
_CALLER_HEADERS = (*TRACE_CONTEXT.fields, BAGGAGE_HEADER)


def first_argument(args: tuple, kwargs: dict, name: str) -> Any:
    return args[0] if args else kwargs[name]


_incoming_trace_headers: ContextVar[Mapping[str, str] | None] = ContextVar(
    "otel_kvcache_incoming_trace_headers", default=None
)


def remember_trace_headers_wrapper():
    """``AsyncLLM.add_request``: keep its ``trace_headers`` for the rest of the call."""

    async def wrapper(wrapped, instance, args, kwargs):
        # On 0.30/0.31 vLLM passes None here; what was kept from the HTTP headers stays
        # (vLLM's headers win: they are the same, or the caller's own).
        given, kept = kwargs.get("trace_headers"), _incoming_trace_headers.get()
        token = _incoming_trace_headers.set({**kept, **given} if given and kept else given or kept)
        try:
            return await wrapped(*args, **kwargs)
        finally:
            _incoming_trace_headers.reset(token)

    return wrapper


def recover_trace_headers_wrapper(hook: str, errors: InstrumentationErrors):
    """The serving layer's ``_get_trace_headers(headers)``: keep the caller's ``traceparent``,
    ``tracestate`` (0.30/0.31 drop them unless tracing is on) and ``baggage`` (no release
    keeps it) for the rest of the request's task."""

    async def wrapper(wrapped, instance, args, kwargs):
        result = await wrapped(*args, **kwargs)
        try:
            headers = first_argument(args, kwargs, "headers")
            kept = {k: v for k in _CALLER_HEADERS if (v := headers.get(k)) is not None}
            if kept:
                _incoming_trace_headers.set(kept)  # in the request's own task, as awaited
        except Exception as exc:  # noqa: BLE001
            errors.count(hook, exc)
        return result

    return wrapper


def trace_context_carrier(baggage_keys: tuple[str, ...], limit: int) -> dict[str, str]:
    """``traceparent`` / ``tracestate`` of the current span, else of the incoming request;
    ``baggage`` with the entries named ``baggage_keys``, from the current context, else
    from the incoming request."""
    carrier: dict[str, str] = {}
    incoming = _incoming_trace_headers.get()
    if trace.get_current_span().get_span_context().is_valid:
        TRACE_CONTEXT.inject(carrier)
    elif incoming:
        carrier.update({k: v for k in TRACE_CONTEXT.fields if (v := incoming.get(k)) is not None})
    if baggage_keys:
        entries = {k: str(v) for k in baggage_keys if (v := baggage.get_baggage(k)) is not None}
        carried = baggage_header(entries or baggage_entries(incoming, baggage_keys, limit), limit)
        if carried:
            carrier[BAGGAGE_HEADER] = carried
    return carrier


def attach_trace_context_wrapper(hook: str, errors: InstrumentationErrors):
    """``InputProcessor.assign_request_id``: put the context on the request bound for the engine,
    within the bounds on what a client chooses (``bounds.py``)."""
    limit = config.client_value_length_limit()
    baggage_keys = tuple(config.baggage_keys())

    def wrapper(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        try:
            carrier = trace_context_carrier(baggage_keys, limit)
            if carrier:
                request = first_argument(args, kwargs, "request")
                request.trace_headers = trace_headers_within({**(request.trace_headers or {}), **carrier}, limit)
        except Exception as exc:  # noqa: BLE001
            errors.count(hook, exc)
        return result

    return wrapper
