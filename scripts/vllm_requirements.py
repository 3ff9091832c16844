"""Prints the requirements of the installed ``vllm`` (the CUDA wheel) that run on the CPU.

The CUDA wheel's scheduler and KV-cache manager are pure Python, so they run
here on the CPU torch (``VLLM_TARGET_DEVICE=cpu``); its GPU kernels, and the
torch it pins, are left out. Used by ``scripts/bootstrap.sh``, one requirement
a line.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

# The wheel's CUDA-only requirements, and torch's family (the CPU torch is installed apart).
GPU_ONLY = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer.*|apache-tvm-ffi|tilelang|"
    r"nvidia-.*|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels|numba|"
    r"cupy.*|xformers|triton.*|deep[-_]gemm|flash[-_]attn.*)$",
    re.IGNORECASE,
)


def main() -> int:
    for line in requires("vllm") or ():
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if GPU_ONLY.match(requirement.name):
            continue
        requirement.marker = None
        print(requirement)
    return 0


if __name__ == "__main__":
    sys.exit(main())
