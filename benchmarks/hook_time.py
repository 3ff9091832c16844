"""Engine-thread time spent in otel-kvcache, timed directly in the scheduler loop.

    python -m benchmarks.hook_time [--steps N] [--workloads decode-heavy,churn,wide]

The paired ratios of ``benchmarks.overhead`` carry the machine's noise (a few %
per pair here); instruction counts (``benchmarks.instructions``) miss what the
CPU does with them. This times every hot hook point while the real scheduler
runs: a timer outside the method the instrumentation installed and one around
vLLM's original inside it, so that what lies between (the hook's frame and
everything it calls into ``EngineTelemetry``, ``PoolTracker`` and the
exporter) is the instrumentation's time. The timers' own cost, measured the
same way around uninstrumented vLLM methods of the same loop (``CONTROLS``),
is subtracted. What it leaves out: whatever the instrumentation does to the
rest of the loop (caches), which only the paired ratios see.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import sys
import time
from time import perf_counter_ns


def _timed(function, key: str, spent: collections.Counter, calls: collections.Counter):
    """``function``, adding its time (and a call) under ``key``; it shows ``function``'s
    signature, so the instrumentation mirrors vLLM's as it does without the timers."""

    @functools.wraps(function)
    def timed(*args, **kwargs):
        started = perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            spent[key] += perf_counter_ns() - started
            calls[key] += 1

    return timed


class _Timers:
    """Outer (around the installed method) and inner (around vLLM's) time per hook point."""

    def __init__(self) -> None:
        self.outer, self.inner, self.calls = collections.Counter(), collections.Counter(), collections.Counter()
        self._inner_calls = collections.Counter()

    def timing_outer(self, function, key: str):
        return _timed(function, key, self.outer, self.calls)

    def timing_inner(self, function, key: str):
        return _timed(function, key, self.inner, self._inner_calls)

    def clear(self) -> None:
        for counter in (self.outer, self.inner, self.calls, self._inner_calls):
            counter.clear()


# Uninstrumented methods the loop calls about as often as the hooks (per step, per
# release), timed the same way: outer minus inner there is the timers' own cost,
# as the loop's caches leave it.
CONTROLS = (
    ("vllm.v1.core.sched.scheduler", "Scheduler", "_update_after_schedule"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "free"),
)


def measure(workload_name: str, steps: int) -> dict:
    """Runs in a fresh process: instruments, times the hot hook points over ``steps`` steps."""
    from vllm.utils.gc_utils import freeze_gc_heap

    from benchmarks.instrumented import instrument
    from benchmarks.scheduler_driver import Driver, workloads
    from otel_kvcache.vllm_compat.hook_points import HOOK_POINTS

    timers = _Timers()
    hot = [(getattr(importlib.import_module(p.module), p.owner), p.method, p.qualname) for p in HOOK_POINTS if p.hot]
    for owner, method, key in hot:  # vLLM's originals, as the instrumentation will find them
        setattr(owner, method, timers.timing_inner(getattr(owner, method), key))
    instrument()
    for owner, method, key in hot:  # the methods the instrumentation installed
        setattr(owner, method, timers.timing_outer(getattr(owner, method), key))
    controls = []
    for module, owner_name, method in CONTROLS:
        owner, key = getattr(importlib.import_module(module), owner_name), f"{owner_name}.{method}"
        setattr(owner, method, timers.timing_outer(timers.timing_inner(getattr(owner, method), key), key))
        controls.append(key)

    workload = {w.name: w for w in workloads()}[workload_name]
    driver = Driver(workload)
    driver.top_up()
    driver.run(2 * workload.output_len)
    freeze_gc_heap()
    timers.clear()
    finished, started = driver.finished, time.process_time()
    driver.run(steps)
    step_seconds = (time.process_time() - started) / steps
    finished = driver.finished - finished
    control_ns = sum(timers.outer[key] - timers.inner[key] for key in controls)
    timer_ns = control_ns / sum(timers.calls[key] for key in controls)
    ours = {
        key: timers.outer[key] - timers.inner[key] - timer_ns * calls
        for key, calls in timers.calls.items()
        if key not in controls
    }
    ours_ns = sum(ours.values())
    by_point = {
        key: (value / steps / 1e3, timers.calls[key] / steps)
        for key, value in sorted(ours.items(), key=lambda item: -item[1])
    }
    return {
        "workload": workload_name,
        "step_ms": step_seconds * 1e3,
        "us_per_step": ours_ns / steps / 1e3,
        "us_per_request": ours_ns / max(1, finished) / 1e3,
        "share_of_step": ours_ns / 1e9 / steps / (step_seconds - ours_ns / 1e9 / steps),
        "timer_ns": timer_ns,
        "by_hook_point_us_per_step": by_point,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hook_time")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workloads", default="decode-heavy,churn,wide")
    args = parser.parse_args(argv)
    from benchmarks.scheduler_driver import in_fresh_processes

    for name, result in in_fresh_processes(measure, args.workloads.split(","), args.steps):
        print(
            f"{name:<14} {result['step_ms']:.2f} ms/step | in otel-kvcache's hooks: "
            f"{result['us_per_step']:.1f} us/step, {result['us_per_request']:.1f} us per finished request, "
            f"{100 * result['share_of_step']:.2f} % of the uninstrumented step | "
            f"timers {result['timer_ns']:.0f} ns/call subtracted",
            flush=True,
        )
        for key, (us_per_step, calls_per_step) in result["by_hook_point_us_per_step"].items():
            per_call = us_per_step / calls_per_step if calls_per_step else 0.0
            line = f"{us_per_step:6.1f} us/step | {calls_per_step:5.2f} calls/step, {per_call:5.2f} us/call"
            print(f"    {key:<42} {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
