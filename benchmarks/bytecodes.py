"""Python bytecodes otel-kvcache runs on the engine thread, counted in the scheduler loop.

    python -m benchmarks.bytecodes [--steps N] [--workloads decode-heavy,churn,wide]

Time in the hooks (``benchmarks.hook_time``) moves by 10-30 % with the
machine; this count does not. Timed in the loop, the hooks' cost follows how
many bytecodes they run (a call that reads a few fields of cold objects costs
about as much per bytecode as one that computes), so this is the number to
compare two versions of the engine-thread code by. It counts, with
``sys.settrace`` opcode events, every bytecode run in otel-kvcache's modules
and in the wrappers it installs, by function, over ``--steps`` steps of the
real scheduler past the first wave (vLLM's own code is not counted; the
tracer makes the loop much slower, so no time is reported). The leak
reconciliation is left out: it runs every 5 s of wall time whatever the
load, so the slowed loop would count it far more often than it runs (its
cost per pass is in ``benchmarks.overhead``'s last part).
"""

from __future__ import annotations

import argparse
import collections
import sys

OURS = ("/otel_kvcache/", "<otel-kvcache wrapper")
"""Where otel-kvcache's code comes from: its package, and the wrappers ``signatures.py`` compiles."""


def count(workload_name: str, steps: int) -> dict:
    """Runs in a fresh process: instruments, counts bytecodes over ``steps`` steps."""
    import os

    from benchmarks.instrumented import instrument
    from benchmarks.scheduler_driver import Driver, workloads
    from otel_kvcache.config import RECONCILE_SECONDS

    os.environ[RECONCILE_SECONDS] = "1e9"  # no reconciliation within the count
    instrument()
    workload = {w.name: w for w in workloads()}[workload_name]
    driver = Driver(workload)
    driver.top_up()
    driver.run(2 * workload.output_len)

    by_function: collections.Counter = collections.Counter()

    def in_ours(frame, event, arg):
        if event == "opcode":
            by_function[frame.f_code.co_name] += 1
        return in_ours

    def on_call(frame, event, arg):
        if any(origin in frame.f_code.co_filename for origin in OURS):
            frame.f_trace_opcodes = True
            return in_ours
        return None  # vLLM's frames are not traced line by line

    finished = driver.finished
    sys.settrace(on_call)
    try:
        driver.run(steps)
    finally:
        sys.settrace(None)
    finished = driver.finished - finished
    total = sum(by_function.values())
    return {
        "workload": workload_name,
        "per_step": total / steps,
        "per_request": total / max(1, finished),
        "by_function_per_step": {name: n / steps for name, n in by_function.most_common()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bytecodes")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workloads", default="decode-heavy,churn,wide")
    parser.add_argument("--top", type=int, default=12, help="functions listed per workload")
    args = parser.parse_args(argv)
    from benchmarks.scheduler_driver import in_fresh_processes

    for name, result in in_fresh_processes(count, args.workloads.split(","), args.steps):
        print(
            f"{name:<14} otel-kvcache bytecodes: {result['per_step']:.0f} per step, "
            f"{result['per_request']:.0f} per finished request",
            flush=True,
        )
        for function, per_step in list(result["by_function_per_step"].items())[: args.top]:
            print(f"    {function:<28} {per_step:7.1f} per step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
