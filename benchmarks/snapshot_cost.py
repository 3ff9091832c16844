"""What the live snapshot for ``otel-kvcache top`` costs: one publishing round's time,
on each workload past its warm-up.

    python -m benchmarks.snapshot_cost [--rounds N] [--workloads decode-heavy,churn,wide]

The publishing thread (``live_snapshot.py``) runs at most once a second, and waits at
least 1000 times a round's time before the next (``BUDGET``). Under the GIL, its time is
time the engine thread may wait for: a round's time per second is the most the engine
loses. Each round reads the pool's counts, every held block's reference count (the
holders' fair share), every live request's block count, and writes the JSON file. The
overhead gate counts it too (``benchmarks.instructions``: the thread runs there, its
interval stretched as valgrind stretches time).
"""

from __future__ import annotations

import argparse
import statistics
import sys


def rounds_of(workload_name: str, rounds: int) -> dict:
    """Runs in a fresh process: ``rounds`` publishing rounds, five steps apart."""
    import time

    from benchmarks.instrumented import instrument
    from benchmarks.scheduler_driver import Driver, workloads
    from otel_kvcache import VLLMKVCacheInstrumentor
    from otel_kvcache.engine import snapshot_files
    from otel_kvcache.engine import live_snapshot

    live_snapshot.PUBLISH_SECONDS = 3600.0  # the rounds below are the only ones
    instrument()
    workload = {w.name: w for w in workloads()}[workload_name]
    driver = Driver(workload)
    driver.top_up()
    driver.run(2 * workload.output_len)
    publisher = VLLMKVCacheInstrumentor()._publisher
    (engine, (path, _)), = publisher._engines.items()
    watching = path.parent / snapshot_files.WATCHING
    result = {"held_blocks": engine.pool_counts.used, "live_requests": len(engine.scheduler_requests)}
    for watched in (False, True):
        if watched:
            snapshot_files.read_snapshots()  # a reader: in full from now on
        else:
            watching.unlink(missing_ok=True)
        seconds = []
        for _ in range(rounds):
            driver.run(5)
            started = time.perf_counter()
            publisher.publish()
            seconds.append(time.perf_counter() - started)
        kind = "watched" if watched else "unwatched"
        result[kind] = (1e3 * statistics.median(seconds), 1e3 * max(seconds), path.stat().st_size)
    return result


def main(argv: list[str] | None = None) -> int:
    from benchmarks.scheduler_driver import in_fresh_processes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--workloads", default="decode-heavy,churn,wide")
    args = parser.parse_args(argv)
    for name, result in in_fresh_processes(rounds_of, args.workloads.split(","), args.rounds):
        for kind in ("unwatched", "watched"):
            median, most, size = result[kind]
            print(
                f"{name} {kind}: {median:.2f} ms a round (max {most:.2f}), {size} bytes; "
                f"{result['held_blocks']} held blocks, {result['live_requests']} live requests",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
