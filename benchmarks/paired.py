"""Variants of vLLM's scheduler loop timed against each other in paired processes.

Each variant runs in its own process, driving the real V1 scheduler with fake
model outputs at constant concurrency. ``paired`` alternates timed chunks
between them (a pair = one chunk of each, in rotating order), so drifts of the
machine hit all sides of a pair. A process's memory layout alone moves its
speed by up to ~1 % for its whole life, so each workload takes many rounds,
each with fresh processes: each variant warms up in a template process, and
every round forks a worker from it (forks of one process: the same string
hashes, so the same scheduling decisions; every round runs the same steps);
every ``TEMPLATE_ROUNDS`` rounds a new generation of templates takes over,
each with its heap padded differently, so that no one layout decides a run.
The workers take turns on one CPU; the rest (templates, the coordinating
process, the helper process) runs on the others. Beside each median ratio
it gives a 95 % bootstrap interval, resampling whole rounds: a verdict is
only as firm as that interval is narrow.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import statistics
import time
from multiprocessing.connection import Connection

from benchmarks.instrumented import empty, instrument, unhook
from benchmarks.scheduler_driver import Driver, Workload

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
# The timed workers take turns on one CPU; everything else (the coordinating process,
# the templates, the instrumented side's helper process) runs on the others.
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


# --- the worker processes ------------------------------------------------------------


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


def _helper_cpu_seconds(driver) -> float:
    """CPU time of the engine's helper process so far (0 without one)."""
    engine = getattr(driver.scheduler, "_otel_kvcache_engine", None)
    pid = getattr(getattr(engine, "exporter", None), "helper_pid", None)
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
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
        empty(variant["emptied"])
    if variant.get("instrumented"):
        instrument(helper_exports=variant.get("helper_exports", True))
    driver = Driver(workload, variant["log_stats"], variant.get("kv_cache_metrics_sample"))
    if variant.get("spin_us"):
        driver.step = _spinning(driver.step, variant["spin_us"])
    if variant.get("unhooked"):
        unhook()
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
