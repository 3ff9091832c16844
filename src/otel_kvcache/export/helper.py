"""The helper process: builds an EngineCore's spans and exports them, off the engine's CPU.

The engine's end of the pipe (``helper_pipe.HelperPipe``) starts it as ``python -m
otel_kvcache.export.helper ENGINE_PID``, as a grandchild of the EngineCore in a session of its own. vLLM's
shutdown SIGKILLs the EngineCore's whole process tree (at once, with the default
``--shutdown-timeout 0``) and a terminal's Ctrl-C reaches a whole process group;
the helper is in neither, so the records the engine handed over still reach the
backend. It then exits on its own: when its stdin closes (the engine is gone),
or at the latest ``SHUTDOWN_SECONDS`` after the engine process ended, whatever
the collector does: what it still holds then is dropped and counted.

It builds spans with its own tracer provider (the configured provider's
resource and sampler) and exports them itself, all the frames the engine has
written by then at a time, with the
exporters ``OTEL_TRACES_EXPORTER`` names, in requests bounded in bytes
(``bounded_export.py``) and held through a collector's outage (``held_spans.py``),
rather than through a batch span processor whose queue drops without telling
anyone. So it knows what was lost and what was not, and tells the engine on its
stdout after each batch: ``pid records-done spans-failed spans-held`` (a record is
done once its span is sent or held; a line comes too when held spans are sent or
dropped). The engine counts the failed spans, and what a dead helper
took with it, from that (``otel_kvcache.telemetry.dropped``). Once the engine can no
longer read it (it exited), the helper counts the spans it fails to export itself.

The histograms and the finding logs go through the SDK configured from the
environment, as ``opentelemetry-instrument`` configures it.
"""

from __future__ import annotations

import logging
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter

from otel_kvcache import names
from otel_kvcache.errors import count_dropped
from otel_kvcache.export.bounded_export import retry_as_otlp_specifies
from otel_kvcache.export.held_spans import HoldingSpanExporter
from otel_kvcache.export.spans import RequestHistograms, SpanBuilder
from otel_kvcache.export.wire_format import Acknowledgement, read_batches
from otel_kvcache.handover.miss_reasons import MissReasonsFromTheEngine
from otel_kvcache.handover.record import Finding
from otel_kvcache.names import METER_SCOPE
from otel_kvcache.version import __version__

_logger = logging.getLogger(__name__)

SHUTDOWN_SECONDS = 20.0
"""After the engine is gone: the most time left to export what it handed over (one OTLP
export alone may take the exporter's timeout, 10 s by default; Kubernetes gives a pod 30 s)."""
SHUTDOWN_MARGIN_SECONDS = 2.0
"""Of ``SHUTDOWN_SECONDS``: left to count what is still held and flush the counter, before the deadline."""
EXPORT_BATCH = 512
"""Spans per export call (the batch span processor's default batch)."""


class _Collected(SpanProcessor):
    """Keeps the spans that end, sampled ones only, until they are exported."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        if span.context.trace_flags.sampled:
            self.spans.append(span)


class SpanPipeline:
    """A tracer whose spans are exported when asked, with the count of those lost."""

    def __init__(self, provider: TracerProvider, exporters: list[SpanExporter]) -> None:
        self._collected = _Collected()
        provider.add_span_processor(self._collected)
        self.tracer = provider.get_tracer(METER_SCOPE, __version__)
        self._exporters = [
            HoldingSpanExporter(exporter, self._lost, on_settled=lambda: self.on_settled()) for exporter in exporters
        ]
        self._failed_lock = threading.Lock()
        self.failed = 0
        """Spans lost so far: refused, or dropped from what was held (the holding exporters' threads add)."""
        self.on_settled: Callable[[], None] = lambda: None
        """Called when a holding exporter's thread sent or dropped what it held."""

    @property
    def held(self) -> int:
        """Spans held now, for a collector that takes nothing."""
        return sum(exporter.held for exporter in self._exporters)

    def _lost(self, count: int) -> None:
        with self._failed_lock:
            self.failed += count

    @classmethod
    def from_environment(cls) -> SpanPipeline:
        from opentelemetry import trace

        # The same exporters opentelemetry-instrument's configurator picks from
        # OTEL_TRACES_EXPORTER (and the OTLP protocol variables). These two functions
        # are the SDK's private ones: its public API cannot hand an exporter over.
        from opentelemetry.sdk._configuration import _get_exporter_names, _import_exporters

        configured = trace.get_tracer_provider()
        provider = TracerProvider(
            resource=getattr(configured, "resource", None), sampler=getattr(configured, "sampler", None)
        )
        span_exporters, _, _ = _import_exporters(_get_exporter_names("traces"), [], [])
        return cls(provider, [exporter() for exporter in span_exporters.values()])

    def export(self) -> None:
        spans, self._collected.spans = self._collected.spans, []
        for start in range(0, len(spans), EXPORT_BATCH):
            batch = spans[start : start + EXPORT_BATCH]
            for exporter in self._exporters:
                try:
                    exporter.export(batch)
                except Exception:  # noqa: BLE001 - counted as lost, as the SDK's processor would drop them
                    _logger.exception("otel-kvcache: the span exporter raised")
                    self._lost(len(batch))

    def abandon(self) -> int:
        """Drops what the exporters hold, uncounted: how many spans."""
        return sum(exporter.abandon() for exporter in self._exporters)

    def shutdown(self, timeout: float) -> None:
        """Gives what the exporters hold ``timeout`` seconds, all together, then counts the rest as failed."""
        deadline = time.monotonic() + timeout
        for exporter in self._exporters:
            exporter.shutdown(max(0.0, deadline - time.monotonic()))


class _Acknowledgements:
    """Writes ``pid done failed held`` lines to the engine, never blocking, from the main
    thread and the holding exporters' alike: each is cumulative but ``held`` (spans held
    now, for a collector that takes nothing: the engine looks for more lines while there
    are), so one the pipe cannot take now is carried by the next. Once the engine can read
    none (it exited: the pipe is broken), the failed spans are counted here instead."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._lock = threading.Lock()
        self._told_failed = 0
        """Failed spans as of the last line the engine was given."""
        self._engine_listens = True

    def send(self, done: int, failed: int, held: int = 0) -> None:
        with self._lock:
            if self._engine_listens:
                try:
                    os.write(self._fd, Acknowledgement(os.getpid(), done, failed, held).encode())
                    self._told_failed = failed
                    return
                except BlockingIOError:
                    return
                except OSError:  # the engine is gone: nobody to tell
                    self._engine_listens = False
            if failed > self._told_failed:
                count_dropped(failed - self._told_failed, names.STAGE_EXPORT)
                self._told_failed = failed


class _Progress:
    """Records this helper took from the engine, and those it is done with (sent or held)."""

    taken = 0
    done = 0
    pipeline: SpanPipeline | None = None


def _exit_by_deadline_once_gone(engine_pid: int, stdin_closed: threading.Event, progress: _Progress) -> None:
    """Waits for the engine process to end (or the pipe to close), then gives the main
    thread ``SHUTDOWN_SECONDS`` to export, and ends the process if it is still busy
    (an unreachable collector, or a pipe that another process still holds open),
    counting what it took and could not export (``helper_queue``), and the spans it
    still held (``export``)."""
    try:
        handle = os.pidfd_open(engine_pid)
    except (AttributeError, OSError):  # not Linux 5.3+, or the engine is gone already
        handle = None
    while not stdin_closed.is_set():
        if handle is not None:
            if select.select([handle], [], [], 1.0)[0]:
                break
        else:
            try:
                os.kill(engine_pid, 0)
            except ProcessLookupError:
                break
            stdin_closed.wait(1.0)
    time.sleep(SHUTDOWN_SECONDS)
    lost = progress.taken - progress.done
    held = progress.pipeline.abandon() if progress.pipeline is not None else 0
    _logger.warning(
        "otel-kvcache: the helper of engine process %d gives up %ss after the engine's exit; "
        "%d records it took were not exported, and %d spans it held were not sent",
        engine_pid,
        SHUTDOWN_SECONDS,
        lost,
        held,
    )
    try:
        from opentelemetry import metrics

        count_dropped(lost, names.STAGE_HELPER_QUEUE)
        count_dropped(held, names.STAGE_EXPORT)
        provider = metrics.get_meter_provider()
        if hasattr(provider, "force_flush"):
            provider.force_flush(timeout_millis=1000)
    finally:
        os._exit(1)


def _configured_exporter() -> tuple[SpanBuilder, SpanPipeline]:
    from opentelemetry import metrics, trace
    from opentelemetry.trace import ProxyTracerProvider

    if isinstance(trace.get_tracer_provider(), ProxyTracerProvider):
        # Not started under opentelemetry-instrument: configure the SDK the way it would.
        from opentelemetry.instrumentation.auto_instrumentation import initialize

        initialize()
    pipeline = SpanPipeline.from_environment()
    histograms = RequestHistograms(metrics.get_meter(METER_SCOPE, __version__))
    return SpanBuilder(pipeline.tracer, histograms), pipeline


def _export_batches(
    batches: Iterator[list], exporter: SpanBuilder, pipeline: SpanPipeline, acks, progress: _Progress
) -> None:
    misses = MissReasonsFromTheEngine()
    for batch in batches:
        records = [item for item in batch if not misses.took(item)]  # each frame's prefix events first
        progress.taken += len(records)
        for record in records:
            try:
                if isinstance(record, Finding):
                    exporter.finding(record)
                else:
                    exporter.request_ended(record._replace(tally=misses.filled_in(record.tally)))
            except Exception:  # noqa: BLE001 - one bad record must not stop the others
                _logger.exception("otel-kvcache: could not export a record")
        pipeline.export()
        progress.done += len(records)
        acks.send(progress.done, pipeline.failed, pipeline.held)


def main(argv: list[str]) -> int:
    engine_pid = int(argv[1])
    retry_as_otlp_specifies()
    # The acknowledgements keep the pipe; what anything else prints (a console exporter) is discarded.
    acks = _Acknowledgements(os.dup(sys.stdout.fileno()))
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    acks.send(0, 0)  # tells the engine this process's pid
    stdin_closed, progress = threading.Event(), _Progress()
    threading.Thread(
        target=_exit_by_deadline_once_gone,
        args=(engine_pid, stdin_closed, progress),
        name="otel-kvcache-deadline",
        daemon=True,
    ).start()
    exporter, pipeline = _configured_exporter()
    progress.pipeline = pipeline
    pipeline.on_settled = lambda: acks.send(progress.done, pipeline.failed, pipeline.held)
    _export_batches(read_batches(sys.stdin.fileno()), exporter, pipeline, acks, progress)
    stdin_closed.set()  # the deadline runs from now
    pipeline.shutdown(SHUTDOWN_SECONDS - SHUTDOWN_MARGIN_SECONDS)
    acks.send(progress.done, pipeline.failed)  # the engine is gone: counted here
    # The SDK's providers (histograms, logs) flush and shut down at exit.
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
