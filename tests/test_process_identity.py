"""Every exported resource says which vLLM process it came from."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest

from otel_kvcache import names
from otel_kvcache.resource import PROCESS_ENVIRONMENT_VARIABLE, role_of_process

from test_instrumentor import OPENTELEMETRY_INSTRUMENT


@pytest.mark.parametrize(
    ("process_name", "expected"),
    [
        ("EngineCore", {names.PROCESS_ROLE: "engine_core", names.ENGINE_INDEX: 0}),
        ("EngineCore_DP3", {names.PROCESS_ROLE: "engine_core", names.ENGINE_INDEX: 3}),
        ("VllmWorker-2", {names.PROCESS_ROLE: "worker", names.WORKER_RANK: 2}),
        ("Process-1", None),
    ],
)
def test_vllms_process_names_map_to_roles(process_name, expected):
    assert role_of_process(process_name) == expected


def _report_environment(queue):
    queue.put(os.environ.get(PROCESS_ENVIRONMENT_VARIABLE))


def test_a_spawned_engine_core_is_told_its_role_and_the_parent_keeps_its_environment(telemetry, monkeypatch):
    monkeypatch.delenv(PROCESS_ENVIRONMENT_VARIABLE, raising=False)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_report_environment, args=(queue,), name="EngineCore_DP1")
    child.start()
    handed_down = queue.get(timeout=60)
    child.join(60)
    assert json.loads(handed_down) == {names.PROCESS_ROLE: "engine_core", names.ENGINE_INDEX: 1}
    assert PROCESS_ENVIRONMENT_VARIABLE not in os.environ

    # A worker started by that engine keeps the engine's index and adds its rank.
    monkeypatch.setenv(PROCESS_ENVIRONMENT_VARIABLE, handed_down)
    worker = context.Process(target=_report_environment, args=(queue,), name="VllmWorker-0")
    worker.start()
    assert json.loads(queue.get(timeout=60)) == {
        names.PROCESS_ROLE: "worker", names.ENGINE_INDEX: 1, names.WORKER_RANK: 0
    }
    worker.join(60)
    assert os.environ[PROCESS_ENVIRONMENT_VARIABLE] == handed_down


def _resource_under_opentelemetry_instrument(env: dict[str, str]) -> dict:
    code = textwrap.dedent(
        """
        import json, os
        from opentelemetry import trace
        attributes = dict(trace.get_tracer_provider().resource.attributes)
        print(json.dumps({"resource": attributes, "pid": os.getpid(),
                          "exporter": os.environ.get("OTEL_TRACES_EXPORTER")}))
        """
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    environment.update({"OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none", **env})
    result = subprocess.run(
        [OPENTELEMETRY_INSTRUMENT, sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120, env=environment,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_distro_configures_otlp_and_names_the_service_and_process():
    seen = _resource_under_opentelemetry_instrument({})
    assert seen["exporter"] == "otlp"  # pip install otel-kvcache is all opentelemetry-instrument needs
    assert seen["resource"]["service.name"] == "vllm"
    assert seen["resource"]["process.pid"] == seen["pid"]


def test_the_users_variables_win_and_a_handed_down_role_is_typed():
    handed_down = json.dumps({names.PROCESS_ROLE: "engine_core", names.ENGINE_INDEX: 2})
    seen = _resource_under_opentelemetry_instrument(
        {"OTEL_SERVICE_NAME": "chat-backend", "OTEL_TRACES_EXPORTER": "console", PROCESS_ENVIRONMENT_VARIABLE: handed_down}
    )
    assert seen["exporter"] == "console"
    assert seen["resource"]["service.name"] == "chat-backend"
    assert seen["resource"][names.PROCESS_ROLE] == "engine_core"
    assert seen["resource"][names.ENGINE_INDEX] == 2
