"""What otel-kvcache costs vLLM's scheduler loop, measured against the uninstrumented engine.

    python -m benchmarks.overhead [--rounds N] [--pairs N] [--quick] [--take-apart]

Each variant runs in its own process, driving the real V1 scheduler with fake
model outputs at constant concurrency. The coordinator alternates timed chunks
between them (a pair = one chunk of each, in rotating order), so drifts of the
machine hit all sides of a pair. A process's memory layout alone moves its
speed by up to ~1 % for its whole life, so each workload takes many rounds,
each with fresh processes: each variant warms up in a template process, and
every round forks a worker from it (forks of one process: the same string
hashes, so the same scheduling decisions; every round runs the same steps);
every ``TEMPLATE_ROUNDS`` rounds a new generation of templates takes over,
each with its heap padded differently, so that no one layout decides a run.
The workers take turns on one CPU; the rest (templates, this process, the
helper process) runs on the others. Beside each median ratio it prints a 95 %
bootstrap interval, resampling whole rounds, and the same for the A/A pair: a
verdict is only as firm as that interval is narrow. The variants:

- ``base``: uninstrumented, vLLM's ``log_stats`` on (its default when serving);
- ``otel``: instrumented as under ``opentelemetry-instrument``: every request
  traced; spans and request histograms built by the helper process (batch span
  processor and periodic metric reader into console exporters whose output it
  discards), whose CPU time is reported apart; the pool's instruments read by a
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
import os
import random
import statistics
import sys
import time
import timeit
import tracemalloc
from multiprocessing.connection import Connection

from benchmarks.scheduler_driver import Driver, Workload, against_target, model_config, workloads

# Short chunks keep a pair's chunks inside one spell of the machine's noise: against
# 0.15 s chunks (4 pairs a round), 0.05 s ones (12 pairs) cut the spread of the
# rounds' ratios by about half in the same time.
CHUNK_SECONDS = 0.05
# A process's memory layout moves its speed by up to ~1 % for its whole life, and the
# rounds forked from one template share its layout: the templates are built anew,
# each generation with its heap laid out differently, every this many rounds.
TEMPLATE_ROUNDS = 4
_LAYOUT_PADDING: list = []  # a template's, for its life
BOOTSTRAP_RESAMPLES = 2000
MEMORY_TARGET = 2048  # bytes held per in-flight request
FLAT = 2.0  # the most the per-step pool work may grow from 1,000 to 100,000 blocks
# The timed workers take turns on one CPU; everything else (this process, the
# templates, the instrumented side's helper process) runs on the others.
TIMED_CPU = max(os.sched_getaffinity(0))
OTHER_CPUS = (os.sched_getaffinity(0) - {TIMED_CPU}) or {TIMED_CPU}

VARIANTS = {
    "base": {"instrumented": False, "log_stats": True},
    "otel": {"instrumented": True, "log_stats": True},
    "base-again": {"instrumented": False, "log_stats": True},
    "no-log-stats": {"instrumented": False, "log_stats": False},
    "kv-cache-metrics-1.0": {"instrumented": False, "log_stats": True, "kv_cache_metrics_sample": 1.0},
    # --take-apart: the instrumentation with parts of its work left out (diagnostics only:
    # without them the telemetry is wrong). Instrumented, vLLM's methods given back before
    # the warm-up: being instrumented (its helper process, the SDK's threads, the engine's
    # telemetry objects) without a hook running. (Given back in the worker instead, after
    # the warm-up, the classes change under code CPython has specialized for them, which
    # then runs unspecialized for the whole round: benchmarks.specialization.) The helper
    # building spans but exporting none; the hooks with the pool mirror's work, the
    # per-request records' work, or both emptied.
    "unhooked-early": {"instrumented": True, "log_stats": True, "unhooked": True},
    "quiet-helper": {"instrumented": True, "log_stats": True, "helper_exports": False},
    "no-mirror": {"instrumented": True, "log_stats": True, "emptied": "mirror"},
    "no-records": {"instrumented": True, "log_stats": True, "emptied": "records"},
    "frames-only": {"instrumented": True, "log_stats": True, "emptied": "mirror,records"},
    # The benchmark's own calibration: uninstrumented, burning a known CPU time after each
    # step and touching nothing, which it should read as that many us a step.
    "spin": {"instrumented": False, "log_stats": True, "spin_us": 40},
}
TAKE_APART = ["otel", "unhooked-early", "quiet-helper", "no-mirror", "no-records", "frames-only", "spin"]
"""Compared with ``base`` and, for the A/A spread, ``base-again``."""

# What --take-apart empties: the methods the hooks call into, by part.
EMPTIED_METHODS = {
    "mirror": (
        "PoolTracker",
        ("note_pops", "before_prepending", "on_appending", "on_touching", "before_unpinning", "settle"),
    ),
    "records": (
        "EngineTelemetry",
        ("on_prefix_cache_lookup", "on_scheduled", "before_release", "on_released"),
    ),
}


# --- the worker processes ------------------------------------------------------------


def _empty(parts: str) -> None:
    """Leaves the named parts of the instrumentation's work out (``EMPTIED_METHODS``)."""
    from otel_kvcache.engine import EngineTelemetry
    from otel_kvcache.pool import PoolTracker

    owners = {"EngineTelemetry": EngineTelemetry, "PoolTracker": PoolTracker}
    for part in parts.split(","):
        owner_name, methods = EMPTIED_METHODS[part]
        owner = owners[owner_name]
        for method in methods:
            getattr(owner, method)  # renamed since? then fail here, not measure nothing
            setattr(owner, method, lambda *args, **kwargs: None)


def _spinning(step, microseconds: float):
    """``step``, then burning ``microseconds`` of the process's CPU time."""
    spin_ns = int(1e3 * microseconds)
    clock = time.process_time_ns

    def step_then_spin() -> None:
        step()
        until = clock() + spin_ns
        while clock() < until:
            pass

    return step_then_spin


def _unhook() -> None:
    """vLLM's own methods back on its classes; the engine's telemetry objects stay."""
    from otel_kvcache import VLLMKVCacheInstrumentor

    VLLMKVCacheInstrumentor().uninstrument()


def _instrument(export_interval_millis: int = 5_000, helper_exports: bool = True):
    """As under ``opentelemetry-instrument``: spans and request histograms built by
    the helper process, whose SDK comes from the environment (batch span
    processor and periodic metric reader into console exporters, whose output the
    helper discards); the engine process keeps the observable instruments, read
    by a periodic reader into an exporter that discards."""
    import os

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )

    from otel_kvcache import VLLMKVCacheInstrumentor

    class DiscardMetrics(MetricExporter):
        def __init__(self):
            super().__init__()

        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis=10_000):
            return True

        def shutdown(self, timeout_millis=30_000, **kwargs):
            pass

    reader = PeriodicExportingMetricReader(DiscardMetrics(), export_interval_millis=export_interval_millis)
    meter_provider = MeterProvider(metric_readers=[reader])
    os.environ.update(
        OTEL_KVCACHE_EXPORTER_PROCESS="on",
        OTEL_TRACES_EXPORTER="console" if helper_exports else "none",
        OTEL_METRICS_EXPORTER="console" if helper_exports else "none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_METRIC_EXPORT_INTERVAL=str(export_interval_millis),
    )
    VLLMKVCacheInstrumentor().instrument(meter_provider=meter_provider)
    return meter_provider


def _helper_cpu_seconds(driver) -> float:
    """CPU time of the engine's helper process so far (0 without one)."""
    import os

    engine = getattr(driver.scheduler, "_otel_kvcache_engine", None)
    process = getattr(getattr(engine, "exporter", None), "process", None)
    if process is None:
        return 0.0
    with open(f"/proc/{process.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _serve(connection: Connection, variant: dict, workload: Workload, generation: int) -> None:
    """A variant's template: builds and warms its scheduler once, then forks a fresh
    worker per round from that state, and waits for it while it runs the round.
    Its heap is padded by its generation first, so that each generation of
    templates lays out its objects differently (the same for every variant)."""
    from vllm.utils.gc_utils import freeze_gc_heap

    os.sched_setaffinity(0, OTHER_CPUS)  # the helper process it starts too
    _LAYOUT_PADDING.append((bytearray(40_000 * generation), [[] for _ in range(997 * generation)]))
    if variant.get("emptied"):
        _empty(variant["emptied"])
    if variant.get("instrumented"):
        _instrument(helper_exports=variant.get("helper_exports", True))
    driver = Driver(workload, variant["log_stats"], variant.get("kv_cache_metrics_sample"))
    if variant.get("spin_us"):
        driver.step = _spinning(driver.step, variant["spin_us"])
    if variant.get("unhooked"):
        _unhook()
    driver.top_up()
    # No worker is timed while templates warm up: this thread may use every CPU (on
    # Linux, affinity is per thread; the helper process and the SDK's threads, started
    # above, keep theirs).
    os.sched_setaffinity(0, OTHER_CPUS | {TIMED_CPU})
    started = time.process_time()
    driver.run(2 * workload.output_len)  # past the first wave: a steady mix of ages
    step_seconds = (time.process_time() - started) / driver.steps
    os.sched_setaffinity(0, OTHER_CPUS)
    freeze_gc_heap()  # as vLLM's EngineCore does once it is warm
    connection.send(step_seconds)
    while (steps := connection.recv()) is not None:
        worker = os.fork()
        if worker == 0:  # the round's process: the connection is its own until it exits
            try:
                _run_round(connection, driver, steps)
            finally:
                os._exit(0)
        os.waitpid(worker, 0)


def _run_round(connection: Connection, driver: Driver, steps: int) -> None:
    """A worker: timed chunks of ``steps`` steps on request, from the template's state."""
    os.sched_setaffinity(0, {TIMED_CPU})
    driver.run(steps)  # untimed: the first writes to each page copy it (the fork's cost)
    connection.send("ready")
    while (steps := connection.recv()) is not None:
        # CPU time of the whole process: work moved to the SDK's threads is still counted.
        # (Reading the helper's CPU time costs ~25 us: outside the timed window.)
        finished, helper = driver.finished, _helper_cpu_seconds(driver)
        started = time.process_time()
        driver.run(steps)
        elapsed = time.process_time() - started
        connection.send((elapsed, driver.finished - finished, _helper_cpu_seconds(driver) - helper))


class Variant:
    """One variant's template process, forked from this one (vLLM already imported:
    quick to start), and the round's worker it forks in turn."""

    def __init__(self, name: str, workload: Workload, generation: int = 0) -> None:
        self.connection, child = multiprocessing.Pipe()
        self.process = multiprocessing.get_context("fork").Process(
            target=_serve, args=(child, VARIANTS[name], workload, generation), daemon=True
        )
        self.process.start()

    def warm(self) -> float:
        """Seconds per step while warming up."""
        return self.connection.recv()

    def start_round(self, steps: int) -> None:
        """A fresh worker, after one untimed chunk of ``steps``."""
        self.connection.send(steps)
        assert self.connection.recv() == "ready"

    def run(self, steps: int) -> tuple[float, int, float]:
        self.connection.send(steps)
        return self.connection.recv()

    def end_round(self) -> None:
        self.connection.send(None)

    def close(self) -> None:
        self.connection.send(None)
        self.process.join(60)


# --- measurements --------------------------------------------------------------------


def _spread(values: list[float]) -> dict:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "p25": q[0], "p75": q[2], "min": ordered[0], "max": ordered[-1]}


def median_interval(round_pairs: list[list[float]], level: float = 0.95) -> tuple[float, float]:
    """A bootstrap interval for the median pair ratio, resampling whole rounds (a
    round's pairs share its processes' memory layout, so the rounds are the
    independent draws), with a fixed seed so a run's output is reproducible."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(ratio for pairs in rng.choices(round_pairs, k=len(round_pairs)) for ratio in pairs)
        for _ in range(BOOTSTRAP_RESAMPLES)
    )
    tail = (1 - level) / 2
    return medians[int(tail * len(medians))], medians[int((1 - tail) * len(medians)) - 1]


def paired(names: list[str], workload: Workload, rounds: int, pairs: int, against: str = "base") -> dict:
    """Ratios of each variant to ``against``, pair by pair, over ``rounds`` sets of fresh processes.

    Each variant warms up in a template process, and each round forks a fresh
    worker per variant from its template (the rounds of a template start from
    the same state: they run the same steps). A process's memory layout alone
    moves its speed by up to ~1 % for its whole life, and forks share their
    template's: every ``TEMPLATE_ROUNDS`` rounds a new generation of templates,
    laid out differently, takes over. Within a round the variants take turns
    in rotating order, a chunk each."""
    times: dict[str, list[float]] = {name: [] for name in names}
    finished: dict[str, list[int]] = {name: [] for name in names}
    helper: dict[str, list[float]] = {name: [] for name in names}
    round_ratios: dict[str, list[float]] = {name: [] for name in names}
    variants: dict[str, Variant] = {}
    steps = 0
    try:
        for round_index in range(rounds):
            if round_index % TEMPLATE_ROUNDS == 0:
                for variant in variants.values():
                    variant.close()
                generation = round_index // TEMPLATE_ROUNDS
                variants = {name: Variant(name, workload, generation) for name in names}
                step_seconds = {name: variant.warm() for name, variant in variants.items()}
                steps = steps or max(2, int(CHUNK_SECONDS / step_seconds[against]))
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                variants[name].start_round(steps)
            start = len(times[against])
            for pair in range(pairs):
                turn = pair % len(order)
                for name in order[turn:] + order[:turn]:
                    elapsed, done, helper_seconds = variants[name].run(steps)
                    times[name].append(elapsed / steps)
                    finished[name].append(done)
                    helper[name].append(helper_seconds)
            for name in names:
                variants[name].end_round()
                round_ratios[name].append(sum(times[name][start:]) / sum(times[against][start:]))
    finally:
        for variant in variants.values():
            variant.close()
    result = {
        "workload": workload.name,
        "rounds": rounds,
        "pairs": rounds * pairs,
        "base_step_ms": 1e3 * statistics.median(times[against]),
    }
    for name in names:
        if name == against:
            continue
        ratios = [t / b for t, b in zip(times[name], times[against])]
        by_round = [ratios[start : start + pairs] for start in range(0, len(ratios), pairs)]
        extra_per_step = statistics.median(t - b for t, b in zip(times[name], times[against]))
        requests_per_step = sum(finished[name]) / (steps * len(times[name]))
        result[name] = {
            "ratio": {**_spread(ratios), "ci95": median_interval(by_round)},
            "round_ratios": round_ratios[name],
            "us_per_step": 1e6 * extra_per_step,
            "us_per_request": 1e6 * extra_per_step / max(requests_per_step, 1e-9),
            # CPU of the helper process (another core), per finished request.
            "helper_us_per_request": 1e6 * sum(helper[name]) / max(1, sum(finished[name])),
        }
    return result


def memory_per_request(workload: Workload) -> float:
    """Bytes held by otel-kvcache and the SDK (the spans) per in-flight request."""
    _instrument()
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
    from otel_kvcache.leaks import RECONCILE_BUDGET

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
