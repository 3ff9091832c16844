"""A collector that is gone: the spans made meanwhile are held, bounded in bytes and in
time, and delivered once it is back, each once; what the bounds drop is counted, exactly.
The words are true: a collector nobody listens at is unreachable, named, once per
process; one that answers with an error is that error; and ``doctor`` connects to the
endpoint it reports. Real OTLP/gRPC exporters, a real receiver, stopped and started."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import pytest
from demo.otlp_sink import OTLPSink
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult

from otel_kvcache.export.bounded_export import encoded_size
from otel_kvcache.export.held_spans import HoldingSpanExporter

pytestmark = pytest.mark.vllm_independent  # the SDK's exporters and ours: the default environment runs it


def closed_endpoint() -> str:
    """An address on this host where nothing listens."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{closed.getsockname()[1]}"


def spans(count: int) -> list:
    tracer = TracerProvider().get_tracer("test")
    made = [tracer.start_span(f"span-{k}") for k in range(count)]
    for span in made:
        span.end()
    return made


class Lost:
    """An ``on_lost``: the spans the exporter dropped."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, count: int) -> None:
        self.count += count


def exporter_to(endpoint: str, monkeypatch, **bounds) -> tuple[HoldingSpanExporter, Lost]:
    """A holding exporter configured from the environment, as the helper's is; retries
    every fifth of a second."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # the SDK's retries give up within a second
    monkeypatch.setattr("otel_kvcache.export.bounded_export._warned", set())
    lost = Lost()
    return HoldingSpanExporter(OTLPSpanExporter(), lost, **{"first_interval": 0.2, "most_interval": 0.2, **bounds}), lost


def ids(spans_sent) -> list[int]:
    return [span.context.span_id for span in spans_sent]


def arrived(sink: OTLPSink) -> list[int]:
    return [int.from_bytes(span.span_id, "big") for _, span in sink.spans()]


def said(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name.startswith("otel_kvcache")]


def wait_until(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("endpoint", "reason"),
    [(None, "connection refused"), ("http://collector.invalid:4317", "unknown host collector.invalid")],
    ids=["refused-connection", "unknown-host"],
)
def test_a_collector_nobody_listens_at_is_unreachable_once_per_process(endpoint, reason, monkeypatch, caplog):
    endpoint = endpoint or closed_endpoint()
    exporter, lost = exporter_to(endpoint, monkeypatch, hold_seconds=60)
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        for batch in (spans(3), spans(2), spans(1)):
            exporter.export(batch)
        assert exporter.held == 6 and lost.count == 0
        exporter.shutdown(timeout=0.5)
    assert lost.count == 6 and exporter.held == 0  # what the exit left held is counted
    (held, at_exit) = said(caplog)
    assert f"the collector at {endpoint} is unreachable ({reason}); spans are held" in held, held
    assert "refused" not in held.replace("connection refused", "") and "logged once per process" in held
    assert "6 held spans could not be sent before the exit" in at_exit, at_exit


def test_a_collector_that_answers_with_an_error_is_not_called_unreachable(monkeypatch, caplog):
    """It takes nothing, and says why in its answers (the OpenTelemetry exporter logs them):
    what it was not sent is held all the same (the exporter returns no error code, and a
    collector coming back fails exports for seconds), and dropped and counted when the
    time is up (here, at the exit)."""
    sink = OTLPSink(refuse=True).start()  # answers every export with PERMISSION_DENIED
    exporter, lost = exporter_to(sink.endpoint, monkeypatch, first_interval=60, most_interval=60)
    try:
        with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
            for batch in (spans(3), spans(2), spans(1)):
                exporter.export(batch)
            assert (exporter.held, lost.count) == (6, 0)
            exporter.shutdown(timeout=0)
    finally:
        sink.stop()
    (words, at_exit) = said(caplog)
    assert f"the collector at {sink.endpoint} answers but takes no spans" in words, words
    assert "unreachable" not in words and "spans are held" in words
    assert sink.refused == 3  # the first batch, once: neither sent again in halves nor the others sent
    assert lost.count == 6 and exporter.held == 0 and "6 held spans" in at_exit


def test_spans_made_while_the_collector_is_gone_arrive_once_it_is_back(monkeypatch, caplog):
    """The collector stops and comes back on its port; in between, batches keep coming.
    Every span arrives once, in order of its batch, and nothing is counted lost."""
    first = OTLPSink().start()
    exporter, lost = exporter_to(first.endpoint, monkeypatch)
    before = spans(4)
    exporter.export(before)
    first.stop()
    during = [spans(5) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        for batch in during:
            exporter.export(batch)
    assert exporter.held == 15
    second = OTLPSink(port=first.port).start()
    try:
        wait_until(lambda: exporter.held == 0, 30)
        exporter.export(after := spans(2))
    finally:
        exporter.shutdown()
        second.stop()
    assert arrived(first) == ids(before)
    assert arrived(second) == ids([span for batch in during for span in batch]) + ids(after)
    assert lost.count == 0
    (words,) = said(caplog)
    assert f"the collector at {first.endpoint} is unreachable (connection refused); spans are held" in words


def test_a_batch_that_failed_just_before_the_collector_came_back_is_sent_again(monkeypatch):
    """The collector's restart between a failed export and the look at its endpoint (the
    exporter here starts it as its first failure returns): the batch is sent again, not
    taken for refused (a real server's outage test lost a span so, 2026-12-07)."""
    endpoint = closed_endpoint()
    back: list[OTLPSink] = []

    class BackAfterItsFirstFailure(OTLPSpanExporter):
        def export(self, spans):
            result = super().export(spans)
            if result is not SpanExportResult.SUCCESS and not back:
                back.append(OTLPSink(port=int(endpoint.rsplit(":", 1)[1])).start())
            return result

    exporter, lost = exporter_to(endpoint, monkeypatch)
    exporter.bounded.exporter = BackAfterItsFirstFailure()
    try:
        exporter.export(batch := spans(1))
    finally:
        exporter.shutdown()
        for sink in back:
            sink.stop()
    assert arrived(back[0]) == ids(batch) and lost.count == 0


def test_what_overflows_the_bytes_held_is_dropped_and_counted(monkeypatch):
    """Room for two batches of five: the third is dropped whole, the first two arrive."""
    endpoint = closed_endpoint()
    batches = [spans(5) for _ in range(3)]
    room = encoded_size(batches[0]) + encoded_size(batches[1])
    exporter, lost = exporter_to(endpoint, monkeypatch, hold_bytes=room)
    for batch in batches:
        exporter.export(batch)
    assert (exporter.held, lost.count) == (10, 5)
    sink = OTLPSink(port=int(endpoint.rsplit(":", 1)[1])).start()
    try:
        wait_until(lambda: exporter.held == 0, 30)
    finally:
        exporter.shutdown()
        sink.stop()
    assert arrived(sink) == ids(batches[0] + batches[1])
    assert lost.count == 5


def test_spans_held_longer_than_the_time_are_dropped_and_counted(monkeypatch):
    exporter, lost = exporter_to(closed_endpoint(), monkeypatch, hold_seconds=3)
    exporter.export(spans(3))
    time.sleep(2)  # each try takes the SDK's second: the sender looks at the times between them
    exporter.export(spans(2))
    wait_until(lambda: lost.count == 3, 10)
    assert (exporter.held, lost.count) == (2, 3)  # the older batch outlived the time; the newer is held
    wait_until(lambda: lost.count == 5, 10)
    assert (exporter.held, lost.count) == (0, 5)
    exporter.shutdown(timeout=0)
    assert lost.count == 5  # nothing counted twice


def doctor_line(endpoint: str) -> tuple[int, str]:
    environment = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "VLLM_CONFIGURE_LOGGING": "0"}
    result = subprocess.run([sys.executable, "-m", "otel_kvcache.commands.cli", "doctor"], capture_output=True,
                            text=True, timeout=300, env=environment)  # fmt: skip
    (line,) = [line for line in result.stdout.splitlines() if line.strip().startswith("OTLP endpoint:")]
    assert "ready: the request span can be made" in result.stdout, result.stdout  # a warning, not NOT READY
    return result.returncode, line


@pytest.mark.slow
def test_doctor_says_whether_something_answers_at_its_endpoint():
    sink = OTLPSink().start()
    try:
        code, line = doctor_line(sink.endpoint)
    finally:
        sink.stop()
    assert code == 0 and line.endswith(f"{sink.endpoint} (grpc): something answered"), line
    endpoint = closed_endpoint()
    code, line = doctor_line(endpoint)
    assert code == 0 and f"{endpoint} (grpc): WARNING: unreachable (connection refused)" in line, line
