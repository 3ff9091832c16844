"""A user's mistake on any command line: one line that names it (and the fix, where there
is one), exit 2, no traceback, and nothing started. Each command is run as the user runs
it: the console scripts of this environment, and the main job's script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.vllm_independent  # the commands' own parsing: the default environment runs it


def refused(command: list[str], cwd: Path) -> str:
    """The one line ``command`` says on stderr, after checking it refused the input."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and not result.stdout, result.stderr
    (line,) = result.stderr.splitlines()
    return line


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["otel-kvcache-gate", "--otlp-dir", "nowhere"], "argument --otlp-dir: nowhere is not a directory"),
        (["otel-kvcache-gate", "--otlp-dir", ".", "--max-orphaned", "1"], "unrecognized arguments: --max-orphaned 1"),
        (
            ["otel-kvcache-gate", "--prometheus", "localhost:9464/metrics"],
            "not an http:// or https:// address; did you mean http://localhost:9464/metrics?",
        ),
        (
            ["otel-kvcache", "top", "--prometheus", "localhost:9999"],
            "not an http:// or https:// address; did you mean http://localhost:9999?",
        ),
        (["otel-kvcache", "top", "--pro", "http://localhost:9090"], "unrecognized arguments: --pro"),
        (["otel-kvcache", "tpo"], "invalid choice: 'tpo'"),
        (["otel-kvcache", "report", "--otlp-dir", "nowhere"], "nowhere is not a directory"),
    ],
    ids=["gate-no-directory", "gate-abbreviated", "gate-no-scheme", "top-no-scheme", "top-abbreviated",
         "unknown-command", "report-no-directory"],  # fmt: skip
)
def test_each_command_names_the_mistake_in_one_line(command, said, tmp_path):
    line = refused([str(BIN / command[0]), *command[1:]], tmp_path)
    assert line.startswith(command[0]) and said in line, line


def test_the_main_job_checks_its_arguments_before_it_starts_anything(tmp_path):
    demo = str(REPO / "scripts" / "demo.sh")
    # An option abbreviated: argparse would take it for --num-blocks.
    assert "unrecognized arguments: --num-block 8" in refused([demo, "--num-block", "8"], tmp_path)
    # Too few blocks for the model's longest request: vLLM would fail a minute later.
    line = refused([demo, "--num-blocks", "8", "--out", "here"], tmp_path)
    assert "--num-blocks 8 is too few" in line and "use --num-blocks 33 or more" in line, line
    assert not (tmp_path / "here").exists()
