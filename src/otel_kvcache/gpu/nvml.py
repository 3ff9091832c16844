"""NVML, read through an injectable ``pynvml`` module (nvidia-ml-py).

NVML is initialised lazily, once per process, on the first read; device
handles and static facts (UUID, name) are looked up once and cached. A value
NVML cannot give (no driver, a field the device lacks) is left out, never
reported as zero, and the reason is logged once per kind.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from types import ModuleType

_logger = logging.getLogger(__name__)


@dataclass
class DeviceReading:
    """One device at one instant; None where NVML had no value."""

    uuid: str
    name: str
    memory_used: int | None = None
    memory_total: int | None = None
    gpu_utilization: float | None = None  # 0..1
    memory_utilization: float | None = None  # 0..1
    process_memory: dict[int, int] = field(default_factory=dict)  # pid -> bytes


class NVMLSource:
    """Reads every GPU NVML sees."""

    def __init__(self, pynvml: ModuleType | None = None) -> None:
        self._pynvml = pynvml
        self._lock = threading.Lock()
        self._devices: list[tuple[object, str, str]] | None = None  # (handle, uuid, name)
        self._initialized = False
        self._unavailable = False
        self._logged: set[str] = set()

    def _log_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            _logger.info("otel-kvcache: " + message, *args)

    def _nvml(self) -> ModuleType | None:
        if self._pynvml is None:
            try:
                import pynvml  # noqa: PLC0415 - only when a GPU metric is first read
            except ImportError as exc:
                self._log_once("import", "no GPU metrics: pynvml (nvidia-ml-py) cannot be imported: %s", exc)
                return None
            self._pynvml = pynvml
        return self._pynvml

    def _ensure_devices(self) -> list[tuple[object, str, str]]:
        with self._lock:
            if self._devices is not None or self._unavailable:
                return self._devices or []
            nvml = self._nvml()
            if nvml is None:
                self._unavailable = True
                return []
            try:
                nvml.nvmlInit()
                self._initialized = True
                devices = []
                for index in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    devices.append((handle, nvml.nvmlDeviceGetUUID(handle), nvml.nvmlDeviceGetName(handle)))
            except nvml.NVMLError as exc:
                self._unavailable = True
                self._log_once("init", "no GPU metrics: NVML is not available here (%s)", exc)
                return []
            self._devices = devices
            return devices

    def read(self) -> list[DeviceReading]:
        devices = self._ensure_devices()
        if not devices:
            return []
        nvml = self._pynvml
        readings = []
        for handle, uuid, name in devices:
            reading = DeviceReading(uuid=uuid, name=name)
            memory = self._call("memory", nvml.nvmlDeviceGetMemoryInfo, handle)
            if memory is not None:
                reading.memory_used, reading.memory_total = memory.used, memory.total
            rates = self._call("utilization", nvml.nvmlDeviceGetUtilizationRates, handle)
            if rates is not None:
                reading.gpu_utilization, reading.memory_utilization = rates.gpu / 100, rates.memory / 100
            processes = self._call("processes", nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
            reading.process_memory = {p.pid: p.usedGpuMemory for p in processes if p.usedGpuMemory is not None}
            readings.append(reading)
        return readings

    def _call(self, kind: str, function, handle):
        try:
            return function(handle)
        except self._pynvml.NVMLError as exc:
            self._log_once(kind, "GPU %s not reported: NVML says %s", kind, exc)
            return None

    def shutdown(self) -> None:
        with self._lock:
            if self._initialized:
                try:
                    self._pynvml.nvmlShutdown()
                except self._pynvml.NVMLError:
                    pass
            self._initialized = False
            self._devices = None
            self._unavailable = False
