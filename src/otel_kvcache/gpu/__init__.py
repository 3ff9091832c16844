"""The GPU and allocator views, beside the KV view: what nvidia-smi sees and what torch holds.

A separate instrumentor (entry point ``vllm_gpu``), so that
``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=vllm_gpu`` turns it off alone.
"""

from otel_kvcache.gpu.instrumentor import VLLMGPUInstrumentor

__all__ = ["VLLMGPUInstrumentor"]
