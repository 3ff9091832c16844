"""Garbage collections in the scheduler loop, uninstrumented and instrumented.

    python -m benchmarks.gc_pressure [--steps N] [--workloads decode-heavy,churn,wide]

CPython collects its youngest generation once 700 more objects it tracks
(containers: lists, tuples, arrays, class instances) have been allocated
than freed. A steady vLLM frees about as many as it allocates, so past its
warm-up it goes many seconds without a collection; each one it does make
walks its young requests and their token lists, a few milliseconds on these
workloads. Anything the instrumentation keeps for a while, a tuple or a list
per request or per step, tips that balance. The paired-time benchmark
barely sees it: a collection lands in one chunk of twelve, and the median
pair ignores it, while the engine pays for it all the same.

Each variant runs in a fresh process: ``2 x output_len`` steps of warm-up, the
heap frozen as vLLM's EngineCore freezes it (``freeze_gc_heap``), then
``--steps`` steps with ``gc.callbacks`` counting the collections of each
generation and the time spent in them.
"""

from __future__ import annotations

import argparse
import sys


def collections_in(workload_name: str, instrumented: bool, steps: int) -> dict:
    """Runs in a fresh process: collections by generation over ``steps`` steps."""
    import gc
    import time

    from vllm.utils.gc_utils import freeze_gc_heap

    from benchmarks.instrumented import instrument
    from benchmarks.scheduler_driver import Driver, workloads

    if instrumented:
        instrument()
    workload = {w.name: w for w in workloads()}[workload_name]
    driver = Driver(workload)
    driver.top_up()
    driver.run(2 * workload.output_len)
    freeze_gc_heap()

    counts, seconds, started = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            seconds[info["generation"]] += time.perf_counter() - started[0]

    gc.callbacks.append(on_collection)
    try:
        driver.run(steps)
    finally:
        gc.callbacks.remove(on_collection)
    return {"counts": counts, "ms": [1e3 * s for s in seconds]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gc_pressure")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--workloads", default="decode-heavy,churn,wide")
    args = parser.parse_args(argv)
    from benchmarks.scheduler_driver import in_fresh_processes

    for name in args.workloads.split(","):
        for variant, instrumented in (("base", False), ("otel", True)):
            [(_, result)] = in_fresh_processes(collections_in, [name], instrumented, args.steps)
            by_generation = ", ".join(
                f"gen {generation}: {count} ({ms:.1f} ms)"
                for generation, (count, ms) in enumerate(zip(result["counts"], result["ms"]))
            )
            print(
                f"{name:<14} {variant:<5} collections in {args.steps} steps: {by_generation}; "
                f"{1e3 * sum(result['ms']) / args.steps:.1f} us a step",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
