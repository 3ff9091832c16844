"""What otel-kvcache costs vLLM's scheduler loop, in instructions: deterministic where time is not.

    python -m benchmarks.instructions [--steps N] [--workloads decode-heavy,churn,wide] [--cache-sim]
    python -m benchmarks.instructions --without whatif,attribution,mirror,handover   # what each part costs

``tests/test_overhead_gate.py`` runs a shorter count of each workload through
``measure`` and fails when one exceeds its target.

On a shared 2-core machine the paired timings of ``benchmarks.overhead``
wander by ±5 % between two identical processes, more than the 1 % to be
shown. Valgrind's callgrind counts the instructions the engine process
executes instead, and gives the same count for the same run whatever else the
machine does. For each workload, an uninstrumented and an instrumented process
(as in ``benchmarks.overhead``: spans through the helper process) drive the
real scheduler past its first wave, then count ``--steps`` steps. The helper
process is not counted (it runs on another core); what the engine thread
hands it is.

Both processes run with the same ``PYTHONHASHSEED`` (``--seed``): the seed alone
moves the engine's own count by about 0.5 %.

So does the memory layout, by up to 0.35 % on churn: two processes with one
environment count the same to the instruction, but a few bytes more in the
environment move where every later object lands, and CPython's type attribute
cache is indexed by the address of the attribute's name and the type's version
tag, so which of vLLM's attribute lookups collide there (``find_name_in_mro``)
changes with them, as does how often obmalloc's pools empty and refill. An
instrumented process has a layout of its own whatever is done, so one pair of
processes carries that lottery. ``--layouts N`` counts each variant at N
layouts (``LAYOUT_PADDING``) and compares the sums.

Instructions are not time: a miss in the caches costs many of them. With
``--cache-sim``, callgrind also simulates the first-level caches and a core's
own last level, and the overhead is given in valgrind's estimate of cycles
(``estimated_cycles``) as well: still deterministic, still only a model.

The instrumentation's timers run on wall time, which valgrind stretches
unevenly: how many of their rounds fell inside the window would move the count
by more than a target's width from one run to the next. So none runs in a
counted process:

- the engine thread's own chores, due once a second (the pool's settling, its
  share of the hand-over to the helper), are done once at the end of the window,
  counted with it: what they do grows with the window's requests, and is all
  there (the warm-up's are done before the window, uncounted);
- what runs off the engine thread (the pipe's thread's marshal and write of
  what the window handed over, the metric reader's collection, a round of
  ``otel-kvcache top``'s snapshot, unwatched and watched) is counted apart, once
  each after the window, and printed beside the overhead;
- the leak reconciliation (one pass per 5 s of wall time, costed separately by
  ``benchmarks.overhead``) is left out.

CPython's garbage collector is off in the window, in both processes, and priced
apart. It collects the young generation each time 700 more tracked objects have
been allocated than freed: three times in churn's 50 steps. What a collection
walks is whichever of vLLM's objects are young at that instant, so an
instrumentation that leaves one object more or fewer moves the count by up to
0.3 % either way (``benchmarks/RESULTS.md``), a lottery, not a cost. The cost
is how much sooner collections come: the tracked objects the window leaves,
instrumented less plain, per finished request (``tracked_per_finished_request``),
which the gate bounds (``MOST_TRACKED_PER_REQUEST``).
"""

from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from statistics import median

from benchmarks.scheduler_driver import TARGETS, against_target, workloads

MISSING_VALGRIND = "valgrind is not installed (Debian: apt-get install valgrind)"


MOST_TRACKED_PER_REQUEST = 2.0
"""Tracked objects the instrumentation may leave per finished request (see the module's
docstring): vLLM leaves about 10 (churn); the runs the pool's mirror appends, one a
release and reused at each settling, are the one it leaves now."""

LAYOUT_PADDING = "OTEL_KVCACHE_BENCHMARK_LAYOUT_PADDING"
"""An environment variable 97 bytes longer at each layout: what moves a process's memory layout
(see the module's docstring), and nothing else. Over three layouts, steps of 64 bytes moved
vLLM's count on churn by 0.07 %; steps of 97, by 0.30 %, near the 0.35 % of every padding tried
(``benchmarks/RESULTS.md``)."""

NEVER_SECONDS = 10.0**9
"""An interval no run reaches: a timer's work is done on cue instead (``_child``)."""


def _callgrind(*arguments: str) -> None:
    subprocess.run(["callgrind_control", *arguments, str(os.getpid())], check=True, capture_output=True)


def _counted(part: str, work) -> None:
    """Counts ``work()`` alone, into a dump of its own named ``part``."""
    _callgrind("--instr=on")
    work()
    _callgrind("--instr=off")
    _callgrind(f"--dump={part}")


def _child(variant: str, workload_name: str, steps: int) -> None:
    """Runs inside valgrind: warm up uncounted, count ``steps`` steps, then the timed chores apart."""
    from benchmarks.instrumented import instrument
    from benchmarks.scheduler_driver import Driver
    from otel_kvcache.wiring.patch import ENGINE_ATTRIBUTE

    os.environ["OTEL_KVCACHE_RECONCILE_SECONDS"] = str(10**9)
    instrumented = variant.startswith("otel")
    if instrumented:
        from otel_kvcache.engine import live_snapshot, pool
        from otel_kvcache.export import helper_pipe

        # Every timer of ours, off: how many of its rounds fell inside the window
        # would follow the wall clock, which valgrind stretches unevenly.
        for module, interval in (
            (pool, "CATCH_UP_SECONDS"), (helper_pipe, "FLUSH_SECONDS"), (live_snapshot, "PUBLISH_SECONDS"),
        ):  # fmt: skip
            setattr(module, interval, NEVER_SECONDS)
        if ":" in variant:  # otel-without:PARTS (--without): before the hooks take the methods in
            from benchmarks.instrumented import empty

            empty(variant.partition(":")[2])
        meter_provider = instrument(export_interval_millis=int(NEVER_SECONDS * 1000))
    from vllm.utils.gc_utils import freeze_gc_heap

    workload = {w.name: w for w in workloads()}[workload_name]
    driver = Driver(workload)
    driver.top_up()
    driver.run(2 * workload.output_len)  # past the first wave: a steady mix of ages, as in benchmarks.overhead
    if instrumented:  # the warm-up's chores, as they would have run by now: the window's are its own
        engine = getattr(driver.scheduler, ENGINE_ATTRIBUTE)
        engine.pool.catch_up()
        engine.record_sink.flush()
        written_by = time.monotonic() + 120  # the pipe's thread writes the rest as the helper reads
        while engine.record_sink.unwritten:
            if time.monotonic() > written_by:  # it would write during the window, and be counted there
                raise RuntimeError(f"the warm-up's frame was not written: {engine.record_sink.unwritten} bytes left")
            time.sleep(0.05)
        meter_provider.force_flush()  # the what-if curve and the series' counts catch up there
    freeze_gc_heap()
    gc.disable()  # priced apart (see the module's docstring)
    finished, tracked = driver.finished, gc.get_count()[0]

    def window() -> None:
        driver.run(steps)
        if instrumented:  # the chores of the window's steps, due once a second: done once, counted with them
            engine.pool.catch_up()
            engine.record_sink.queue_pending()  # the engine thread's share of the hand-over

    _counted("window", window)
    print("FINISHED", driver.finished - finished, "TRACKED", gc.get_count()[0] - tracked, flush=True)
    if instrumented:  # off the engine thread: costed apart
        from otel_kvcache import VLLMKVCacheInstrumentor
        from otel_kvcache.engine.snapshot_files import read_snapshots

        publisher = VLLMKVCacheInstrumentor()._publisher
        _counted("hand-over", engine.record_sink.flush)  # what the pipe's thread does with the window's
        _counted("metric collection", meter_provider.force_flush)
        _counted("top snapshot", publisher.publish)
        read_snapshots()  # as `otel-kvcache top` reads: the engines publish in full while watched
        _counted("top snapshot, watched", publisher.publish)


# With --cache-sim: the simulated last level is a core's own 2 MB (16-way), not the
# shared L3 valgrind would take from this machine (hundreds of MB, which would
# hold everything), and cycles are estimated with the weights valgrind's
# documentation gives: an instruction 1, a first-level miss 10, a last-level miss 100.
SIMULATED_LAST_LEVEL = "--LL=2097152,16,64"


def estimated_cycles(events: dict[str, int]) -> int:
    first_level = events["I1mr"] + events["D1mr"] + events["D1mw"]
    last_level = events["ILmr"] + events["DLmr"] + events["DLmw"]
    return events["Ir"] + 10 * first_level + 100 * last_level


def _dumps(directory: str) -> dict[str, dict[str, int]]:
    """Each ``--dump=part``'s events, by part (``callgrind.out.1``, ``.2``, ... in turn)."""
    parts = {}
    for path in sorted(glob.glob(f"{directory}/callgrind.out.*"), key=lambda p: int(p.rsplit(".", 1)[1])):
        with open(path) as f:
            text = f.read()
        part = re.search(r"^desc: Trigger: dump (.+)$", text, re.M).group(1)
        names = re.search(r"^events: (.+)$", text, re.M).group(1).split()
        totals = re.search(r"^totals: (.+)$", text, re.M).group(1).split()
        parts[part] = dict(zip(names, map(int, totals)))
    return parts


def count(
    variant: str, workload_name: str, steps: int, seed: int, cache_sim: bool = False, layout: int = 0
) -> dict:
    """The ``window``'s events, the number of requests finished in it, and (instrumented)
    each timed chore's events apart, by part, at memory layout number ``layout``."""
    with tempfile.TemporaryDirectory() as directory:
        result = subprocess.run(
            [
                "valgrind", "--tool=callgrind", "--instr-atstart=no",
                *(["--cache-sim=yes", SIMULATED_LAST_LEVEL] if cache_sim else []),
                f"--callgrind-out-file={directory}/callgrind.out",
                sys.executable, "-m", "benchmarks.instructions", "--child", variant, workload_name, str(steps),
            ],
            capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            env={**os.environ, "PYTHONHASHSEED": str(seed), "OTEL_KVCACHE_TOP_DIR": f"{directory}/top",
                 LAYOUT_PADDING: "x" * 97 * layout},
        )  # fmt: skip
        finished = re.search(r"FINISHED (\d+) TRACKED (-?\d+)", result.stdout)
        if result.returncode != 0 or not finished:
            raise RuntimeError(f"{variant} {workload_name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
        parts = _dumps(directory)
    window = parts.pop("window")
    counted = {"instructions": window["Ir"], "finished": int(finished.group(1)), "tracked": int(finished.group(2))}
    counted["apart"] = {part: events["Ir"] for part, events in parts.items()}
    if cache_sim:
        counted["cycles"] = estimated_cycles(window)
    return counted


def _counts(
    variants: list[str], workload_name: str, steps: int, seed: int, layouts: int, cache_sim: bool = False
) -> dict:
    """Each variant's ``count`` at each of ``layouts`` layouts, two processes at a time, summed
    (the timed chores apart: the first layout's), with ``spread``: how far the window's count
    moved between layouts, of its mean, and ``each``: the window's count at each layout."""
    runs = [(variant, layout) for layout in range(layouts) for variant in variants]
    with ThreadPoolExecutor(2) as pool:  # two processes side by side: counts don't mind
        counted = list(pool.map(lambda run: count(run[0], workload_name, steps, seed, cache_sim, run[1]), runs))
    keys = ("instructions", "finished", "tracked", *(["cycles"] if cache_sim else []))
    summed = {}
    for variant in variants:
        counts = [c for (v, _), c in zip(runs, counted) if v == variant]
        each = [c["instructions"] for c in counts]
        summed[variant] = {key: sum(c[key] for c in counts) for key in keys}
        summed[variant].update(
            apart=counts[0]["apart"], spread=(max(each) - min(each)) * layouts / sum(each), each=each
        )
    return summed


def measure(
    workload_names: list[str], steps: int, seed: int = 0, cache_sim: bool = False, layouts: int = 1
) -> Iterator[dict]:
    """Each workload's uninstrumented and instrumented counts, each over ``layouts`` layouts,
    as a result, in turn."""
    for name in workload_names:
        counts = _counts(["base", "otel"], name, steps, seed, layouts, cache_sim)
        base, otel = counts["base"], counts["otel"]
        extra = otel["instructions"] - base["instructions"]
        outcome = {
            "workload": name,
            "steps": steps,
            "seed": seed,
            "layouts": layouts,
            "base_instructions_per_step": base["instructions"] / steps / layouts,
            "base_spread": base["spread"],
            "overhead": extra / base["instructions"],
            # Each layout's pair alone: what one draw of the lottery gives.
            "overhead_by_layout": [o / b - 1 for o, b in zip(otel["each"], base["each"])],
            "target": TARGETS.get(name),
            "instructions_per_finished_request": extra / max(1, otel["finished"]),
            "tracked_per_finished_request": (otel["tracked"] - base["tracked"]) / max(1, otel["finished"]),
            "finished": otel["finished"] // layouts,
            "apart": otel["apart"],
        }
        # What the gate judges: the median layout, which one stray layout does not move.
        outcome["judged_overhead"] = median(outcome["overhead_by_layout"])
        if cache_sim:
            outcome["base_cycles_per_step"] = base["cycles"] / steps / layouts
            outcome["cycles_overhead"] = otel["cycles"] / base["cycles"] - 1
        yield outcome


def take_apart(workload_name: str, steps: int, parts: list[str], seed: int = 0, layouts: int = 1) -> list[dict]:
    """What each part of the instrumentation costs the engine thread on ``workload_name``:
    the instrumented count less that with the part emptied (``benchmarks.instrumented.EMPTIED_METHODS``),
    each over ``layouts`` layouts, per step and per request the full run finished."""
    variants = ["base", "otel", *(f"otel-without:{part}" for part in parts)]
    counts = _counts(variants, workload_name, steps, seed, layouts)
    base, full = counts["base"]["instructions"], counts["otel"]
    rows = [{"part": "everything", "instructions": full["instructions"] - base}]
    for part in parts:
        rows.append({"part": part, "instructions": full["instructions"] - counts[f"otel-without:{part}"]["instructions"]})
    for row in rows:
        row.update(
            workload=workload_name,
            layouts=layouts,
            per_step=row["instructions"] / steps / layouts,
            per_finished_request=row["instructions"] / max(1, full["finished"]),
            share_of_base=row["instructions"] / base,
        )
    return rows


def report(outcome: dict) -> str:
    name = outcome["workload"]
    lines = [
        f"{name:<14} base {outcome['base_instructions_per_step'] / 1e6:.1f} M instructions/step | "
        f"instrumented +{100 * outcome['overhead']:.2f} % ({against_target(outcome['judged_overhead'], name)}) | "
        f"{outcome['instructions_per_finished_request'] / 1e3:.0f} k instructions, "
        f"{outcome['tracked_per_finished_request']:.1f} tracked objects left per finished request"
    ]
    if outcome["layouts"] > 1:
        lines.append(
            f"{'':<14} summed over {outcome['layouts']} memory layouts "
            f"(each alone: {', '.join(f'{100 * o:+.2f} %' for o in outcome['overhead_by_layout'])}; "
            f"the target judges the median, {100 * outcome['judged_overhead']:+.2f} %), "
            f"between which vLLM's own count moved {100 * outcome['base_spread']:.2f} %"
        )
    if outcome.get("apart"):
        lines.append(
            f"{'':<14} apart, off the engine thread: "
            + ", ".join(f"{part} {events / 1e6:.1f} M" for part, events in outcome["apart"].items())
        )
    if "cycles_overhead" in outcome:
        lines.append(
            f"{'':<14} base {outcome['base_cycles_per_step'] / 1e6:.1f} M estimated cycles/step | "
            f"instrumented +{100 * outcome['cycles_overhead']:.2f} % "
            f"({against_target(outcome['cycles_overhead'], name)})"
        )
    return "\n".join(lines)


def report_part(row: dict) -> str:
    """One ``take_apart`` row, as ``--without`` prints it."""
    return (
        f"{row['workload']:<14} {row['part']:<12} {row['per_step'] / 1e3:8.0f} k instructions/step "
        f"{row['per_finished_request'] / 1e3:6.1f} k per finished request "
        f"({100 * row['share_of_base']:.2f} % of vLLM's, {row['layouts']} layout(s))"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.instructions")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workloads", default="decode-heavy,churn,wide")
    parser.add_argument("--seed", type=int, default=0, help="PYTHONHASHSEED of both processes")
    parser.add_argument(
        "--cache-sim", action="store_true", help="also simulate the caches and estimate cycles (about 3x slower)"
    )
    parser.add_argument(
        "--without",
        help="take apart: also count with each of these parts emptied, comma-separated "
        "(mirror, records, whatif, misses, attribution, handover: benchmarks.instrumented.EMPTIED_METHODS)",
    )
    parser.add_argument(
        "--layouts", type=int, default=1, help="count each variant at this many memory layouts and compare the sums"
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variant, workload_name, steps = args.child
        _child(variant, workload_name, int(steps))
        return 0
    if not shutil.which("valgrind"):
        print(MISSING_VALGRIND, file=sys.stderr)
        return 2

    workload_names = args.workloads.split(",")
    if args.without:
        parts = args.without.split(",")
        outcomes = (
            row for name in workload_names for row in take_apart(name, args.steps, parts, args.seed, args.layouts)
        )
        show = report_part
    else:
        outcomes = measure(workload_names, args.steps, args.seed, args.cache_sim, args.layouts)
        show = report
    results = []
    for outcome in outcomes:
        results.append(outcome)
        print(show(outcome), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0

if __name__ == "__main__":
    sys.exit(main())
