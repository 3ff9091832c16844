"""Bounds on the values a client chooses, applied once, where each enters our telemetry.

A client of vLLM's API server chooses part of what we record: the request id
(the body's ``request_id`` or an ``X-Request-Id`` header, which vLLM adopts as
the engine's), and the trace context it sends (``traceparent``,
``tracestate``, ``baggage``), and a session id. Neither vLLM nor its HTTP server bounds them: a completion
whose body carries a 6 MB ``request_id`` is answered 200. Recorded as it is,
such a value makes its span larger than a collector takes (4 MiB by default),
and the spans exported with it are lost too.

So a client's value is bounded before it is recorded, where it enters:

- a request id when the engine hands its request over (``engine/telemetry.py``), and when
  a preemption event or a finding names it;
- the trace headers in the API server, as they are carried to the engine
  (``propagation.py``), and again when the engine hands a request over (a caller
  of ``LLM`` or another front end may give any), and a producer's
  ``traceparent`` in a consumer's ``kv_transfer_params`` (``connectors.py``).

A value is cut to ``OTEL_KVCACHE_CLIENT_VALUE_LENGTH_LIMIT`` characters (or
the SDK's ``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT``, where lower), its end replaced
by ``CUT_MARKER``; an attribute cut so keeps its original length beside it, in
``<name>.original_length``. A trace header is not cut (a cut one means nothing
to a propagator): ``tracestate`` keeps its first list members up to
``TRACESTATE_CHARACTERS`` (W3C's truncation), as does ``baggage``, any other
header longer than the bound is left out.

Exports are bounded in bytes besides (``bounded_export.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

CUT_MARKER = "…"
"""The end of a value that was cut."""
TRACESTATE_CHARACTERS = 512
"""The ``tracestate`` W3C Trace Context asks every vendor to propagate at least."""
LIST_HEADERS = ("tracestate", "baggage")
"""Headers of comma-separated members (W3C ``tracestate`` and ``baggage``): truncated by
whole members, to at least ``TRACESTATE_CHARACTERS``."""


def cut(value: str, limit: int) -> str:
    """``value``, or its first characters and ``CUT_MARKER``: ``limit`` characters in all."""
    if len(value) <= limit:
        return value
    return value[: max(limit - len(CUT_MARKER), 0)] + CUT_MARKER


def trace_headers_within(headers: Mapping[str, str] | None, limit: int) -> Mapping[str, str] | None:
    """``headers`` as they are when every value is a string within bounds (the common case:
    no copy), else a dict of those that are, ``tracestate`` truncated by whole list members."""
    if not headers:
        return headers
    for value in headers.values():  # a loop, not all(...): no generator on the engine thread
        if type(value) is not str or len(value) > limit:
            break
    else:
        return headers
    kept = {}
    for name, value in headers.items():
        if not isinstance(value, str):
            continue
        if name in LIST_HEADERS:
            value = _whole_members(value, max(limit, TRACESTATE_CHARACTERS))
        elif len(value) > limit:
            continue
        if value:
            kept[name] = value
    return kept


def _whole_members(tracestate: str, characters: int) -> str:
    """The list members of a ``tracestate`` that fit in ``characters``, from the first
    (W3C Trace Context: a vendor that truncates drops members from the end)."""
    if len(tracestate) <= characters:
        return tracestate
    end = tracestate.rfind(",", 0, characters + 1)
    return tracestate[:end].rstrip(" \t,") if end > 0 else ""
