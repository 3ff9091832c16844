"""The package's rooms: every in-package import, type-only and deferred ones
included, points one way, as the import-linter contracts in ``pyproject.toml`` say
(``docs/design.md``, "Rooms"), and few modules sit beside the rooms.

A circle through a type annotation is still a circle: the two modules can't be
read, tested or moved apart. Where one side calls back into the other, the caller
declares a small ``Protocol`` for what it uses (``engine.leaks.Engine``,
``handover.record.RecordSink``).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import otel_kvcache

pytestmark = pytest.mark.vllm_independent  # the same on every vLLM: tested in the default environment

PACKAGE = Path(otel_kvcache.__file__).parent
PYPROJECT = PACKAGE.parents[1] / "pyproject.toml"
ROOMS = {"engine", "export", "handover", "wiring", "commands", "vllm_compat", "gpu"}
SHARED = {
    "__init__", "names", "config", "errors", "version", "package", "bounds", "trace_context", "process_identity",
}  # fmt: skip


def lint_imports(package_parent: Path) -> subprocess.CompletedProcess:
    """import-linter's verdict on the package found under ``package_parent``, by our contracts."""
    command = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(command), "--config", str(PYPROJECT), "--no-cache"],
        cwd=package_parent,
        env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_import_points_the_way_the_rooms_are_built():
    verdict = lint_imports(PACKAGE.parent)
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr
    assert "3 kept, 0 broken" in verdict.stdout


@pytest.mark.parametrize(
    ("where", "added", "broken"),
    [
        ("engine/pool.py", "def _later():\n    from otel_kvcache.export import spans\n", "Rooms point one way"),
        (
            "handover/record.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from otel_kvcache.engine import telemetry\n",
            "Rooms point one way",
        ),
        ("names.py", "def _later():\n    from otel_kvcache.wiring import plugin\n", "The modules beside the rooms"),
        ("engine/pool.py", "def _later():\n    from otel_kvcache.engine import telemetry\n", "imports it back"),
    ],
    ids=["deferred", "type-only", "beside-the-rooms", "circle-in-a-room"],
)
def test_an_import_against_the_rooms_is_caught(tmp_path, where, added, broken):
    copy = tmp_path / "otel_kvcache"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / where, "a") as module:
        module.write("\n\n" + added)
    verdict = lint_imports(tmp_path)
    assert verdict.returncode == 1, verdict.stdout + verdict.stderr
    assert broken in verdict.stdout.split("Broken contracts")[1]


def test_the_rooms_and_few_modules_beside_them():
    top = {path.stem for path in PACKAGE.glob("*.py")}
    rooms = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert top == SHARED
    assert rooms == ROOMS
    for room in rooms:  # each says what may be done there
        assert ast.get_docstring(ast.parse((PACKAGE / room / "__init__.py").read_text()))
