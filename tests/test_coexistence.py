"""Another instrumentation's wrappers on the methods we hook: both keep working, in either order."""

from __future__ import annotations

import functools
import importlib

import pytest
import wrapt
from opentelemetry.instrumentation.utils import unwrap

from conftest import Telemetry
from engine_harness import busy_run_decisions
from otel_kvcache import VLLMKVCacheInstrumentor, names
from otel_kvcache.vllm_compat.hook_points import hook_points_of

HOT_POINTS = [p for p in hook_points_of() if p.hot]


def _owner(point):
    return getattr(importlib.import_module(point.module), point.owner)


class OtherInstrumentation:
    """A wrapt wrapper on every hot hook point that reads ``instance``, as a profiler or
    another tracer would; it raises (inside vLLM's loop) if handed the wrong one."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def wrap(self) -> None:
        for point in HOT_POINTS:
            wrapt.wrap_function_wrapper(point.module, point.qualname, functools.partial(self._wrapper, point))

    def unwrap(self) -> None:
        for point in HOT_POINTS:
            unwrap(_owner(point), point.method)

    def _wrapper(self, point, wrapped, instance, args, kwargs):
        if not isinstance(instance, _owner(point)):
            raise TypeError(f"{point.qualname} wrapper got instance={instance!r}")
        self.calls[point.qualname] = self.calls.get(point.qualname, 0) + 1
        return wrapped(*args, **kwargs)


def _instrument(telemetry: Telemetry) -> VLLMKVCacheInstrumentor:
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    return instrumentor


@pytest.mark.parametrize("ours_first", [False, True], ids=["theirs-first", "ours-first"])
def test_another_wrapt_wrapper_sees_its_instance_and_vllm_decides_the_same(model_config, ours_first):
    vllms_own = {p: _owner(p).__dict__[p.method] for p in HOT_POINTS}
    baseline = busy_run_decisions(model_config)
    other, telemetry = OtherInstrumentation(), Telemetry()
    if ours_first:
        instrumentor = _instrument(telemetry)
        other.wrap()
    else:
        other.wrap()
        theirs = {p: _owner(p).__dict__[p.method] for p in HOT_POINTS}
        instrumentor = _instrument(telemetry)
    try:
        both = busy_run_decisions(model_config)
    finally:
        instrumentor.uninstrument()

    assert both == baseline
    # Both did their work: vLLM's scheduler went through the other wrappers, and every
    # request of the run got its span, with no error of ours.
    assert {"Scheduler.schedule", "Scheduler._free_blocks", "Scheduler._preempt_request",
            "FreeKVCacheBlockQueue.append_n", "BlockPool.touch"} <= set(other.calls)
    assert len(telemetry.kv_spans()) == 6
    assert telemetry.total(names.INSTRUMENTATION_ERRORS) == 0

    # Our uninstrument takes out our layer only: the other wrappers stay, around vLLM's own.
    for point in HOT_POINTS:
        current = _owner(point).__dict__[point.method]
        if ours_first:
            assert isinstance(current, wrapt.FunctionWrapper) and current.__wrapped__ is vllms_own[point]
        else:
            assert current is theirs[point]
    calls = dict(other.calls)
    assert busy_run_decisions(model_config) == baseline
    assert all(other.calls[name] > calls[name] for name in calls)
    other.unwrap()
    assert {p: _owner(p).__dict__[p.method] for p in HOT_POINTS} == vllms_own


def test_a_functools_wraps_closure_keeps_being_called_with_its_instance(model_config):
    """Another patcher's plain closure (not a descriptor of its own) is called as vLLM calls it."""
    point = next(p for p in HOT_POINTS if p.qualname == "Scheduler.schedule")
    owner, original = _owner(point), _owner(point).__dict__[point.method]
    seen = []

    @functools.wraps(original)
    def patched(self, *args, **kwargs):
        seen.append(type(self).__name__)
        return original(self, *args, **kwargs)

    baseline = busy_run_decisions(model_config)
    owner.schedule = patched
    telemetry = Telemetry()
    instrumentor = _instrument(telemetry)
    try:
        assert busy_run_decisions(model_config) == baseline
    finally:
        instrumentor.uninstrument()
        restored = owner.__dict__["schedule"]
        owner.schedule = original
    assert restored is patched
    assert seen and set(seen) == {"Scheduler"}
    assert len(telemetry.kv_spans()) == 6
