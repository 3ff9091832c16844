"""OpenTelemetry instrumentation for vLLM's KV cache.

Usage
-----
No code change: install the package beside vLLM and start the server under
``opentelemetry-instrument``::

    pip install otel-kvcache
    opentelemetry-instrument vllm serve MODEL

or instrument by hand, before vLLM builds its engine::

    from otel_kvcache import VLLMKVCacheInstrumentor

    VLLMKVCacheInstrumentor().instrument(tracer_provider=..., meter_provider=...)

In each EngineCore process the instrumentor patches vLLM's V1 scheduler, KV
cache manager and block pool (see ``vllm_compat.hook_points``) and emits:

- one ``vllm.kv_cache.request`` span per request, in the request's own trace
  (its W3C ``trace_headers``), with the blocks it held, reused from the prefix
  cache and freed, its preemptions, stalls and finish reason;
- pool metrics: blocks used / cached / free, utilization, preemptions,
  evictions, prefix-cache queries and hits, allocation stalls, and per-request
  histograms, all tagged with ``vllm.engine.index``.

The spans and the per-request histograms are built off the engine thread: in
a helper process (``export.helper``) when the SDK was configured from
the environment, as ``opentelemetry-instrument`` does, and in-process when the
providers were passed in. ``OTEL_KVCACHE_EXPORTER_PROCESS`` (``auto``, ``on``,
``off``) overrides the choice.

All names are in ``otel_kvcache.names``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from otel_kvcache.version import __version__

if TYPE_CHECKING:
    from otel_kvcache.wiring.instrumentor import VLLMKVCacheInstrumentor

__all__ = ["VLLMKVCacheInstrumentor", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported when first named (the entry point, a user's import): the commands
    # (``otel-kvcache top``) import the package without OpenTelemetry's instrumentation.
    if name == "VLLMKVCacheInstrumentor":
        from otel_kvcache.wiring.instrumentor import VLLMKVCacheInstrumentor

        return VLLMKVCacheInstrumentor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
