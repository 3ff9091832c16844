"""What otel-kvcache costs vLLM's scheduler loop, measured against the uninstrumented engine.

    python -m benchmarks.overhead [--rounds N] [--pairs N] [--quick] [--take-apart]

The variants are timed against each other in paired processes
(``benchmarks.paired``: turns of 0.05 s chunks on one CPU, fresh processes each
round, a 95 % bootstrap interval beside each median); it also prints the A/A
pair's, the memory held per in-flight request and the pool work by pool size,
and then the README's table. The variants:

- ``base``: uninstrumented, vLLM's ``log_stats`` on (its default when serving);
- ``otel``: instrumented as under ``opentelemetry-instrument``: every request
  traced; spans and request histograms built by the helper process (spans
  exported a frame at a time and a periodic metric reader, into console
  exporters whose output it discards), whose CPU time is reported apart; the pool's instruments read by a
  periodic metric reader in the engine process;
- ``base-again``: a second uninstrumented process, for the A/A spread;
- anchors on decode-heavy: ``log_stats`` off, and vLLM's ``--kv-cache-metrics``
  at sample rate 1.0;
- with ``--take-apart`` instead, on decode-heavy and churn: where the
  instrumented side's time goes (``TAKE_APART``: the instrumented process with
  vLLM's methods given back before the warm-up, a helper that exports
  nothing, the hooks with the pool mirror's or the records' work emptied, or
  all of it; and, to calibrate the benchmark itself, the uninstrumented
  engine burning 40 us of CPU after each step; ``--parts`` picks some).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import sys
import timeit
import tracemalloc

from benchmarks.instrumented import instrument
from benchmarks.paired import TAKE_APART, paired
from benchmarks.scheduler_driver import Driver, Workload, against_target, model_config, workloads

MEMORY_TARGET = 2048  # bytes held per in-flight request
FLAT = 2.0  # the most the per-step pool work may grow from 1,000 to 100,000 blocks


def memory_per_request(workload: Workload) -> float:
    """Bytes held by otel-kvcache and the SDK (the spans) per in-flight request."""
    instrument()
    driver = Driver(workload)
    driver.top_up()
    driver.run(workload.output_len + 64)
    tracemalloc.start(32)
    fresh = Driver(workload)  # everything this one's requests hold is allocated while tracing
    fresh.top_up()
    fresh.run(32)
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    # Allocated by our code or by the OpenTelemetry SDK (which only we call here).
    ours = snapshot.filter_traces(
        [tracemalloc.Filter(True, "*/otel_kvcache/*"), tracemalloc.Filter(True, "*/opentelemetry/*")]
    )
    in_flight = len(fresh.scheduler.requests)
    return sum(stat.size for stat in ours.statistics("filename")) / in_flight


def pool_metric_cost() -> dict[int, dict[str, float]]:
    """Microseconds the pool work costs by pool size: a step's (``note_pops``), a
    gauge collection, and one reconciliation pass (run every OTEL_KVCACHE_RECONCILE_SECONDS)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    from otel_kvcache import VLLMKVCacheInstrumentor
    from otel_kvcache.engine.leaks import RECONCILE_BUDGET

    reader = InMemoryMetricReader()
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider(), meter_provider=MeterProvider(metric_readers=[reader]))
    costs = {}
    try:
        for blocks in (1_000, 10_000, 100_000):
            workload = Workload("pool", 64, 512, 256, 64, blocks)
            driver = Driver(workload)
            driver.top_up()
            driver.run(100)
            engine = driver.scheduler._otel_kvcache_engine
            number = 2000
            step = timeit.timeit(functools.partial(engine.pool.note_pops, 0.0), number=number) / number
            collect = timeit.timeit(reader.get_metrics_data, number=50) / 50
            reconcile = timeit.timeit(engine.reconciler.run, number=20) / 20
            costs[blocks] = {
                "step_us": step * 1e6,
                "collect_us": collect * 1e6,
                "reconcile_us": reconcile * 1e6,
                "reconcile_share": reconcile / max(engine.reconciler.interval, reconcile / RECONCILE_BUDGET),
            }
            del driver, engine
    finally:
        instrumentor.uninstrument()
    return costs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead")
    parser.add_argument("--rounds", type=int, default=12, help="fresh processes per variant, per workload")
    parser.add_argument("--pairs", type=int, default=12, help="chunks of each variant per round")
    parser.add_argument("--quick", action="store_true", help="decode-heavy only, few rounds")
    parser.add_argument(
        "--take-apart",
        action="store_true",
        help="instead: decode-heavy and churn against variants with parts of the work left out",
    )
    parser.add_argument(
        "--parts", default=",".join(TAKE_APART), help="with --take-apart: the variants, comma-separated"
    )
    parser.add_argument("--workloads", default="decode-heavy,churn", help="with --take-apart: comma-separated")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.take_apart:
        parts, chosen = args.parts.split(","), args.workloads.split(",")
        by_name = {workload.name: workload for workload in workloads()}
        for option, asked, known in (("--parts", parts, TAKE_APART), ("--workloads", chosen, by_name)):
            unknown = [name for name in asked if name not in known]
            if unknown:
                parser.error(f"{option}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
        model_config()
        for workload in (by_name[name] for name in chosen):
            _print_taken_apart(paired(["base", *parts, "base-again"], workload, args.rounds, args.pairs))
        return 0
    selected = workloads()[:1] if args.quick else workloads()
    rounds, pairs = (2, 12) if args.quick else (args.rounds, args.pairs)
    model_config()  # made once, before the children are forked

    results = {"workloads": [], "anchors": None}
    for workload in selected:
        outcome = paired(["base", "otel", "base-again"], workload, rounds, pairs)
        results["workloads"].append(outcome)
        _print_workload(outcome)
    results["anchors"] = paired(["base", "no-log-stats", "kv-cache-metrics-1.0"], workloads()[0], rounds, pairs)
    _print_anchors(results["anchors"])

    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:  # a process each: each instruments its own way
        results["bytes_per_request"] = pool.apply(memory_per_request, (workloads()[0],))
    with context.Pool(1) as pool:
        results["pool_metric_cost"] = pool.apply(pool_metric_cost)
    held = results["bytes_per_request"]
    print(f"\nmemory held per in-flight request (decode-heavy): {held:.0f} B "
          f"(target {MEMORY_TARGET} B: {'met' if held <= MEMORY_TARGET else 'NOT met'})")
    per_step = [cost["step_us"] for cost in results["pool_metric_cost"].values()]
    flat = max(per_step) <= FLAT * min(per_step)
    print(f"pool work by pool size (per-step cost flat, within {FLAT}x from 1,000 to 100,000 blocks: "
          f"{'met' if flat else 'NOT met'}):")
    for blocks, cost in results["pool_metric_cost"].items():
        print(
            f"  {blocks:>7} blocks: a step's pool work {cost['step_us']:.2f} us, gauge collection "
            f"{cost['collect_us']:.0f} us, reconciliation {cost['reconcile_us']:.0f} us a pass "
            f"({100 * cost['reconcile_share']:.3f} % of the engine thread at one pass per interval)"
        )
    print()
    print(markdown_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def markdown_table(results: dict) -> str:
    """The README's table."""
    lines = [
        "| workload | base ms/step | instrumented / base: median (p25–p75) | against the target | median's 95 % interval | A/A: median (p25–p75) | A/A median's 95 % interval | µs per step | µs per finished request | helper process: CPU µs per request |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for outcome in results["workloads"]:
        otel, aa = outcome["otel"], outcome["base-again"]
        lines.append(
            f"| {outcome['workload']} | {outcome['base_step_ms']:.2f} "
            f"| {otel['ratio']['median']:.3f} ({otel['ratio']['p25']:.3f}–{otel['ratio']['p75']:.3f}) "
            f"| {_verdict(outcome)} "
            f"| {_range(otel['ratio']['ci95'])} "
            f"| {aa['ratio']['median']:.3f} ({aa['ratio']['p25']:.3f}–{aa['ratio']['p75']:.3f}) "
            f"| {_range(aa['ratio']['ci95'])} "
            f"| {otel['us_per_step']:.0f} | {otel['us_per_request']:.0f} | {otel['helper_us_per_request']:.0f} |"
        )
    return "\n".join(lines)


def _verdict(outcome: dict) -> str:
    return against_target(outcome["otel"]["ratio"]["median"] - 1, outcome["workload"])


def _range(values: list[float]) -> str:
    return f"{min(values):.3f}–{max(values):.3f}"


def _print_workload(outcome: dict) -> None:
    otel, aa = outcome["otel"], outcome["base-again"]
    print(
        f"{outcome['workload']:<24} base {outcome['base_step_ms']:.2f} ms/step | "
        f"otel/base median {otel['ratio']['median']:.4f} ({_verdict(outcome)}; "
        f"p25 {otel['ratio']['p25']:.4f}, p75 {otel['ratio']['p75']:.4f}; 95 % interval {_range(otel['ratio']['ci95'])}; "
        f"rounds {_range(otel['round_ratios'])}) | "
        f"A/A median {aa['ratio']['median']:.4f} (p25 {aa['ratio']['p25']:.4f}, p75 {aa['ratio']['p75']:.4f}; "
        f"95 % interval {_range(aa['ratio']['ci95'])}; rounds {_range(aa['round_ratios'])}) | "
        f"{otel['us_per_step']:.1f} us/step, {otel['us_per_request']:.1f} us/request | "
        f"helper {otel['helper_us_per_request']:.0f} us/request",
        flush=True,
    )


def _print_taken_apart(outcome: dict) -> None:
    for name in [*TAKE_APART, "base-again"]:
        variant = outcome.get(name)
        if variant is None:
            continue
        ratio = variant["ratio"]
        print(
            f"{outcome['workload']:<14} {name:<14} vs base: median {ratio['median']:.4f} "
            f"(p25 {ratio['p25']:.4f}, p75 {ratio['p75']:.4f}; 95 % interval {_range(ratio['ci95'])}; "
            f"rounds {_range(variant['round_ratios'])}) | "
            f"{variant['us_per_step']:.1f} us/step | helper {variant['helper_us_per_request']:.0f} us/request",
            flush=True,
        )


def _print_anchors(outcome: dict) -> None:
    for name in ("no-log-stats", "kv-cache-metrics-1.0"):
        ratio = outcome[name]["ratio"]
        print(f"anchor {name:<22} vs base: median {ratio['median']:.4f} (p25 {ratio['p25']:.4f}, p75 {ratio['p75']:.4f})")


if __name__ == "__main__":
    sys.exit(main())
