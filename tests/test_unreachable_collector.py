"""Words that are true when spans cannot be delivered: a collector nobody listens at is
unreachable, named, once per process; one that answers with an error is that error; and
``doctor`` connects to the endpoint it reports. Real OTLP/gRPC exporters, a real receiver."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys

import pytest
from demo.otlp_sink import OTLPSink
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider

from otel_kvcache.export.bounded_export import ByteBoundedSpanExporter

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


def export_to(endpoint: str, monkeypatch, caplog) -> list[str]:
    """Two batches and a lone span through a bounded exporter configured from the
    environment, as the helper's is; what otel-kvcache logged."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # the SDK's retries give up within a second
    monkeypatch.setattr("otel_kvcache.export.bounded_export._warned", set())
    exporter = ByteBoundedSpanExporter(OTLPSpanExporter())
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        lost = [exporter.send(batch) for batch in (spans(3), spans(2), spans(1))]
    exporter.shutdown()
    assert lost == [3, 2, 1]
    return [record.getMessage() for record in caplog.records if record.name.startswith("otel_kvcache")]


@pytest.mark.parametrize(
    ("endpoint", "reason"),
    [(None, "connection refused"), ("http://collector.invalid:4317", "unknown host collector.invalid")],
    ids=["refused-connection", "unknown-host"],
)
def test_a_collector_nobody_listens_at_is_unreachable_once_per_process(endpoint, reason, monkeypatch, caplog):
    endpoint = endpoint or closed_endpoint()
    (said,) = export_to(endpoint, monkeypatch, caplog)
    assert f"the collector at {endpoint} is unreachable ({reason})" in said, said
    assert "logged once per process" in said and "refused" not in said.replace("connection refused", "")


def test_a_collector_that_answers_with_an_error_is_not_called_unreachable(monkeypatch, caplog):
    sink = OTLPSink(refuse=True).start()  # answers every export with PERMISSION_DENIED
    try:
        (said,) = export_to(sink.endpoint, monkeypatch, caplog)
    finally:
        sink.stop()
    assert f"the collector at {sink.endpoint} answers but took no spans" in said, said
    assert sink.refused == 3 + 2 + 1  # each span refused once: not sent again in halves


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
