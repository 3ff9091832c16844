"""The GPU and allocator views, beside the KV view: what nvidia-smi sees and what torch holds.

A separate instrumentor (entry point ``vllm_gpu``), so that
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=vllm_gpu`` turns it off alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_kvcache.gpu.instrumentor import VLLMGPUInstrumentor

__all__ = ["VLLMGPUInstrumentor"]


def __getattr__(name: str) -> Any:
    # Imported when first named: ``otel-kvcache top`` reads NVML without the instrumentor.
    if name == "VLLMGPUInstrumentor":
        from otel_kvcache.gpu.instrumentor import VLLMGPUInstrumentor

        return VLLMGPUInstrumentor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
