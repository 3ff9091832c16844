"""Applies the hook-point table lazily: a module is patched when vLLM imports it.

``instrument()`` therefore never imports vLLM or torch itself.

Cold hook points get wrapt's ``FunctionWrapper``. Hot ones (the engine loop's,
called up to dozens of times a step) get a plain function built around the
original (``patch.py``): wrapt's proxy adds frames of its own to every call, and at
dozens of calls a step that alone would be most of the overhead budget
(``docs/overhead.md#hot-wrappers``).

Another tool may have wrapped a method before us, or wrap ours after us.
Whatever we find on the class is called as vLLM's ``self.method(...)`` would
call it (``as_vllm_calls_it``), and ``stop()`` takes out only our own layer.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from types import FunctionType, ModuleType
from typing import Any

import wrapt

from otel_kvcache.vllm_compat.hook_points import HookPoint
from otel_kvcache.vllm_compat.versions import installed_vllm_version

_logger = logging.getLogger(__name__)
_vllm_log = logging.getLogger("vllm.otel_kvcache")
"""A child of vLLM's logger: what vLLM offers us is reported in its log, where an operator looks."""

Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]
"""A wrapt wrapper: ``wrapper(wrapped, instance, args, kwargs)``, put on a cold hook point."""

# Every wrapt proxy's base class (wrapt 2 put ``BaseObjectProxy`` under ``ObjectProxy``).
_WRAPT_PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


def as_vllm_calls_it(original: object) -> Callable[..., Any]:
    """``original`` as a function taking the instance first, called the way vLLM's
    ``self.method(...)`` calls the class attribute: a plain function (``functools.wraps``
    closures included) is that already; anything else, such as wrapt's
    ``FunctionWrapper`` (which passes ``isinstance(..., FunctionType)``), is bound
    through its own ``__get__`` at every call, so that it sees the right instance."""
    if type(original) is FunctionType:
        return original
    bind = getattr(type(original), "__get__", None)
    if bind is None:  # a callable object on the class is called without the instance

        def call_unbound(self, *args, **kwargs):
            return original(*args, **kwargs)

        return call_unbound

    @functools.wraps(original)  # keeps vLLM's parameters visible (signatures.method_like)
    def call_bound(self, *args, **kwargs):
        return bind(original, self, type(self))(*args, **kwargs)

    return call_bound


def _unwrap_beneath(current: object, ours: object, original: object) -> bool:
    """Takes ``ours`` out from under wrapt proxies stacked on it later; False if
    something else is in the way (a closure keeps what it wrapped)."""
    layer = current
    while issubclass(type(layer), _WRAPT_PROXY):
        inner = layer.__wrapped__
        if inner is ours:
            layer.__wrapped__ = original  # wrapt proxies let the wrapped object be replaced
            return True
        layer = inner
    return False


class LazyPatcher:
    """Wraps each hook point once its module is imported; ``stop()`` undoes it all."""

    def __init__(self, hook_points: Iterable[HookPoint], factories: dict[str, Callable[[str], Wrapper]]) -> None:
        self._by_module: dict[str, list[HookPoint]] = {}
        installed = installed_vllm_version()
        for point in hook_points:
            if point.applies_to(installed):
                self._by_module.setdefault(point.module, []).append(point)
        self._factories = factories
        self._patched: list[tuple[type, str, object, object]] = []
        """(owner, method, what was there, ours) for each hook point patched."""
        self._active = False

    def start(self) -> None:
        self._active = True
        for module_name in self._by_module:
            # Runs at once if the module is already imported. wrapt cannot
            # unregister a hook, so a stopped patcher's hooks do nothing.
            wrapt.register_post_import_hook(self._patch_module, module_name)

    def stop(self) -> None:
        self._active = False
        for owner, method, original, ours in reversed(self._patched):
            current = owner.__dict__.get(method)
            if current is ours:
                # Put back the class attribute itself: a staticmethod stays one.
                setattr(owner, method, original)
            elif not _unwrap_beneath(current, ours, original):
                _logger.warning(
                    "otel-kvcache: %s.%s was wrapped again after otel-kvcache by %r, which cannot be "
                    "unwrapped; otel-kvcache's wrapper stays inside it",
                    owner.__qualname__,
                    method,
                    current,
                )
        self._patched.clear()

    def _patch_module(self, module: ModuleType) -> None:
        if not self._active:
            return
        for point in self._by_module.get(module.__name__, ()):
            owner = getattr(module, point.owner, None)
            if owner is None or not callable(getattr(owner, point.method, None)):
                # Each engine's start-up line names every missing hook point (``survey.py``):
                # only the one that builds the engine, and so that line, warns here.
                _vllm_log.log(
                    logging.WARNING if point.role == "scheduler_init" else logging.DEBUG,
                    "otel-kvcache: vLLM %s has no %s in %s (verified on vLLM %s); not recorded: %s",
                    installed_vllm_version(),
                    point.qualname,
                    point.module,
                    ", ".join(point.verified_on),
                    point.feeds,
                )
                continue
            original = owner.__dict__.get(point.method)
            if original is None:
                _logger.warning("otel-kvcache: %s is inherited, not hooked", point.qualname)
                continue
            try:
                factory = self._factories[point.role](point.qualname)
                if point.hot:
                    method = factory(as_vllm_calls_it(original))
                    setattr(owner, point.method, functools.wraps(original)(method))
                else:
                    wrapt.wrap_function_wrapper(owner, point.method, factory)
            except Exception:  # noqa: BLE001 - an import of vLLM must never fail because of us
                _logger.warning("otel-kvcache: could not hook %s", point.qualname, exc_info=True)
                continue
            self._patched.append((owner, point.method, original, owner.__dict__[point.method]))

