"""Span exports bounded in bytes, so that no span costs the others their delivery.

A receiver refuses an export request over its size limit: gRPC's default, and
the Collector's, is 4 MiB, refused as RESOURCE_EXHAUSTED ("Received message
larger than max"). The SDK's OTLP exporter retried that as if it were transient,
for seconds, then gave up on every span of the batch. One client's oversized
value, or a batch of long spans, cost everyone in it their span.

``ByteBoundedSpanExporter`` stands in front of a span exporter:

- It sends no request over ``OTEL_KVCACHE_EXPORT_MAX_BYTES`` (3 MiB). A batch is
  measured as OTLP encodes it, once. A larger one is cut into runs of spans that
  fit, each span measured alone; a span larger than that alone is dropped and counted.
- A batch the exporter fails to send is sent again in halves, down to single
  spans, while the receiver takes an empty export: then the receiver refused
  what it was sent, and only the spans refused even alone are lost. A receiver
  that takes nothing (down, or refusing us) loses the batch whole, as before,
  and is not asked again; the log says which, naming the endpoint
  (``collector.py``).
- Each kind of loss is logged once per process, however many exporters it has.
- What ``export`` loses is counted in ``otel_kvcache.telemetry.dropped`` (stage
  ``export``); ``send`` returns it instead, for the helper to acknowledge.

The helper's span pipeline uses it (``helper.py``), and so does every process
the configurator sets up, through the batch span processor (``distro.py``), for
FastAPI's spans in the API server among others.

The OTLP gRPC exporter is told to retry only what the OTLP specification calls
retryable (``retry_as_otlp_specifies``): RESOURCE_EXHAUSTED is retryable there
only when the server sends RetryInfo, which an oversized message never has.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_kvcache import config, names
from otel_kvcache.errors import count_dropped
from otel_kvcache.export.collector import span_endpoint, unreachable

_logger = logging.getLogger(__name__)
_warned: set[tuple[int, str]] = set()
"""(pid, kind) of each loss logged: once per process, a forked child's too."""

RETRYABLE_CODES_VARIABLE = "OTEL_PYTHON_EXPORTER_OTLP_GRPC_RETRYABLE_ERROR_CODES"
"""The SDK's (experimental) list of gRPC codes its OTLP exporters retry."""
OTLP_RETRYABLE_CODES = "CANCELLED,DEADLINE_EXCEEDED,ABORTED,OUT_OF_RANGE,UNAVAILABLE,DATA_LOSS"
"""The OTLP specification's retryable codes, less RESOURCE_EXHAUSTED (retryable only with RetryInfo)."""


def retry_as_otlp_specifies() -> None:
    """Unless the user chose, the OTLP gRPC exporters of this process (and those it starts)
    give up at once on a refusal that retrying cannot fix."""
    os.environ.setdefault(RETRYABLE_CODES_VARIABLE, OTLP_RETRYABLE_CODES)


def encoded_size(spans: Sequence[ReadableSpan]) -> int:
    """Bytes of the OTLP export request that carries ``spans``."""
    return encode_spans(spans).ByteSize()


class ByteBoundedSpanExporter(SpanExporter):
    """Exports through ``exporter`` in requests of at most ``max_bytes``, losing only the
    spans that cannot be sent alone."""

    def __init__(self, exporter: SpanExporter, max_bytes: int | None = None) -> None:
        self.exporter = exporter
        self.max_bytes = config.export_max_bytes() if max_bytes is None else max_bytes

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lost = self.send(list(spans))
        if not lost:
            return SpanExportResult.SUCCESS
        try:
            count_dropped(lost, names.STAGE_EXPORT)
        except Exception:  # noqa: BLE001 - the SDK's export thread must not fail because of us
            _logger.debug("otel-kvcache: could not count dropped spans", exc_info=True)
        return SpanExportResult.FAILURE

    def send(self, spans: list[ReadableSpan]) -> int:
        """Exports ``spans``; how many were lost (not counted here: ``export`` counts)."""
        if not spans:
            return 0
        if encoded_size(spans) <= self.max_bytes:
            return self._send_fitting(spans)
        lost, run, run_bytes = 0, [], 0
        for span in spans:
            size = encoded_size([span])  # with its resource and scope: an upper bound of its share
            if size > self.max_bytes:
                lost += 1
                self._warn_once("too large", lambda: f"a span of {size} bytes is larger than "
                                f"{config.EXPORT_MAX_BYTES}={self.max_bytes} alone; it is dropped")  # fmt: skip
                continue
            if run and run_bytes + size > self.max_bytes:
                lost += self._send_fitting(run)
                run, run_bytes = [], 0
            run.append(span)
            run_bytes += size
        return lost + (self._send_fitting(run) if run else 0)

    def _send_fitting(self, spans: list[ReadableSpan]) -> int:
        if self.exporter.export(spans) is SpanExportResult.SUCCESS:
            return 0
        return self._refused(spans)

    def _refused(self, spans: list[ReadableSpan]) -> int:
        """Spans lost of those the exporter just failed to send: halves are sent again,
        while the receiver takes an empty export (it refused these, it is not down)."""
        if self.exporter.export([]) is not SpanExportResult.SUCCESS:
            self._warn_once("takes nothing", _taking_nothing)  # connects to it: only when first said
            return len(spans)
        if len(spans) == 1:
            self._warn_once("refused", lambda: "the receiver refused a span even alone; it is dropped")
            return 1
        middle = len(spans) // 2
        return sum(self._send_fitting(half) for half in (spans[:middle], spans[middle:]))

    @staticmethod
    def _warn_once(kind: str, describe: Callable[[], str]) -> None:
        if (os.getpid(), kind) not in _warned:
            _warned.add((os.getpid(), kind))
            _logger.warning(
                "otel-kvcache: %s and counted in %s (logged once per process)", describe(), names.TELEMETRY_DROPPED
            )

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def _taking_nothing() -> str:
    """Why a receiver took nothing, as far as connecting to it tells."""
    endpoint, _ = span_endpoint()
    reason = unreachable(endpoint)
    if reason is not None:
        return f"the collector at {endpoint} is unreachable ({reason}); spans sent meanwhile are dropped"
    return (
        f"the collector at {endpoint} answers but took no spans (the OpenTelemetry exporter logs its error); "
        "spans sent meanwhile are dropped"
    )


def byte_bounded_batch_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    """The SDK's batch span processor, exporting through ``ByteBoundedSpanExporter``: the
    configurator's ``export_span_processor`` (``distro.py``)."""
    return BatchSpanProcessor(ByteBoundedSpanExporter(exporter))
