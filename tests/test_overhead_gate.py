"""The overhead gate: each workload's instructions, plain against instrumented, within its target.

Instructions, not time: on a shared machine two identical processes' timings
wander by more than the 1 % to be shown, while callgrind gives the same count
for the same run (``benchmarks.instructions``, whose module docstring says what
is counted and what is not).

``STEPS`` counted steps per workload, half the benchmark's 100: most of the
gate's time is fixed (importing vLLM under valgrind, and the warm-up past the
first wave, uncounted but still under valgrind). No timer of ours runs inside
the window (``benchmarks.instructions`` says how each is costed), so the count
does not follow the wall clock; fewer steps would make the once-a-window
chores weigh more.

valgrind missing fails the gate rather than skipping it: the test command
installs it (``scripts/test.sh``), and a skip would pass a change that nobody measured.
"""

from __future__ import annotations

import shutil

import pytest

from benchmarks.instructions import MISSING_VALGRIND, measure, report
from benchmarks.scheduler_driver import TARGETS

STEPS = 50

# Counted from the default environment only: one gate per CI run, on the vLLM the numbers are recorded for.
pytestmark = pytest.mark.overhead_gate


def test_each_workload_within_its_overhead_target():
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        pytest.fail(f"{MISSING_VALGRIND}: the overhead gate needs it (scripts/test.sh installs it)")

    lines, missed = [], []
    for outcome in measure(list(TARGETS), STEPS):
        lines.append(report(outcome))
        print(lines[-1], flush=True)
        if outcome["overhead"] > outcome["target"]:
            missed.append(outcome["workload"])
    assert not missed, f"over target: {', '.join(missed)} ({STEPS} counted steps)\n" + "\n".join(lines)
