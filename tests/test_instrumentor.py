"""Instrumentor wiring: lazy patching, uninstrument, the hook table, the entry point."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import wrapt

from otel_kvcache import VLLMKVCacheInstrumentor
from otel_kvcache.vllm_compat.hook_points import HookPoint, hook_points_of
from otel_kvcache.wiring.hooks import LazyPatcher

HOOK_POINTS = hook_points_of()  # those of the installed vLLM


# The console script of the environment running the tests, activated or not.
OPENTELEMETRY_INSTRUMENT = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")


def _current(point: HookPoint):
    owner = getattr(importlib.import_module(point.module), point.owner)
    return owner.__dict__[point.method]


def _run_python(code: str, *prefix: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # vLLM's own logging goes to stdout (some releases warn at import); left to Python's, it goes to stderr.
    environment = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none",
                   "OTEL_LOGS_EXPORTER": "none", "VLLM_CONFIGURE_LOGGING": "0", **(env or {})}
    return subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, env=environment,
    )


def test_every_hook_point_exists_in_the_installed_vllm():
    for point in HOOK_POINTS:
        assert callable(_current(point)), point.qualname


def test_uninstrument_restores_every_patched_callable(telemetry):
    # The telemetry fixture instrumented; every hook point is wrapped now: the
    # engine loop's by plain functions (cheaper per call), the others by wrapt.
    assert all(isinstance(_current(p), wrapt.FunctionWrapper) != p.hot for p in HOOK_POINTS)
    originals = {p: _current(p).__wrapped__ for p in HOOK_POINTS}
    assert all(_current(p) is not original for p, original in originals.items())
    VLLMKVCacheInstrumentor().uninstrument()
    assert {p: _current(p) for p in HOOK_POINTS} == originals
    # Instrumenting again works, and the fixture's uninstrument still finds it instrumented.
    VLLMKVCacheInstrumentor().instrument(
        tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider
    )
    assert all(_current(p) is not original for p, original in originals.items())


def test_hot_wrappers_take_exactly_vllms_parameters(telemetry):
    """Any call vLLM makes to its method, keywords included, is a valid call to ours."""
    import inspect

    for point in (p for p in HOOK_POINTS if p.hot):
        wrapper = _current(point)
        original = wrapper.__wrapped__
        assert inspect.signature(wrapper, follow_wrapped=False) == inspect.signature(original), point.qualname


def test_a_missing_hook_point_is_reported_once_and_the_rest_still_works(caplog):
    module = "vllm.v1.core.sched.scheduler"
    missing = HookPoint(module, "Scheduler", "_method_vllm_never_had", "counted", "a count", hot=False)
    present = HookPoint(module, "Scheduler", "get_request_counts", "counted", "a count", hot=False)
    calls = []

    def factory(hook):
        def wrapper(wrapped, instance, args, kwargs):
            calls.append(hook)
            return wrapped(*args, **kwargs)

        return wrapper

    patcher = LazyPatcher([missing, present], {"counted": factory})
    # At DEBUG: an engine's start-up line names it, as every missing hook point (test_next_release.py).
    with caplog.at_level(logging.DEBUG, logger="vllm.otel_kvcache"):
        patcher.start()
    try:
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1
        assert "Scheduler._method_vllm_never_had" in warnings[0] and "0.33.0" in warnings[0]
        assert hasattr(_current(present), "__wrapped__")
    finally:
        patcher.stop()
    assert not hasattr(_current(present), "__wrapped__")


@pytest.mark.slow
def test_instrument_imports_neither_vllm_nor_torch():
    result = _run_python(
        """
        import sys
        from otel_kvcache import VLLMKVCacheInstrumentor
        VLLMKVCacheInstrumentor().instrument()
        print(sorted(m for m in ("vllm", "torch") if m in sys.modules))
        import vllm.v1.core.sched.scheduler as scheduler
        print(hasattr(scheduler.Scheduler.__dict__["_preempt_request"], "__wrapped__"))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["[]", "True"]


@pytest.mark.slow
def test_opentelemetry_instrument_loads_it_through_the_entry_point():
    result = _run_python(
        """
        from otel_kvcache import VLLMKVCacheInstrumentor
        import vllm.v1.core.kv_cache_manager as manager
        print(VLLMKVCacheInstrumentor().is_instrumented_by_opentelemetry)
        print(hasattr(manager.KVCacheManager.__dict__["record_prefix_cache_stats"], "__wrapped__"))
        """,
        OPENTELEMETRY_INSTRUMENT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:2] == ["True", "True"]


def test_disabled_instrumentation_is_not_loaded():
    result = _run_python(
        """
        from otel_kvcache import VLLMKVCacheInstrumentor
        print(VLLMKVCacheInstrumentor().is_instrumented_by_opentelemetry)
        """,
        OPENTELEMETRY_INSTRUMENT,
        env={"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "vllm_kvcache"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "False"


def test_either_vllm_distribution_satisfies_the_dependency_check():
    from importlib.metadata import distribution

    from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts

    assert get_dist_dependency_conflicts(distribution("otel-kvcache")) is None
    assert VLLMKVCacheInstrumentor()._check_dependency_conflicts() is None


def test_a_hot_wrapper_forwards_arguments_as_given_and_tracebacks_show_its_source():
    import inspect
    import traceback

    from otel_kvcache.errors import InstrumentationErrors
    from otel_kvcache.wiring.patch import ENGINE_ATTRIBUTE, _after, _around

    def original(self, a, /, b, *args, c, d=4, **kwargs):
        if a == "fail":
            raise KeyError("vLLM's own")
        return a, b, args, c, d, kwargs

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    errors = InstrumentationErrors(MeterProvider(metric_readers=[reader]).get_meter("t").create_counter("errors"))
    seen = []
    method = _after("hook", errors, lambda engine, *args, **kwargs: seen.append((engine, args, kwargs)))(original)
    instrumented = type("Owner", (), {ENGINE_ATTRIBUTE: "engine"})()
    assert method(instrumented, 1, 2, 3, c=5, e=6) == (1, 2, (3,), 5, 4, {"e": 6})
    assert method(instrumented, 1, b=2, c=3, d=7) == (1, 2, (), 3, 7, {})
    assert inspect.signature(method) == inspect.signature(original)  # vLLM's call sites stay specialized
    assert seen == [("engine", (1, 2, 3), {"c": 5, "d": 4, "e": 6}), ("engine", (1, 2), {"c": 3, "d": 7})]
    assert method(object(), 1, 2, c=3) == (1, 2, (), 3, 4, {})  # built before instrument(): passes through
    assert len(seen) == 2

    with pytest.raises(KeyError, match="vLLM's own") as raised:
        method(instrumented, "fail", 2, c=3)
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert [frame.name for frame in frames[-2:]] == ["method", "original"]
    assert frames[-2].filename.endswith("patch.py") and "original(self, *args, **kwargs)" in frames[-2].line

    # vLLM may pass the request by keyword; the around-wrapper finds it by its name.
    def preempt(self, request, timestamp):
        return request, timestamp

    around = []
    before = lambda engine, request: around.append(("before", request)) or "state"  # noqa: E731
    after = lambda engine, request, state: around.append(("after", request, state))  # noqa: E731
    method = _around("hook", errors, before, after)(preempt)
    assert method(instrumented, timestamp=1.0, request="r") == ("r", 1.0)
    assert around == [("before", "r"), ("after", "r", "state")]
    # Without an engine vLLM's exception is its own: no error of ours in its context.
    with pytest.raises(KeyError, match="vLLM's own") as raised:
        _around("hook", errors, before, after)(original)(object(), "fail", 2, c=3)
    assert raised.value.__context__ is None
    assert reader.get_metrics_data() is None  # none of ours failed
    # Nor where ours failed first: vLLM's call and its exception stay outside our handler.
    failing = lambda engine, request: 1 / 0  # noqa: E731
    with pytest.raises(KeyError, match="vLLM's own") as raised:
        _around("hook", errors, failing, after)(original)(instrumented, "fail", 2, c=3)
    assert raised.value.__context__ is None
    [point] = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    assert point.value == 1  # ours, counted


def test_every_hot_wrapper_reads_the_engine_by_its_attribute_name():
    """The hot wrappers name the engine's attribute in their code (CPython specializes the
    read): a misspelt name would pass every call through, hooked but feeding nothing."""
    from otel_kvcache.wiring import patch

    def original(self, request):
        return request

    for factory in (patch._after, patch._tracking_pool):
        assert patch.ENGINE_ATTRIBUTE in factory("hook", None, print)(original).__code__.co_names
    assert patch.ENGINE_ATTRIBUTE in patch._around("hook", None, print, print)(original).__code__.co_names
