"""Stand-ins for ``pynvml`` and ``torch.cuda`` that behave like the real modules.

Same call names, the same return structures (pynvml's own ctypes structures
and friendly objects) and the same error classes (pynvml's NVMLError
subclasses, torch's RuntimeError), fed from a JSON file of readings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pynvml

DATA = Path(__file__).parent / "data"


def load_readings(name: str = "gpu_h200_illustrative.json") -> dict:
    return json.loads((DATA / name).read_text())


class FakeNVML:
    """The subset of the ``pynvml`` module otel-kvcache calls, over recorded readings."""

    NVMLError = pynvml.NVMLError

    def __init__(self, readings: dict, fail: dict[str, int] | None = None, init_error: int | None = None) -> None:
        self._devices = readings["devices"]
        self._fail = fail or {}  # call name -> NVML error code it raises
        self._init_error = init_error
        self.initialized = 0
        self.shutdowns = 0
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if not self.initialized:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if name in self._fail:
            raise pynvml.NVMLError(self._fail[name])

    def nvmlInit(self):
        if self._init_error is not None:
            raise pynvml.NVMLError(self._init_error)
        self.initialized += 1

    def nvmlShutdown(self):
        self._call("nvmlShutdown")
        self.initialized -= 1
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        self._call("nvmlDeviceGetCount")
        return len(self._devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._call("nvmlDeviceGetHandleByIndex")
        return SimpleNamespace(index=index)  # an opaque handle, as pynvml's pointer is

    def nvmlDeviceGetUUID(self, handle):
        self._call("nvmlDeviceGetUUID")
        return self._devices[handle.index]["uuid"]

    def nvmlDeviceGetName(self, handle):
        self._call("nvmlDeviceGetName")
        return self._devices[handle.index]["name"]

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._call("nvmlDeviceGetMemoryInfo")
        return pynvml.c_nvmlMemory_t(**self._devices[handle.index]["memory"])

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._call("nvmlDeviceGetUtilizationRates")
        return pynvml.c_nvmlUtilization_t(**self._devices[handle.index]["utilization"])

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._call("nvmlDeviceGetComputeRunningProcesses")
        processes = []
        for recorded in self._devices[handle.index]["processes"]:
            pid = os.getpid() if recorded["pid"] == "self" else recorded["pid"]
            info = pynvml.c_nvmlProcessInfo_v3_t(pid=pid, usedGpuMemory=recorded["usedGpuMemory"])
            processes.append(pynvml.nvmlStructToFriendlyObject(info))
        return processes


class FakeTorchCuda:
    """The subset of ``torch.cuda`` otel-kvcache calls, over recorded readings."""

    def __init__(self, readings: dict | None, initialized: bool = True) -> None:
        self._readings = readings
        self._initialized = initialized

    def is_available(self) -> bool:
        return self._readings is not None

    def is_initialized(self) -> bool:
        return self._initialized

    def current_device(self) -> int:
        return self._readings["device"]

    def memory_stats(self, device=None) -> dict:
        return dict(self._readings["memory_stats"])

    def get_device_properties(self, device):
        return SimpleNamespace(uuid=self._readings["uuid"], name="NVIDIA H200")
