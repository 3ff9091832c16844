"""What ``opentelemetry-instrument`` needs to export OTLP with otel-kvcache alone installed.

The distro sets the same defaults as ``opentelemetry-distro`` (OTLP over gRPC
for traces, metrics and logs) and enables the ``vllm`` resource detector;
every default yields to a variable the user set. It also hands FastAPI's
instrumentation the ASGI spans ``OTEL_PYTHON_FASTAPI_EXCLUDE_SPANS`` names:
that instrumentation takes them only as an argument, which
``opentelemetry-instrument`` has no other way to pass.
"""

from __future__ import annotations

import os

from opentelemetry.environment_variables import OTEL_LOGS_EXPORTER, OTEL_METRICS_EXPORTER, OTEL_TRACES_EXPORTER
from opentelemetry.instrumentation.distro import BaseDistro
from opentelemetry.sdk._configuration import _OTelSDKConfigurator
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPERIMENTAL_RESOURCE_DETECTORS,
    OTEL_EXPORTER_OTLP_PROTOCOL,
)

from otel_kvcache import config

RESOURCE_DETECTOR = "vllm"
"""Entry-point name of ``otel_kvcache.resource.VLLMResourceDetector``."""


class VLLMKVCacheConfigurator(_OTelSDKConfigurator):
    """The SDK's own configurator, registered under otel-kvcache's name. Subclassing the
    SDK's private class is what ``opentelemetry-distro`` does too: there is no public one."""


class VLLMKVCacheDistro(BaseDistro):
    def _configure(self, **kwargs) -> None:
        os.environ.setdefault(OTEL_TRACES_EXPORTER, "otlp")
        os.environ.setdefault(OTEL_METRICS_EXPORTER, "otlp")
        os.environ.setdefault(OTEL_LOGS_EXPORTER, "otlp")
        os.environ.setdefault(OTEL_EXPORTER_OTLP_PROTOCOL, "grpc")
        os.environ.setdefault(OTEL_EXPERIMENTAL_RESOURCE_DETECTORS, RESOURCE_DETECTOR)

    def load_instrumentor(self, entry_point, **kwargs) -> None:
        if entry_point.name == "fastapi" and "exclude_spans" not in kwargs:
            excluded = config.fastapi_exclude_spans()
            if excluded:
                kwargs["exclude_spans"] = excluded
        super().load_instrumentor(entry_point, **kwargs)
