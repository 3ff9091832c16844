"""The prepared GPU check: real NVML and a real torch CUDA allocation, against nvidia-smi and torch.

Run on an NVIDIA machine with torch (CUDA build), nvidia-ml-py and otel-kvcache:

    python scripts/gpu_check.py [--record FILE]

It allocates 1 GiB with torch, reads our gauges through an in-memory metric
reader, and compares them with ``nvidia-smi --query-gpu`` /
``--query-compute-apps`` and ``torch.cuda.memory_reserved()``. ``--record``
writes the readings in the shape of ``tests/data/gpu_h200_illustrative.json``,
for the tests' fakes. Exits non-zero if a comparison fails. A few minutes at most.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pynvml
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_kvcache import names
from otel_kvcache.gpu import VLLMGPUInstrumentor

MIB = 1024 * 1024
# nvidia-smi reports MiB and memory moves between two reads: allow a little.
TOLERANCE_BYTES = 64 * MIB


def nvidia_smi(query: str, fields: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.strip().splitlines()]


def points(reader: InMemoryMetricReader) -> dict[str, list]:
    found: dict[str, list] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def record(path: str) -> None:
    pynvml.nvmlInit()
    devices = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
        processes = [
            {"pid": "self" if p.pid == os.getpid() else p.pid, "usedGpuMemory": p.usedGpuMemory}
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        ]
        devices.append(
            {
                "uuid": pynvml.nvmlDeviceGetUUID(handle),
                "name": pynvml.nvmlDeviceGetName(handle),
                "memory": {"total": memory.total, "free": memory.free, "used": memory.used},
                "utilization": {"gpu": rates.gpu, "memory": rates.memory},
                "processes": processes,
            }
        )
    pynvml.nvmlShutdown()
    stats = torch.cuda.memory_stats(0)
    keep = ("allocated_bytes.all.current", "reserved_bytes.all.current", "num_alloc_retries", "num_ooms")
    readings = {
        "source": f"recorded by scripts/gpu_check.py on {devices[0]['name']}",
        "nvml": {"devices": devices},
        "torch": {
            "device": 0,
            "uuid": str(torch.cuda.get_device_properties(0).uuid),
            "memory_stats": {k: stats[k] for k in keep},
        },
    }
    with open(path, "w") as f:
        json.dump(readings, f, indent=2)
    print(f"recorded {path}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--record", help="also write the readings here (the tests' fake format)")
    args = parser.parse_args()

    tensor = torch.empty(1024 * MIB, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    reader = InMemoryMetricReader()
    VLLMGPUInstrumentor().instrument(meter_provider=MeterProvider(metric_readers=[reader]))
    got = points(reader)
    smi = {row[0]: (int(row[1]) * MIB, int(row[2]) * MIB) for row in nvidia_smi("gpu", "uuid,memory.used,memory.total")}
    apps = {(row[0], int(row[1])): int(row[2]) * MIB for row in nvidia_smi("compute-apps", "gpu_uuid,pid,used_memory")}

    failures = 0

    def check(label: str, ours: float, theirs: float, tolerance: float) -> None:
        nonlocal failures
        ok = abs(ours - theirs) <= tolerance
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {label}: ours {ours:.0f}, reference {theirs:.0f}")

    for point in got.get(names.GPU_MEMORY_USAGE, []):
        uuid = point.attributes[names.HW_ID_ATTRIBUTE]
        check(f"{uuid} memory used vs nvidia-smi", point.value, smi[uuid][0], TOLERANCE_BYTES)
    for point in got.get(names.GPU_MEMORY_LIMIT, []):
        uuid = point.attributes[names.HW_ID_ATTRIBUTE]
        check(f"{uuid} memory total vs nvidia-smi", point.value, smi[uuid][1], MIB)
    for point in got.get(names.GPU_PROCESS_MEMORY_USAGE, []):
        key = (point.attributes[names.HW_ID_ATTRIBUTE], point.attributes[names.PROCESS_PID_ATTRIBUTE])
        check(f"process {key[1]} memory vs nvidia-smi", point.value, apps[key], TOLERANCE_BYTES)
    [reserved] = got[names.TORCH_MEMORY_RESERVED]
    check("torch reserved vs torch.cuda.memory_reserved()", reserved.value, torch.cuda.memory_reserved(0), 0)
    [allocated] = got[names.TORCH_MEMORY_ALLOCATED]
    check("torch allocated vs torch.cuda.memory_allocated()", allocated.value, torch.cuda.memory_allocated(0), 0)
    check("allocator hw.id is an NVML device", allocated.attributes[names.HW_ID_ATTRIBUTE] in smi, True, 0)
    if args.record:
        record(args.record)
    del tensor
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
