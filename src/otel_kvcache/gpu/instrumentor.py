"""``VLLMGPUInstrumentor``: NVML device and process memory, and torch's caching allocator.

Which process reports what:

- every process: the device memory NVML attributes to it
  (``vllm.gpu.process.memory.usage``, by ``process.pid`` and ``hw.id``);
- processes where torch has initialised CUDA (vLLM's workers): the caching
  allocator's allocated, reserved and unallocated bytes, retries and OOMs;
- one process per vLLM instance (its first process, the API server, or a
  process vLLM did not start): the devices themselves (``hw.gpu.*``), so
  they are not reported once per process. ``OTEL_KVCACHE_GPU_DEVICE_METRICS``
  = ``auto`` (that default), ``always`` or ``never`` overrides it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from opentelemetry.metrics import CallbackOptions, Observation, get_meter

from otel_kvcache import config, names
from otel_kvcache.gpu.allocator import AllocatorReading, TorchAllocatorSource
from otel_kvcache.gpu.nvml import DeviceReading, NVMLSource
from otel_kvcache.package import _instruments
from otel_kvcache.process_identity import handed_down_attributes, is_vllms_first_process
from otel_kvcache.version import __version__

_logger = logging.getLogger(__name__)

READING_TTL_SECONDS = 0.5  # one NVML read serves all the gauges of one collection


def reports_devices() -> bool:
    setting = config.device_metrics()
    if setting != "auto":
        return setting == "always"
    # vLLM's first process: its children all have a role handed down, the API servers and
    # the DP coordinator it starts too.
    return is_vllms_first_process()


class _CachedReader:
    """Serves one source reading to every callback of a collection; nothing once closed
    (the SDK cannot unregister a callback, so ``uninstrument()`` closes its readers)."""

    def __init__(self, read: Callable[[], list]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._at = -1.0
        self._value: list = []
        self.closed = False

    def __call__(self) -> list:
        with self._lock:
            if self.closed:
                return []
            now = time.monotonic()
            if now - self._at > READING_TTL_SECONDS:
                self._value, self._at = self._read(), now
            return self._value


def _device_attributes(device: DeviceReading) -> dict[str, str]:
    return {
        names.HW_ID_ATTRIBUTE: device.uuid,
        names.HW_TYPE_ATTRIBUTE: names.HW_TYPE_GPU,
        names.HW_NAME_ATTRIBUTE: device.name,
        names.HW_VENDOR_ATTRIBUTE: names.HW_VENDOR_NVIDIA,
    }


def _allocator_attributes(reading: AllocatorReading, rank: int | None) -> dict[str, Any]:
    attributes: dict[str, Any] = {names.HW_ID_ATTRIBUTE: reading.hw_id, names.TORCH_DEVICE: reading.device}
    if rank is not None:
        attributes[names.WORKER_RANK] = rank
    return attributes


class VLLMGPUInstrumentor(BaseInstrumentor):
    """Instruments the GPU (NVML) and torch's CUDA caching allocator.

    ``instrument(nvml=..., torch_cuda=...)`` takes the ``pynvml`` and
    ``torch.cuda`` modules to read, for tests; by default the installed ones.
    """

    _nvml: NVMLSource | None = None
    _readers: tuple[_CachedReader, ...] = ()

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _instrument(self, **kwargs: Any) -> None:
        meter = get_meter(names.METER_SCOPE, __version__, kwargs.get("meter_provider"))
        self._nvml = NVMLSource(kwargs.get("nvml"))
        devices = _CachedReader(self._nvml.read)
        allocator = _CachedReader(TorchAllocatorSource(kwargs.get("torch_cuda")).read)
        self._readers = (devices, allocator)
        pid = os.getpid()
        rank = handed_down_attributes().get(names.WORKER_RANK)

        def device_gauge(field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
            def observe(options: CallbackOptions) -> Iterable[Observation]:
                for device in devices():
                    value = getattr(device, field)
                    if value is not None:
                        yield Observation(value, _device_attributes(device))

            return observe

        def process_memory(options: CallbackOptions) -> Iterable[Observation]:
            for device in devices():
                used = device.process_memory.get(pid)
                if used is not None:
                    yield Observation(used, {names.PROCESS_PID_ATTRIBUTE: pid, names.HW_ID_ATTRIBUTE: device.uuid})

        def allocator_gauge(read: Callable[[AllocatorReading], int]):
            def observe(options: CallbackOptions) -> Iterable[Observation]:
                for reading in allocator():
                    yield Observation(read(reading), _allocator_attributes(reading, rank))

            return observe

        if reports_devices():
            for name, unit, field, description in (
                (names.GPU_MEMORY_USAGE, "By", "memory_used", "GPU memory in use (NVML)."),
                (names.GPU_MEMORY_LIMIT, "By", "memory_total", "GPU memory size (NVML)."),
                (names.GPU_UTILIZATION, "1", "gpu_utilization", "Share of time a kernel ran (NVML)."),
                (names.GPU_MEMORY_UTILIZATION, "1", "memory_utilization", "Share of time memory was busy (NVML)."),
            ):
                meter.create_observable_gauge(name, [device_gauge(field)], unit=unit, description=description)
        meter.create_observable_gauge(
            names.GPU_PROCESS_MEMORY_USAGE,
            [process_memory],
            unit="By",
            description="GPU memory NVML attributes to this process.",
        )
        for name, read, description in (
            (names.TORCH_MEMORY_ALLOCATED, lambda r: r.allocated, "Bytes in live tensors."),
            (names.TORCH_MEMORY_RESERVED, lambda r: r.reserved, "Bytes torch's caching allocator holds."),
            (names.TORCH_MEMORY_GAP, lambda r: r.reserved - r.allocated, "Reserved by torch, used by no tensor."),
        ):
            meter.create_observable_gauge(name, [allocator_gauge(read)], unit="By", description=description)
        meter.create_observable_counter(
            names.TORCH_ALLOC_RETRIES, [allocator_gauge(lambda r: r.alloc_retries)], unit="{retry}",
            description="cudaMalloc retries after torch freed its cache.",
        )  # fmt: skip
        meter.create_observable_counter(
            names.TORCH_OOMS, [allocator_gauge(lambda r: r.ooms)], unit="{oom}",
            description="Out-of-memory errors torch's allocator raised.",
        )  # fmt: skip

    def _uninstrument(self, **kwargs: Any) -> None:
        for reader in self._readers:
            reader.closed = True
        self._readers = ()
        if self._nvml is not None:
            self._nvml.shutdown()
            self._nvml = None
