"""vLLM's own code runs exactly as CPython specializes it without the instrumentation.

A hook can slow vLLM's loop without running a line on it: a class changed once
vLLM's code ran, an instance whose attributes get moved into a dict, objects of
other types handed to vLLM's code all leave vLLM's instructions unspecialized
(PEP 659). ``benchmarks/specialization.py`` compares every instruction of the
vLLM functions that ran, uninstrumented and instrumented, each process warmed
up the same way; a control process that gives vLLM's methods back after its
warm-up shows that the comparison sees such a change.
"""

from __future__ import annotations

import multiprocessing
import sys

import pytest

from benchmarks.specialization import compare, specialized

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="CPython specializes from 3.11 on")

WORKLOAD = "churn"  # the shortest warm-up (two waves of 64-token outputs), admissions and releases every step


@pytest.mark.slow
def test_vllm_code_is_specialized_as_without_the_instrumentation(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where each process makes its model's config
    variants = ("base", "otel", "control")
    with multiprocessing.get_context("spawn").Pool(len(variants)) as pool:  # instrumenting is for a process's life
        base, instrumented, control = pool.starmap(specialized, [(WORKLOAD, variant) for variant in variants])

    scheduler_loop = [name for name in base if name.endswith(("Scheduler.schedule", "Scheduler.update_from_output"))]
    assert len(scheduler_loop) == 2, "vLLM's scheduler loop must have run for the comparison to mean anything"
    assert compare(base, instrumented) == {"differing": {}, "ran_in_one_only": []}
    # The control changed vLLM's classes under code specialized for them: the comparison must see it.
    assert compare(base, control)["differing"]
