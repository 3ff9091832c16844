"""An instrumented engine under load, serving its metrics through the OpenTelemetry Prometheus exporter.

    python tests/metrics_source.py PORT SECONDS

The real scheduler (fake model outputs) with a pool small enough to preempt,
requests sharing a prefix, some aborted, admitted continuously; a second engine
with a NIXL connector, a third with a CPU offload tier; the GPU view reads the
pynvml and torch.cuda fakes (no GPU here).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

from opentelemetry.exporter.prometheus import PrometheusMetricReader  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from prometheus_client import start_http_server  # noqa: E402

from otel_kvcache import VLLMKVCacheInstrumentor  # noqa: E402
from otel_kvcache.gpu import VLLMGPUInstrumentor  # noqa: E402

from engine_harness import EngineHarness, KVTransfers, nixl_both  # noqa: E402
from harness.offloading import OffloadingWorker, offloading  # noqa: E402
from harness.scheduler import make_model_config, make_scheduler  # noqa: E402
from gpu_fakes import FakeNVML, FakeTorchCuda, load_readings  # noqa: E402


def main(port: int, seconds: float) -> None:
    provider = MeterProvider(metric_readers=[PrometheusMetricReader()])
    VLLMKVCacheInstrumentor().instrument(tracer_provider=TracerProvider(), meter_provider=provider)
    readings = load_readings()
    VLLMGPUInstrumentor().instrument(
        meter_provider=provider, nvml=FakeNVML(readings["nvml"]), torch_cuda=FakeTorchCuda(readings["torch"])
    )
    model_config = make_model_config(tempfile.mkdtemp())
    engine = EngineHarness(make_scheduler(model_config, num_blocks=32))
    # A second engine hands KV to and from others through vLLM's NIXL connector.
    transfers = KVTransfers(EngineHarness(
        make_scheduler(model_config, num_blocks=48, data_parallel_rank=1, kv_transfer_config=nixl_both())))  # fmt: skip
    # A third keeps KV in a CPU offload tier, loading prefixes back from it.
    tiered = EngineHarness(make_scheduler(model_config, num_blocks=32, data_parallel_rank=2,
                                          kv_transfer_config=offloading(8 << 20)))  # fmt: skip
    offload_worker = OffloadingWorker()
    start_http_server(port, addr="127.0.0.1")
    print("serving", flush=True)
    deadline, n = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        while len(engine.scheduler.requests) < 6:
            engine.add(engine.make_request(f"r{n}", prompt_len=40 + (n * 13) % 60, shared_prefix=32, max_tokens=60,
                                           session_id=f"session-{n % 5}",
                                           trace_headers={"baggage": f"tenant=team-{'ab'[n % 2]}"}))  # fmt: skip
            n += 1
        engine.step()
        while len(transfers.harness.scheduler.requests) < 4:
            transfers.add()
        transfers.step()
        if not tiered.scheduler.has_requests() and not offload_worker.jobs:
            tiered.scheduler.reset_prefix_cache()  # the next ones load the prefix back from the tier
            for k in range(2):
                tiered.add(tiered.make_request(f"t{n}-{k}", prompt_len=64, shared_prefix=48, max_tokens=8))
        offload_worker.step(tiered)
        if n % 7 == 0 and f"r{n - 1}" in engine.scheduler.requests:
            engine.abort(f"r{n - 1}")
        time.sleep(0.002)


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]))
