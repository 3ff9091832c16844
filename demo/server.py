"""Starts vLLM's OpenAI server under ``opentelemetry-instrument`` on the CPU build."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

EXCLUDE_ASGI_SPANS = "OTEL_PYTHON_FASTAPI_EXCLUDE_SPANS"
"""Which of the ASGI ``send`` and ``receive`` spans FastAPI's instrumentation leaves out:
its ``exclude_spans`` option, set from this variable by otel-kvcache's distro (FastAPI's
instrumentation reads no variable for it).
A streamed answer otherwise makes one ``http send`` span per chunk, enough to overflow
the SDK's span queue and lose the HTTP spans that KV spans hang under."""
EXCLUDED_ASGI_SPANS = "send,receive"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerConfig:
    model: Path
    otlp_endpoint: str | None = None
    """None: leave OTEL_EXPORTER_OTLP_ENDPOINT as the environment has it."""
    block_size: int = 32
    num_blocks: int = 64
    max_model_len: int = 1024
    max_num_seqs: int = 16
    kv_transfer_config: dict | None = None
    """vLLM's ``--kv-transfer-config`` (a KV connector, e.g. for disaggregated prefill)."""
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    instrumented: bool = True
    """False: the same server without opentelemetry-instrument (for comparisons)."""
    served_model_name: str | None = None
    """The name clients ask for (``--served-model-name``); None: the model's path."""

    @property
    def model_name(self) -> str:
        return self.served_model_name or str(self.model)


class VLLMServer:
    """One ``opentelemetry-instrument python -m vllm.entrypoints.openai.api_server``."""

    def __init__(self, config: ServerConfig, log_path: Path) -> None:
        self.config = config
        self.port = free_port()
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        c = self.config
        bin_dir = Path(sys.executable).parent
        # The CPU build's `vllm` console script looks up the distribution
        # named `vllm` and fails; the module is the same server.
        launcher = [str(bin_dir / "opentelemetry-instrument")] if c.instrumented else []
        return [
            *launcher, sys.executable,
            "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(c.model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--block-size", str(c.block_size),
            "--num-gpu-blocks-override", str(c.num_blocks),
            "--max-model-len", str(c.max_model_len),
            "--max-num-seqs", str(c.max_num_seqs),
            "--enable-prefix-caching",
            "--dtype", "float32",
            *(["--kv-transfer-config", json.dumps(c.kv_transfer_config)] if c.kv_transfer_config else []),
            *(["--served-model-name", c.served_model_name] if c.served_model_name else []),
            *c.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            # Export quickly so the demo and the tests see data within a second.
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_METRIC_EXPORT_INTERVAL": "1000",
            "OTEL_LOGS_EXPORTER": "none",
            **self.config.extra_env,
        }
        # One span per HTTP request, as the README recommends to users who stream.
        env.setdefault(EXCLUDE_ASGI_SPANS, EXCLUDED_ASGI_SPANS)
        if self.config.otlp_endpoint:
            env["OTEL_EXPORTER_OTLP_ENDPOINT"] = self.config.otlp_endpoint
            env["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
        return env

    def start(self, timeout: float = 300) -> VLLMServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"vLLM did not become healthy in {timeout}s; see {self.log_path}")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            return response.read().decode()

    def stop(self, timeout: float = 60, settle: float = 2.5) -> None:
        """Waits ``settle`` seconds for the last periodic exports (spans every
        0.2 s, metrics every 1 s), then lets vLLM shut down its own processes."""
        if self.process is None or self.process.poll() is not None:
            return
        time.sleep(settle)
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # Whatever vLLM left behind in the session goes too.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()


def prometheus_samples(metrics_text: str, name: str) -> list:
    """The samples named ``name`` (``..._total`` for a counter) in vLLM's /metrics text."""
    return [
        sample
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == name
    ]


def prometheus_value(metrics_text: str, name: str) -> float:
    """Sum of a metric's samples in vLLM's /metrics text."""
    return sum(sample.value for sample in prometheus_samples(metrics_text, name))


def requests_ended_on_their_own(metrics_text: str) -> dict[str, int]:
    """vLLM's ``vllm:request_success_total`` by finish reason. vLLM counts a request
    there only when the engine ends it; a client's abort is not among them."""
    counts: dict[str, int] = {}
    for sample in prometheus_samples(metrics_text, "vllm:request_success_total"):
        reason = sample.labels["finished_reason"]
        counts[reason] = counts.get(reason, 0) + int(sample.value)
    return {reason: count for reason, count in counts.items() if count}


def prefix_cache_hit_ratio(metrics_text: str) -> float | None:
    """vLLM's own prefix-cache hit ratio: ``vllm:prefix_cache_hits_total`` over its queries."""
    hits, queries = (
        sum(sample.value for sample in prometheus_samples(metrics_text, name))
        for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    )
    return hits / queries if queries else None
