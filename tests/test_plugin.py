"""vLLM's general-plugin entry point: telemetry without opentelemetry-instrument, once, or not at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from test_instrumentor import OPENTELEMETRY_INSTRUMENT

pytestmark = pytest.mark.slow  # each starts a process that imports vLLM

# What one of vLLM's processes does first: load its general plugins (vllm.plugins).
PROBE = textwrap.dedent(
    """
    import json
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from opentelemetry import trace
    from opentelemetry.trace import ProxyTracerProvider
    from otel_kvcache import VLLMKVCacheInstrumentor
    import vllm.v1.core.sched.scheduler as scheduler
    print("PROBE " + json.dumps({
        "sdk_configured": not isinstance(trace.get_tracer_provider(), ProxyTracerProvider),
        "instrumented": VLLMKVCacheInstrumentor().is_instrumented_by_opentelemetry,
        "schedule_wrapped": hasattr(scheduler.Scheduler.__dict__["schedule"], "__wrapped__"),
        "wrapped_twice": hasattr(getattr(scheduler.Scheduler.__dict__["schedule"], "__wrapped__", None),
                                 "__wrapped__"),
    }))
    """
)


def _probe(env: dict[str, str], *prefix: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environment.update({"OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                        "VLLM_CONFIGURE_LOGGING": "0", **env})
    environment.pop("PYTHONPATH", None)
    result = subprocess.run([*prefix, sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                            env={k: v for k, v in environment.items() if v is not None})
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("PROBE ")]
    return json.loads(line.removeprefix("PROBE "))


def test_vllm_finds_the_plugin():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins["otel_kvcache"] == "otel_kvcache.wiring.plugin:register"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_METRICS_EXPORTER": None}, True),
        ({}, False),  # nothing asks for telemetry
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_KVCACHE_VLLM_PLUGIN": "off"}, False),  # the opt-out
    ],
    ids=["exporter", "endpoint", "nothing-set", "opted-out"],
)
def test_the_plugin_sets_up_the_sdk_and_instruments_when_asked(env, expected):
    seen = _probe(env)
    assert seen["sdk_configured"] is expected
    assert seen["instrumented"] is expected and seen["schedule_wrapped"] is expected


def test_under_opentelemetry_instrument_the_plugin_adds_nothing():
    seen = _probe({"OTEL_TRACES_EXPORTER": "console"}, OPENTELEMETRY_INSTRUMENT)
    assert seen["sdk_configured"] and seen["instrumented"] and seen["schedule_wrapped"]
    assert not seen["wrapped_twice"]
