"""PyTorch's CUDA caching allocator, read through an injectable ``torch.cuda``.

Only in a process where torch has already initialised CUDA (vLLM's workers):
this never imports torch nor initialises CUDA itself, so an API server stays
free of CUDA state and safe to fork.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from types import ModuleType

_logger = logging.getLogger(__name__)

ALLOCATED = "allocated_bytes.all.current"
RESERVED = "reserved_bytes.all.current"
RETRIES = "num_alloc_retries"
OOMS = "num_ooms"


@dataclass
class AllocatorReading:
    device: int
    hw_id: str
    allocated: int
    reserved: int
    alloc_retries: int
    ooms: int


class TorchAllocatorSource:
    def __init__(self, cuda: ModuleType | None = None) -> None:
        self._cuda = cuda
        self._hw_ids: dict[int, str] = {}
        self._logged = False

    def _torch_cuda(self) -> ModuleType | None:
        if self._cuda is not None:
            return self._cuda
        torch = sys.modules.get("torch")
        return getattr(torch, "cuda", None)

    def read(self) -> list[AllocatorReading]:
        cuda = self._torch_cuda()
        if cuda is None or not cuda.is_available() or not cuda.is_initialized():
            return []
        device = cuda.current_device()
        try:
            stats = cuda.memory_stats(device)
            if device not in self._hw_ids:
                self._hw_ids[device] = f"GPU-{cuda.get_device_properties(device).uuid}"
        except (RuntimeError, AssertionError) as exc:
            if not self._logged:
                self._logged = True
                _logger.info("otel-kvcache: no allocator metrics: torch.cuda says %s", exc)
            return []
        if ALLOCATED not in stats:  # the allocator has not been used yet
            return []
        return [
            AllocatorReading(
                device=device,
                hw_id=self._hw_ids[device],
                allocated=stats[ALLOCATED],
                reserved=stats[RESERVED],
                alloc_retries=stats.get(RETRIES, 0),
                ooms=stats.get(OOMS, 0),
            )
        ]
