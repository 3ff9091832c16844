"""Engine-thread time spent inside otel-kvcache, timed directly in the scheduler loop.

    python -m benchmarks.hook_time [--steps N] [--workloads decode-heavy,churn,wide]

The paired ratios of ``benchmarks.overhead`` carry the machine's noise (a few %
per pair here); instruction counts (``benchmarks.instructions``) miss what the
CPU does with them. This times every entry point ``patch.py`` calls into
(``EngineTelemetry``, ``PoolTracker`` and the exporter's per-request call) with
``perf_counter_ns`` while the real scheduler runs, subtracts the timer's own
cost (measured on an empty method), and reports microseconds per step and per
finished request, and their share of the step. What it leaves out: the hook
frames in ``patch.py`` around those calls, and whatever the instrumentation
does to the rest of the loop (caches), which only the paired ratios see.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import sys
import time
from time import perf_counter_ns

ENTRY_POINTS = {
    "engine": (
        "on_admission_attempt", "on_prefix_cache_lookup", "on_scheduled", "on_stall",
        "before_preempt", "on_preempted", "before_release", "on_released", "on_step_end",
    ),
    "pool": ("before_prepending", "on_appending", "on_touching", "before_evicting", "on_reset"),
}  # fmt: skip


def _timing(function, key: str, spent: collections.Counter, calls: collections.Counter):
    def timed(*args, **kwargs):
        started = perf_counter_ns()
        try:
            return function(*args, **kwargs)
        finally:
            spent[key] += perf_counter_ns() - started
            calls[key] += 1

    return timed


def _timer_cost_ns() -> float:
    """What the timing wrapper itself adds to one call."""

    class Empty:
        def method(self, argument):
            pass

    spent, calls = collections.Counter(), collections.Counter()
    bare = Empty()
    timed = _timing(Empty.method, "empty", spent, calls)
    number = 200_000
    started = perf_counter_ns()
    for _ in range(number):
        timed(bare, None)
    with_timer = perf_counter_ns() - started
    started = perf_counter_ns()
    for _ in range(number):
        bare.method(None)
    return (with_timer - (perf_counter_ns() - started)) / number


def measure(workload_name: str, steps: int) -> dict:
    """Runs in a fresh process: instruments, times the entry points over ``steps`` steps."""
    from vllm.utils.gc_utils import freeze_gc_heap

    from benchmarks.overhead import _instrument
    from benchmarks.scheduler_driver import Driver, workloads
    from otel_kvcache.engine import EngineTelemetry
    from otel_kvcache.exporter_process import ExporterProcess
    from otel_kvcache.pool import PoolTracker

    _instrument()
    spent, calls = collections.Counter(), collections.Counter()
    owners = {"engine": EngineTelemetry, "pool": PoolTracker}
    for owner, methods in ENTRY_POINTS.items():
        for name in methods:
            setattr(owners[owner], name, _timing(getattr(owners[owner], name), f"{owner}.{name}", spent, calls))
    ExporterProcess.request_ended = _timing(ExporterProcess.request_ended, "exporter.request_ended", spent, calls)

    workload = {w.name: w for w in workloads()}[workload_name]
    driver = Driver(workload)
    driver.top_up()
    driver.run(2 * workload.output_len)
    freeze_gc_heap()
    spent.clear()
    calls.clear()
    finished, started = driver.finished, time.process_time()
    driver.run(steps)
    step_seconds = (time.process_time() - started) / steps
    finished = driver.finished - finished
    # request_ended runs inside on_released: counted there already.
    nested = spent.pop("exporter.request_ended", 0)
    nested_calls = calls.pop("exporter.request_ended", 0)
    overhead_ns = _timer_cost_ns()
    ours_ns = sum(spent.values()) - overhead_ns * sum(calls.values()) - overhead_ns * nested_calls
    by_point = {
        key: ((value - overhead_ns * calls[key]) / steps / 1e3, calls[key] / steps) for key, value in spent.most_common()
    }
    by_point["exporter.request_ended (in on_released)"] = (
        (nested - overhead_ns * nested_calls) / steps / 1e3,
        nested_calls / steps,
    )
    return {
        "workload": workload_name,
        "step_ms": step_seconds * 1e3,
        "us_per_step": ours_ns / steps / 1e3,
        "us_per_request": ours_ns / max(1, finished) / 1e3,
        "share_of_step": ours_ns / 1e9 / steps / (step_seconds - ours_ns / 1e9 / steps),
        "timer_ns": overhead_ns,
        "by_entry_point_us_per_step": by_point,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hook_time")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workloads", default="decode-heavy,churn,wide")
    args = parser.parse_args(argv)
    context = multiprocessing.get_context("spawn")
    for name in args.workloads.split(","):
        with context.Pool(1) as pool:  # a fresh process each: instrumenting is for life
            result = pool.apply(measure, (name, args.steps))
        print(
            f"{name:<14} {result['step_ms']:.2f} ms/step | inside otel-kvcache: {result['us_per_step']:.1f} us/step, "
            f"{result['us_per_request']:.1f} us per finished request, {100 * result['share_of_step']:.2f} % of the "
            f"uninstrumented step | timer {result['timer_ns']:.0f} ns/call subtracted",
            flush=True,
        )
        for key, (us_per_step, calls_per_step) in result["by_entry_point_us_per_step"].items():
            per_call = us_per_step / calls_per_step if calls_per_step else 0.0
            print(f"    {key:<42} {us_per_step:6.1f} us/step | {calls_per_step:5.2f} calls/step, {per_call:5.2f} us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
