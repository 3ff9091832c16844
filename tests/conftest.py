from __future__ import annotations

import json

import pytest
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from demo.otlp_sink import to_otlp_json
from otel_kvcache import VLLMKVCacheInstrumentor, config, names


class Telemetry:
    """In-memory span exporter and metric reader wired to the instrumentor."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def kv_spans(self):
        return [s for s in self.spans.get_finished_spans() if s.name == names.KV_REQUEST_SPAN]

    def span_by_request(self):
        return {s.attributes[names.REQUEST_ID]: s for s in self.kv_spans()}

    def points(self, metric_name: str) -> list:
        """Data points of one metric (observable callbacks run now)."""
        data = self.reader.get_metrics_data()
        found = []
        for resource_metrics in data.resource_metrics if data else ():
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name == metric_name:
                        found.extend(metric.data.data_points)
        return found

    def write_otlp_json(self, directory) -> None:
        """What was exported so far, as the collector's file exporter writes it."""
        directory.mkdir(parents=True, exist_ok=True)
        metrics = encode_metrics(self.reader.get_metrics_data())
        (directory / "metrics.jsonl").write_text(json.dumps(to_otlp_json(metrics)) + "\n")
        spans = encode_spans(self.spans.get_finished_spans())
        (directory / "traces.jsonl").write_text(json.dumps(to_otlp_json(spans)) + "\n")

    def total(self, metric_name: str, **attributes) -> float:
        return sum(
            p.value for p in self.points(metric_name) if all(p.attributes.get(k) == v for k, v in attributes.items())
        )

    def blocks_by_state(self) -> dict[str, int]:
        return {p.attributes[names.BLOCK_STATE]: p.value for p in self.points(names.BLOCKS)}


@pytest.fixture(scope="session", autouse=True)
def top_snapshot_directory(tmp_path_factory):
    """Every engine the tests make, in-process or served, publishes its live snapshot
    here rather than in the user's own runtime directory."""
    import os

    directory = tmp_path_factory.mktemp("top")
    directory.chmod(0o700)
    os.environ[config.TOP_DIR] = str(directory)
    yield directory
    os.environ.pop(config.TOP_DIR, None)


@pytest.fixture(autouse=True)
def no_settings_warned_yet(monkeypatch):
    """Each test is a new vLLM instance: no bad setting has been warned about yet."""
    monkeypatch.delenv(config.WARNED_SETTINGS, raising=False)


@pytest.fixture(scope="session")
def model_config(tmp_path_factory):
    from harness.scheduler import make_model_config

    return make_model_config(str(tmp_path_factory.mktemp("tiny-llama")))


def export_through_a_helper(monkeypatch, endpoint: str, **variables: str) -> None:
    """Spans built in the helper process, its SDK configured from the environment as under
    opentelemetry-instrument: OTLP/gRPC to ``endpoint`` (``variables`` override)."""
    for variable, value in {
        "OTEL_KVCACHE_EXPORTER_PROCESS": "on",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "none",
        **variables,
    }.items():
        monkeypatch.setenv(variable, value)


def prometheus_scrape_of_a_run(make_engine, telemetry) -> tuple[str, list]:
    """(the OpenTelemetry Prometheus exporter's text, the same collection's OpenTelemetry
    metrics) of real engines: requests sharing a prefix in a pool that preempts, a session's
    second turn, KV transfers on a second engine, a CPU offload tier on a third, the GPU view
    on its fakes, and a request holding blocks as it is scraped."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, generate_latest

    from engine_harness import KVTransfers, nixl_both
    from harness.offloading import OffloadingWorker, offloading
    from gpu_fakes import FakeNVML, FakeTorchCuda, load_readings
    from otel_kvcache.gpu import VLLMGPUInstrumentor

    registry, in_memory = CollectorRegistry(), InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry), in_memory])
    VLLMKVCacheInstrumentor().uninstrument()
    VLLMKVCacheInstrumentor().instrument(tracer_provider=telemetry.tracer_provider, meter_provider=provider)
    gpu, readings = VLLMGPUInstrumentor(), load_readings()
    gpu.instrument(meter_provider=provider, nvml=FakeNVML(readings["nvml"]), torch_cuda=FakeTorchCuda(readings["torch"]))
    try:
        engine = make_engine(num_blocks=24)
        for i in range(4):
            engine.add(engine.make_request(f"r{i}", prompt_len=60, shared_prefix=32, max_tokens=40,
                                           session_id=f"session-{i}"))  # fmt: skip
        engine.run()
        engine.add(engine.make_request("r0-turn-2", prompt_len=60, session_id="session-0"))  # the session's gap
        engine.run()
        transfers = KVTransfers(make_engine(num_blocks=48, data_parallel_rank=1, kv_transfer_config=nixl_both()))
        for _ in range(8):
            transfers.add()
        transfers.run()
        tiered = make_engine(num_blocks=32, data_parallel_rank=2, kv_transfer_config=offloading(8 << 20))
        worker = OffloadingWorker()
        for turn in range(2):  # the second loads the first's prefix back from the CPU tier
            tiered.add(tiered.make_request(f"t{turn}", prompt_len=64, shared_prefix=48, max_tokens=4))
            while tiered.scheduler.has_requests() or worker.jobs:
                worker.step(tiered)
            tiered.scheduler.reset_prefix_cache()
        engine.add(engine.make_request("running", prompt_len=60))  # someone holds blocks as it is scraped
        engine.step()
        text = generate_latest(registry).decode()
        data = in_memory.get_metrics_data()
    finally:
        gpu.uninstrument()
        VLLMKVCacheInstrumentor().uninstrument()
        provider.shutdown()
        VLLMKVCacheInstrumentor().instrument(
            tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider
        )
    return text, [m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny random-weight llama the end-to-end tests serve (made here, never downloaded)."""
    from demo.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def sink():
    """An OTLP receiver (gRPC) for the end-to-end tests' servers, one per test module."""
    from demo.otlp_sink import OTLPSink

    sink = OTLPSink().start()
    yield sink
    sink.stop()


@pytest.fixture
def telemetry():
    telemetry = Telemetry()
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    yield telemetry
    instrumentor.uninstrument()


@pytest.fixture
def engine(model_config, telemetry):
    """An instrumented scheduler with a 64-block pool (63 usable), block size 16."""
    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    return EngineHarness(make_scheduler(model_config, num_blocks=64))


@pytest.fixture
def make_engine(model_config, telemetry):
    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    return lambda **kwargs: EngineHarness(make_scheduler(model_config, **kwargs))
