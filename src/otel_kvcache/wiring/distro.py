"""What ``opentelemetry-instrument`` needs to export OTLP with otel-kvcache alone installed.

The distro sets the same defaults as ``opentelemetry-distro`` (OTLP over gRPC
for traces, metrics and logs), enables the ``vllm`` resource detector, and
has the OTLP gRPC exporters retry only what the OTLP specification calls
retryable; every default yields to a variable the user set. The configurator
bounds span exports in bytes and holds them through a collector's outage
(``held_spans.py``). The distro also hands FastAPI's
instrumentation the ASGI spans ``OTEL_PYTHON_FASTAPI_EXCLUDE_SPANS`` names:
that instrumentation takes them only as an argument, which
``opentelemetry-instrument`` has no other way to pass.
"""

from __future__ import annotations

import inspect
import os

from opentelemetry.environment_variables import OTEL_LOGS_EXPORTER, OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.instrumentation.distro import BaseDistro
from opentelemetry.sdk._configuration import _OTelSDKConfigurator, _initialize_components
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPERIMENTAL_RESOURCE_DETECTORS,
    OTEL_EXPORTER_OTLP_PROTOCOL,
)

from otel_kvcache import config
from otel_kvcache.export.bounded_export import retry_as_otlp_specifies
from otel_kvcache.export.held_spans import holding_batch_processor

RESOURCE_DETECTOR = "vllm"
"""Entry-point name of ``otel_kvcache.wiring.resource.VLLMResourceDetector``."""


class VLLMKVCacheConfigurator(_OTelSDKConfigurator):
    """The SDK's own configurator, registered under otel-kvcache's name, with span exports
    bounded in bytes and held through a collector's outage. Subclassing the SDK's private
    class is what ``opentelemetry-distro`` does too: there is no public one."""

    def _configure(self, **kwargs) -> None:
        # With a configuration file the SDK takes no arguments (it warns about any given).
        if not os.environ.get("OTEL_CONFIG_FILE") and _TAKES_EXPORT_SPAN_PROCESSOR:
            kwargs.setdefault("export_span_processor", holding_batch_processor)
        super()._configure(**kwargs)


_TAKES_EXPORT_SPAN_PROCESSOR = "export_span_processor" in inspect.signature(_initialize_components).parameters
"""Whether the SDK's configuration takes the span processor its exporters go through."""


class VLLMKVCacheDistro(BaseDistro):
    def _configure(self, **kwargs) -> None:
        os.environ.setdefault(OTEL_TRACES_EXPORTER, "otlp")
        os.environ.setdefault(OTEL_METRICS_EXPORTER, "otlp")
        os.environ.setdefault(OTEL_LOGS_EXPORTER, "otlp")
        os.environ.setdefault(OTEL_EXPORTER_OTLP_PROTOCOL, "grpc")
        os.environ.setdefault(OTEL_EXPERIMENTAL_RESOURCE_DETECTORS, RESOURCE_DETECTOR)
        retry_as_otlp_specifies()

    def load_instrumentor(self, entry_point, **kwargs) -> None:
        if entry_point.name == "fastapi" and "exclude_spans" not in kwargs:
            excluded = config.fastapi_exclude_spans()
            if excluded:
                kwargs["exclude_spans"] = excluded
        super().load_instrumentor(entry_point, **kwargs)
