"""Every exported resource says which vLLM process it came from."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest

from otel_kvcache import config, names
from otel_kvcache.process_identity import PROCESS_ENVIRONMENT_VARIABLE
from otel_kvcache.wiring.resource import role_of_process

from test_instrumentor import OPENTELEMETRY_INSTRUMENT


@pytest.mark.parametrize(
    ("process_name", "expected"),
    [
        ("EngineCore", {names.PROCESS_ROLE: "engine_core", names.ENGINE_INDEX: 0}),
        ("EngineCore_DP3", {names.PROCESS_ROLE: "engine_core", names.ENGINE_INDEX: 3}),
        ("VllmWorker-2", {names.PROCESS_ROLE: "worker", names.WORKER_RANK: 2}),
        ("VLLM_DP_Coordinator", {names.PROCESS_ROLE: "dp_coordinator"}),
        ("ApiServer_1", {names.PROCESS_ROLE: "api_server", names.API_SERVER_INDEX: 1}),
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


def _instrument_and_report(queue):
    """In a child vLLM started: instrument as under opentelemetry-instrument (spans from a
    helper), then say whether this process made a helpers' lock of its own, whether it
    reports the devices, and what its parent handed down."""
    import tempfile

    from otel_kvcache.gpu.instrumentor import reports_devices
    from otel_kvcache.wiring.instrumentor import VLLMKVCacheInstrumentor

    os.environ["OTEL_KVCACHE_EXPORTER_PROCESS"] = "on"
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument()
    own_lock = os.path.join(tempfile.gettempdir(), f"otel-kvcache-helpers-{os.getpid()}.lock")
    queue.put((os.path.exists(own_lock), reports_devices(), os.environ.get(PROCESS_ENVIRONMENT_VARIABLE)))
    instrumentor.uninstrument()


@pytest.mark.parametrize(
    ("process_name", "role"),
    [("VLLM_DP_Coordinator", {names.PROCESS_ROLE: "dp_coordinator"}),
     ("ApiServer_1", {names.PROCESS_ROLE: "api_server", names.API_SERVER_INDEX: 1})],
)  # fmt: skip
def test_the_processes_vllm_starts_beside_its_engines_have_a_role_and_leave_no_lock(
    telemetry, monkeypatch, process_name, role
):
    """vLLM's DP coordinator and its extra API servers (the names vLLM gives them): each is
    told its role, reports no devices (its first process does), and makes no lock file of
    its own (vLLM kills them before their exit handlers run)."""
    monkeypatch.delenv(PROCESS_ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.delenv(config.DEVICE_METRICS, raising=False)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_instrument_and_report, args=(queue,), name=process_name)
    child.start()
    made_a_lock, reports_devices, handed_down = queue.get(timeout=120)
    child.join(60)
    assert json.loads(handed_down) == role
    assert not made_a_lock and not reports_devices


def _resource_under_opentelemetry_instrument(env: dict[str, str], code: str | None = None) -> dict:
    code = code or textwrap.dedent(
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


def test_the_resource_tracker_started_beside_an_engine_core_is_not_an_engine(tmp_path):
    """The first spawn starts multiprocessing's resource tracker with the EngineCore's
    attributes in the environment; the tracker is not vLLM's and takes no role, and it is
    not vLLM's first process either (it made a helpers' lock that outlived it: a data
    parallel server, 2026-12-07)."""
    code = textwrap.dedent(
        """
        import json, multiprocessing, os
        from multiprocessing import resource_tracker

        def engine_core():
            pass

        if __name__ == "__main__":
            process = multiprocessing.get_context("spawn").Process(target=engine_core, name="EngineCore_DP0")
            process.start()
            process.join()
            with open(f"/proc/{resource_tracker._resource_tracker._pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\\0")[:-1]
            with open(f"/proc/{resource_tracker._resource_tracker._pid}/environ", "rb") as f:
                environ = dict(v.split("=", 1) for v in f.read().decode().split("\\0") if "=" in v)
            print(json.dumps({"argv": argv, "handed_down": environ.get("OTEL_KVCACHE_VLLM_PROCESS")}))
        """
    )
    (tmp_path / "engine.py").write_text(code)
    environment = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                   "OTEL_LOGS_EXPORTER": "none"}
    environment.pop(PROCESS_ENVIRONMENT_VARIABLE, None)
    result = subprocess.run([OPENTELEMETRY_INSTRUMENT, sys.executable, str(tmp_path / "engine.py")],
                            capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr
    tracker = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads(tracker["handed_down"])[names.PROCESS_ROLE] == "engine_core"  # what it inherited

    # That process's own command line, run as it ran, with what it inherited: no role.
    *_, program = tracker["argv"]
    probe = program.split(";")[0] + textwrap.dedent(
        """
        import json, os, tempfile
        from opentelemetry import trace
        from otel_kvcache.gpu.instrumentor import reports_devices
        lock = os.path.join(tempfile.gettempdir(), f"otel-kvcache-helpers-{os.getpid()}.lock")
        print(json.dumps({"resource": dict(trace.get_tracer_provider().resource.attributes),
                          "pid": os.getpid(), "exporter": None,
                          "made_a_lock": os.path.exists(lock), "reports_devices": reports_devices()}))
        """
    )
    seen = _resource_under_opentelemetry_instrument(
        {PROCESS_ENVIRONMENT_VARIABLE: tracker["handed_down"], "OTEL_KVCACHE_EXPORTER_PROCESS": "on"}, code=probe
    )
    assert names.PROCESS_ROLE not in seen["resource"] and names.ENGINE_INDEX not in seen["resource"]
    assert seen["resource"]["service.name"] == "vllm"
    # Nor is it vLLM's first process: it waits for no helpers and reports no devices.
    assert not seen["made_a_lock"] and not seen["reports_devices"]
