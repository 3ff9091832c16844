"""Scale-out on vLLM's real server: ``--data-parallel-size 2``, two EngineCores behind one
API server, each with its own pool and helper. Expected values come from vLLM's
/metrics (its ``engine`` label) and from what reaches a real OTLP receiver."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import psutil
import pytest

from demo.otlp_sink import attributes_of
from demo.server import ServerConfig, VLLMServer, prometheus_samples
from otel_kvcache import names

from test_faults_e2e import _burst
from test_serving_e2e import kv_spans, wait_for

pytestmark = [pytest.mark.serving, pytest.mark.slow]

RESOURCE_PID = "process.pid"
KV_CACHE_SIZE = re.compile(r"\(EngineCore_DP(\d+) pid=(\d+)\).* KV cache size: ([\d,]+) tokens")


def engine_of_pid(sink) -> dict[int, int]:
    """Each engine process's pid -> the engine index its pool metrics carry."""
    return {
        resource[RESOURCE_PID]: attributes_of(point.attributes)[names.ENGINE_INDEX]
        for resource, metric in sink.metrics(names.BLOCKS_LIMIT)
        for point in metric.gauge.data_points
    }


def helpers_lock_files() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "otel-kvcache-helpers-*.lock")))


def _pid(lock_path: str) -> int:
    """The pid a helpers' lock is named after (other processes on the host make theirs too)."""
    return int(lock_path.rsplit("-", 1)[1].removesuffix(".lock"))


def test_two_data_parallel_engines_each_report_their_own_requests_and_pool(tiny_model, sink, tmp_path):
    locks_before = helpers_lock_files()
    config = ServerConfig(model=tiny_model, otlp_endpoint=sink.endpoint, num_blocks=64,
                          extra_args=["--data-parallel-size", "2"])  # fmt: skip
    server = VLLMServer(config, tmp_path / "server.log").start()
    try:
        sent = _burst(server, 24)
        trace_ids = [s.trace_id for s in sent]
        arrived = wait_for(lambda: (found := kv_spans(sink, trace_ids)) and len(found) >= len(sent) and found)
        wait_for(lambda: len(engine_of_pid(sink)) == 2)
        metrics_text = server.metrics_text()
        vllm_processes = {server.process.pid, *(c.pid for c in psutil.Process(server.process.pid).children(True))}
        locks_while_serving = {path for path in helpers_lock_files() - locks_before if _pid(path) in vllm_processes}
        top = subprocess.run([sys.executable, "-m", "otel_kvcache.commands.cli", "top", "--json"],
                             capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    finally:
        server.stop()

    # One span per request, from the engine that served it: as many per engine as vLLM counted.
    assert sorted(span.trace_id.hex() for _, span in arrived) == sorted(trace_ids)
    engines = engine_of_pid(sink)
    assert sorted(engines.values()) == [0, 1]
    spans_by_engine = {index: 0 for index in engines.values()}
    for resource, _ in arrived:
        spans_by_engine[engines[resource[RESOURCE_PID]]] += 1
    ended_by_engine = {0: 0, 1: 0}
    for sample in prometheus_samples(metrics_text, "vllm:request_success_total"):
        ended_by_engine[int(sample.labels["engine"])] += int(sample.value)
    assert spans_by_engine == ended_by_engine and all(ended_by_engine.values())

    # Each engine's pool, as each EngineCore logged it (vLLM's cache_config_info gives the
    # sum over the engines), in the metrics and in top's frame: less the null block.
    logged = {int(pid): (int(index), int(tokens.replace(",", "")) // config.block_size)
              for index, pid, tokens in KV_CACHE_SIZE.findall((tmp_path / "server.log").read_text())}  # fmt: skip
    assert {pid: index for pid, (index, _) in logged.items()} == engines
    limits = {attributes_of(point.attributes)[names.ENGINE_INDEX]: point.as_int
              for _, metric in sink.metrics(names.BLOCKS_LIMIT) for point in metric.gauge.data_points}  # fmt: skip
    live = {e["engine"]: e["pool"]["limit"] for e in json.loads(top.stdout)["engines"] if e["pid"] in engines}
    assert limits == live == {index: blocks - 1 for index, blocks in logged.values()}

    # Only vLLM's first process makes a helpers' lock, and none is left behind.
    assert locks_while_serving == {os.path.join(tempfile.gettempdir(), f"otel-kvcache-helpers-{server.process.pid}.lock")}
    assert {path for path in helpers_lock_files() if _pid(path) in vllm_processes} == set()
