"""After a fork (vLLM's start method on many GPU setups), our state and the SDK's exporters work in the child."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from demo.otlp_sink import OTLPSink, attributes_of
from otel_kvcache import names

TESTS = Path(__file__).resolve().parent

CHILD_PROGRAM = textwrap.dedent(
    """
    import os, sys, tempfile
    sys.path[:0] = [{tests!r}, {repo!r}]
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from otel_kvcache import VLLMKVCacheInstrumentor

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter({endpoint!r}, insecure=True)))
    reader = PeriodicExportingMetricReader(OTLPMetricExporter({endpoint!r}, insecure=True), 200)
    meter_provider = MeterProvider(metric_readers=[reader])
    VLLMKVCacheInstrumentor().instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)

    from engine_harness import EngineHarness
    from harness.scheduler import make_model_config, make_scheduler
    model_config = make_model_config(tempfile.mkdtemp())
    # The parent runs an engine first, so state exists before the fork.
    parent_engine = EngineHarness(make_scheduler(model_config, num_blocks=40))
    parent_engine.add(parent_engine.make_request("before-fork", prompt_len=50, max_tokens=4))
    parent_engine.run()

    pid = os.fork()
    if pid == 0:
        engine = EngineHarness(make_scheduler(model_config, num_blocks=40))
        for i in range(3):
            engine.add(engine.make_request(f"in-child-{{i}}", prompt_len=60, max_tokens=6))
        engine.run()
        # Time for the exporters' retries on a loaded host (their default flush waits 10 to 30 s).
        flushed = tracer_provider.force_flush(60_000), meter_provider.force_flush(60_000)
        print("child", os.getpid(), "flushed spans and metrics:", flushed, flush=True)
        os._exit(0 if all(flushed) else 1)
    _, status = os.waitpid(pid, 0)
    tracer_provider.shutdown()
    meter_provider.shutdown()
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


@pytest.mark.slow
def test_spans_and_metrics_from_a_forked_child_are_exported():
    sink = OTLPSink().start()
    try:
        program = CHILD_PROGRAM.format(tests=str(TESTS), repo=str(TESTS.parent), endpoint=f"127.0.0.1:{sink.port}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        # gRPC channels made before a fork hang in the child unless gRPC's own fork
        # support is on (as the README says for vLLM processes that fork).
        env.update(GRPC_ENABLE_FORK_SUPPORT="true", GRPC_POLL_STRATEGY="poll")
        result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)
        # The programs' output, in every failure's message: what the child's exporters said.
        output = f"stdout: {result.stdout[-1500:]}\nstderr: {result.stderr[-3000:]}"
        assert result.returncode == 0, output
        request_ids = {
            attributes_of(span.attributes)[names.REQUEST_ID]
            for _, span in sink.spans()
            if span.name == names.KV_REQUEST_SPAN
        }
        assert {"in-child-0", "in-child-1", "in-child-2", "before-fork"} <= request_ids, f"{request_ids}\n{output}"
        # The child's counters carry on from the parent's: 50 prompt tokens before the fork, 3 x 60 after.
        queries = {p.as_int for _, m in sink.metrics(names.PREFIX_CACHE_QUERIES) for p in m.sum.data_points}
        assert 50 + 3 * 60 in queries, f"{queries}\n{output}"
    finally:
        sink.stop()


def test_a_fork_during_a_collection_leaves_the_childs_collections_free(engine):
    """vLLM may fork while the metric reader's thread is inside a collection, holding the
    what-if curve's or the attribution's lock: the child has the lock and not the thread,
    and its first collection would wait for ever. Each starts unlocked in the child."""
    import signal

    telemetry = engine.scheduler._otel_kvcache_engine
    engine.add(engine.make_request("before-fork", prompt_len=50, max_tokens=4))
    engine.run()
    with telemetry.reuse._catching_up, telemetry.attribution._folding:  # a collection under way
        pid = os.fork()
        if pid == 0:  # the child: what its collections read, each within 10 s or killed
            signal.alarm(10)
            evicted, cold, uncacheable = telemetry.reuse.missed_tokens()
            telemetry.attribution.catch_up()
            os._exit(0 if cold + uncacheable > 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
