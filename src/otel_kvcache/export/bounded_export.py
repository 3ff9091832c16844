"""Span exports bounded in bytes, so that no span costs the others their delivery.

A receiver refuses an export request over its size limit: gRPC's default, and
the Collector's, is 4 MiB, refused as RESOURCE_EXHAUSTED ("Received message
larger than max"). The SDK's OTLP exporter retried that as if it were transient,
for seconds, then gave up on every span of the batch. One client's oversized
value, or a batch of long spans, cost everyone in it their span.

``ByteBoundedSpanExporter`` stands in front of a span exporter:

- It sends no request over ``OTEL_KVCACHE_EXPORT_MAX_BYTES`` (3 MiB). A batch is
  measured as OTLP encodes it, once. A larger one is cut into runs of spans that
  fit, each span measured alone; a span larger than that alone is lost.
- A batch the exporter fails to send to a collector that takes nothing (nothing
  accepts a connection at its endpoint, ``collector.py``, or it fails an empty
  export too) is handed back with every span not yet sent, for ``held_spans.py``
  to hold until it takes spans again. The exporter returns no error code, and a
  collector that restarts fails an empty export for seconds after it accepts
  connections again: what it takes nothing of is held, not taken for refused.
- A batch that a collector which takes an empty export fails is sent to it again
  whole (it may have just come back), then in halves, down to single spans: it
  refused what it was sent, and only the spans refused even alone are lost.
- Each kind of loss is logged once per process, however many exporters it has.

The OTLP gRPC exporter is told to retry only what the OTLP specification calls
retryable (``retry_as_otlp_specifies``): RESOURCE_EXHAUSTED is retryable there
only when the server sends RetryInfo, which an oversized message never has.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from otel_kvcache import config, names
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


class Sent(NamedTuple):
    """What one ``send`` did not deliver."""

    lost: int
    """Spans refused even alone, or too large alone."""
    unsent: list[ReadableSpan]
    """Spans not sent because the collector takes nothing, in order: to be sent again."""


class ByteBoundedSpanExporter:
    """Exports through ``exporter`` in requests of at most ``max_bytes``, losing only the
    spans that cannot be sent alone."""

    def __init__(self, exporter: SpanExporter, max_bytes: int | None = None) -> None:
        self.exporter = exporter
        self.max_bytes = config.export_max_bytes() if max_bytes is None else max_bytes
        self.why_not_taken = ""
        """Why the collector took nothing, when it last took nothing."""

    def send(self, spans: list[ReadableSpan]) -> Sent:
        """Exports ``spans``: how many were lost, and those not sent because the collector
        takes nothing."""
        if not spans:
            return Sent(0, [])
        if encoded_size(spans) <= self.max_bytes:
            runs, lost = [spans], 0
        else:
            runs, lost = self._fitting_runs(spans)
        for index, run in enumerate(runs):
            refused = self._send_fitting(run)
            if refused is None:
                return Sent(lost, [span for later in runs[index:] for span in later])
            lost += refused
        return Sent(lost, [])

    def _fitting_runs(self, spans: list[ReadableSpan]) -> tuple[list[list[ReadableSpan]], int]:
        """``spans`` cut into runs of at most ``max_bytes``, and how many are too large alone."""
        runs, lost, run, run_bytes = [], 0, [], 0
        for span in spans:
            size = encoded_size([span])  # with its resource and scope: an upper bound of its share
            if size > self.max_bytes:
                lost += 1
                warn_once("too large", lambda: f"a span of {size} bytes is larger than "
                          f"{config.EXPORT_MAX_BYTES}={self.max_bytes} alone; it is dropped")  # fmt: skip
                continue
            if run and run_bytes + size > self.max_bytes:
                runs.append(run)
                run, run_bytes = [], 0
            run.append(span)
            run_bytes += size
        return runs + ([run] if run else []), lost

    def _send_fitting(self, spans: list[ReadableSpan]) -> int | None:
        """Spans lost of ``spans``; None when the collector takes nothing (none were sent)."""
        if self.exporter.export(spans) is SpanExportResult.SUCCESS:
            return 0
        endpoint, _ = span_endpoint()
        reason = unreachable(endpoint)
        if reason is not None:
            self.why_not_taken = f"the collector at {endpoint} is unreachable ({reason})"
            return None
        if self.exporter.export([]) is not SpanExportResult.SUCCESS:
            self.why_not_taken = (
                f"the collector at {endpoint} answers but takes no spans (the OpenTelemetry exporter logs its error)"
            )
            return None
        return self._refused(spans)

    def _refused(self, spans: list[ReadableSpan]) -> int:
        """Spans lost of those a collector that takes an empty export failed to take: sent
        again (a collector that was coming back when they failed takes them now), then in
        halves, down to single spans."""
        if self.exporter.export(spans) is SpanExportResult.SUCCESS:
            return 0
        if len(spans) == 1:
            warn_once("refused", lambda: "the receiver refused a span even alone; it is dropped")
            return 1
        middle = len(spans) // 2
        return self._refused(spans[:middle]) + self._refused(spans[middle:])

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def warn_once(kind: str, describe: Callable[[], str], counted: bool = True) -> None:
    """Logs what ``describe`` says of ``kind`` (a loss, counted, unless told otherwise) the
    first time this process meets it, a forked child's too."""
    if (os.getpid(), kind) in _warned:
        return
    _warned.add((os.getpid(), kind))
    counted_in = f" and counted in {names.TELEMETRY_DROPPED}" if counted else ""
    _logger.warning("otel-kvcache: %s%s (logged once per process)", describe(), counted_in)
