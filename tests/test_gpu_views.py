"""The GPU (NVML) and allocator (torch) views, against fakes that behave like the real modules."""

from __future__ import annotations

import logging
import os
import time
from importlib.metadata import entry_points

import pynvml
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_kvcache import config, names
from otel_kvcache.gpu import VLLMGPUInstrumentor
from otel_kvcache.gpu import instrumentor as gpu_instrumentor
from otel_kvcache.process_identity import PROCESS_ENVIRONMENT_VARIABLE

from gpu_fakes import FakeNVML, FakeTorchCuda, load_readings

READINGS = load_readings()


class GPUTelemetry:
    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])

    def points(self) -> dict[str, list]:
        data = self.reader.get_metrics_data()
        found: dict[str, list] = {}
        for resource_metrics in data.resource_metrics if data else ():
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    found.setdefault(metric.name, []).extend(metric.data.data_points)
        return found


@pytest.fixture
def gpu(monkeypatch):
    """Instruments with fakes; yields (telemetry, fake NVML, instrument function)."""
    monkeypatch.delenv(PROCESS_ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.delenv(config.DEVICE_METRICS, raising=False)
    telemetry = GPUTelemetry()
    instrumentor = VLLMGPUInstrumentor()

    def instrument(nvml=None, torch_cuda="recorded"):
        nvml = nvml or FakeNVML(READINGS["nvml"])
        cuda = FakeTorchCuda(READINGS["torch"]) if torch_cuda == "recorded" else torch_cuda
        instrumentor.instrument(meter_provider=telemetry.provider, nvml=nvml, torch_cuda=cuda)
        return nvml

    yield telemetry, instrument
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()


def _by_device(points) -> dict[str, float]:
    return {p.attributes[names.HW_ID_ATTRIBUTE]: p.value for p in points}


def test_devices_processes_and_allocator_as_recorded(gpu):
    telemetry, instrument = gpu
    instrument()
    got = telemetry.points()
    devices = READINGS["nvml"]["devices"]
    assert _by_device(got[names.GPU_MEMORY_USAGE]) == {d["uuid"]: d["memory"]["used"] for d in devices}
    assert _by_device(got[names.GPU_MEMORY_LIMIT]) == {d["uuid"]: d["memory"]["total"] for d in devices}
    assert _by_device(got[names.GPU_UTILIZATION]) == {d["uuid"]: d["utilization"]["gpu"] / 100 for d in devices}
    assert _by_device(got[names.GPU_MEMORY_UTILIZATION]) == {
        d["uuid"]: d["utilization"]["memory"] / 100 for d in devices
    }
    first = got[names.GPU_MEMORY_USAGE][0].attributes
    assert first[names.HW_TYPE_ATTRIBUTE] == "gpu"
    assert first[names.HW_NAME_ATTRIBUTE] == "NVIDIA H200"
    assert first[names.HW_VENDOR_ATTRIBUTE] == "NVIDIA"

    # Only this process's own NVML entry, on the device that has one.
    [process] = got[names.GPU_PROCESS_MEMORY_USAGE]
    assert process.attributes == {names.PROCESS_PID_ATTRIBUTE: os.getpid(), names.HW_ID_ATTRIBUTE: devices[0]["uuid"]}
    assert process.value == devices[0]["processes"][0]["usedGpuMemory"]

    stats = READINGS["torch"]["memory_stats"]
    [allocated] = got[names.TORCH_MEMORY_ALLOCATED]
    [reserved] = got[names.TORCH_MEMORY_RESERVED]
    [gap] = got[names.TORCH_MEMORY_GAP]
    assert allocated.value == stats["allocated_bytes.all.current"]
    assert reserved.value == stats["reserved_bytes.all.current"]
    assert gap.value == reserved.value - allocated.value
    assert got[names.TORCH_ALLOC_RETRIES][0].value == stats["num_alloc_retries"]
    assert got[names.TORCH_OOMS][0].value == stats["num_ooms"]
    # The allocator's device is the NVML device: the two views join on hw.id.
    assert allocated.attributes[names.HW_ID_ATTRIBUTE] == devices[0]["uuid"]
    assert allocated.attributes[names.TORCH_DEVICE] == READINGS["torch"]["device"]


def test_nvml_is_initialised_once_handles_are_cached_and_shutdown_on_uninstrument(gpu):
    telemetry, instrument = gpu
    nvml = instrument()
    for _ in range(3):
        telemetry.points()  # one NVML read serves all the gauges of a collection
        time.sleep(gpu_instrumentor.READING_TTL_SECONDS + 0.05)
    assert nvml.initialized == 1
    assert nvml.calls.count("nvmlDeviceGetHandleByIndex") == len(READINGS["nvml"]["devices"])
    assert nvml.calls.count("nvmlDeviceGetUUID") == len(READINGS["nvml"]["devices"])
    assert nvml.calls.count("nvmlDeviceGetMemoryInfo") == 3 * len(READINGS["nvml"]["devices"])
    VLLMGPUInstrumentor().uninstrument()
    assert nvml.shutdowns == 1 and nvml.initialized == 0
    got = telemetry.points()
    assert not any(p for name, p in got.items() if name.startswith(("hw.gpu", "vllm.gpu", "vllm.torch")))


def test_a_field_the_device_lacks_is_left_out_and_logged_once(gpu, caplog):
    telemetry, instrument = gpu
    instrument(FakeNVML(READINGS["nvml"], fail={"nvmlDeviceGetUtilizationRates": pynvml.NVML_ERROR_NOT_SUPPORTED}))
    with caplog.at_level(logging.INFO, logger="otel_kvcache"):
        for _ in range(3):
            got = telemetry.points()
    assert names.GPU_UTILIZATION not in got and names.GPU_MEMORY_UTILIZATION not in got
    assert len(got[names.GPU_MEMORY_USAGE]) == 2  # the rest still reports
    messages = [r.getMessage() for r in caplog.records if "utilization" in r.getMessage()]
    assert len(messages) == 1 and "Not Supported" in messages[0]


def test_no_driver_and_no_cuda_mean_no_values_not_zeros(gpu, caplog):
    telemetry, instrument = gpu
    with caplog.at_level(logging.INFO, logger="otel_kvcache"):
        instrument(FakeNVML(READINGS["nvml"], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), torch_cuda=None)
        got = telemetry.points()
        telemetry.points()
    # torch_cuda=None reads the real torch here: the CPU build, no CUDA.
    assert not any(p for name, p in got.items() if name.startswith(("hw.gpu", "vllm.gpu", "vllm.torch")))
    assert len([r for r in caplog.records if "NVML is not available" in r.getMessage()]) == 1


def test_a_process_where_torch_has_not_initialised_cuda_reports_no_allocator(gpu):
    telemetry, instrument = gpu
    instrument(torch_cuda=FakeTorchCuda(READINGS["torch"], initialized=False))
    got = telemetry.points()
    assert names.TORCH_MEMORY_RESERVED not in got
    assert names.GPU_MEMORY_USAGE in got


@pytest.mark.parametrize(
    ("role", "setting", "devices_reported"),
    [
        (None, None, True),  # the API server, or a process vLLM did not start
        ("worker", None, False),  # one report per instance, not one per process
        ("api_server", None, False),  # one of the API servers vLLM started (--api-server-count)
        ("dp_coordinator", None, False),
        ("engine_core", "always", True),
        (None, "never", False),
    ],
)
def test_device_metrics_come_from_one_process(gpu, monkeypatch, role, setting, devices_reported):
    telemetry, instrument = gpu
    if role:
        monkeypatch.setenv(PROCESS_ENVIRONMENT_VARIABLE, f'{{"vllm.process.role": "{role}"}}')
    if setting:
        monkeypatch.setenv(config.DEVICE_METRICS, setting)
    instrument()
    got = telemetry.points()
    assert (names.GPU_MEMORY_USAGE in got) is devices_reported
    assert names.GPU_PROCESS_MEMORY_USAGE in got


def test_a_bad_setting_names_the_variable_and_the_value_used(gpu, monkeypatch, caplog):
    telemetry, instrument = gpu
    monkeypatch.setenv(config.DEVICE_METRICS, "sometimes")
    with caplog.at_level(logging.WARNING, logger="otel_kvcache"):
        instrument()
    [message] = [r.getMessage() for r in caplog.records]
    assert "OTEL_KVCACHE_GPU_DEVICE_METRICS='sometimes'" in message and "using 'auto'" in message
    assert names.GPU_MEMORY_USAGE in telemetry.points()


def test_the_gpu_view_has_its_own_entry_point():
    instrumentors = {ep.name: ep.value for ep in entry_points(group="opentelemetry_instrumentor")}
    assert instrumentors["vllm_gpu"] == "otel_kvcache.gpu:VLLMGPUInstrumentor"
    assert instrumentors["vllm_kvcache"] == "otel_kvcache:VLLMKVCacheInstrumentor"
