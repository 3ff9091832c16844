"""vLLM's ``vllm.general_plugins`` entry point: the same telemetry without ``opentelemetry-instrument``.

vLLM loads its general plugins in every process it runs: in the API server
while it builds its command line (before its app exists), in each EngineCore
first thing (before the scheduler), in each worker. There, with the OpenTelemetry
SDK not configured yet and the environment asking for telemetry, ``register``
does what ``opentelemetry-instrument``'s start-up does: the distro, the
configurator and every installed instrumentor, this package's included. So
the spans, the resource attributes and the helper process are the same.

One difference needs help: FastAPI's instrumentation replaces ``fastapi.FastAPI``
for apps built afterwards, but by the time vLLM loads its plugins its modules
hold the class already. So in the API server each FastAPI app is instrumented
as it is built, and HTTP requests get their server span as under
``opentelemetry-instrument``.

It does nothing under ``opentelemetry-instrument`` (whose start-up runs in
every process already), when ``OTEL_KVCACHE_VLLM_PLUGIN=off``, and, by default
(``auto``), when no ``OTEL_*`` variable names an exporter or an endpoint. Where
the SDK was configured in code, it only adds this package's instrumentors.
"""

from __future__ import annotations

import logging
import os

from otel_kvcache import config

_logger = logging.getLogger(__name__)

# Any of these, set and not "none", says the user wants telemetry exported (the SDK's own variables).
_ASKS_FOR_TELEMETRY = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
)


def register() -> None:
    """Called by vLLM in each of its processes (``vllm.plugins.load_general_plugins``)."""
    try:
        _register()
    except Exception:  # noqa: BLE001 - vLLM's start-up must never fail because of us
        _logger.warning("otel-kvcache: the vLLM plugin could not set up telemetry", exc_info=True)


def _register() -> None:
    setting = config.vllm_plugin()
    if setting == "off":
        return
    if setting == "auto" and not any(
        os.environ.get(variable, "").strip().lower() not in ("", "none") for variable in _ASKS_FOR_TELEMETRY
    ):
        return
    from opentelemetry import trace
    from opentelemetry.instrumentation import auto_instrumentation
    from opentelemetry.trace import ProxyTracerProvider

    started_by = os.path.dirname(os.path.abspath(auto_instrumentation.__file__))
    if started_by in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        return  # under opentelemetry-instrument: its sitecustomize set this process up
    if isinstance(trace.get_tracer_provider(), ProxyTracerProvider):
        auto_instrumentation.initialize()  # as opentelemetry-instrument does, in this process
        _instrument_fastapi_apps_as_built()
        return
    from otel_kvcache.gpu.instrumentor import VLLMGPUInstrumentor
    from otel_kvcache.wiring.instrumentor import VLLMKVCacheInstrumentor

    for instrumentor in (VLLMKVCacheInstrumentor(), VLLMGPUInstrumentor()):
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()


def _instrument_fastapi_apps_as_built() -> None:
    """Each FastAPI app built from now on gets FastAPI's instrumentation, unless it has it
    (an app of the instrumented class) or that instrumentation is off or not installed."""
    disabled = {name.strip() for name in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")}
    if "fastapi" in disabled:
        return
    try:
        import fastapi
        import fastapi.applications
        import wrapt
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:
        return

    def instrument_after_init(wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        # fastapi.FastAPI is the instrumented subclass now: its apps instrument themselves.
        if isinstance(instance, fastapi.FastAPI) and fastapi.FastAPI is not fastapi.applications.FastAPI:
            return
        if not getattr(instance, "_is_instrumented_by_opentelemetry", False):
            try:
                FastAPIInstrumentor.instrument_app(instance, exclude_spans=config.fastapi_exclude_spans() or None)
            except Exception:  # noqa: BLE001 - the app works without its spans
                _logger.warning("otel-kvcache: could not instrument a FastAPI app", exc_info=True)

    # The class vLLM's modules hold (FastAPI's instrumentation replaced only fastapi.FastAPI).
    wrapt.wrap_function_wrapper(fastapi.applications.FastAPI, "__init__", instrument_after_init)
