"""``otel-kvcache report``: the argument parsing, the messages and the exit codes.

Exit 0 when the report was written (its path printed), 2 when there is
nothing to draw it from or the report extra is not installed; the message
says which, and what to do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXTRA_MISSING = (
    "otel-kvcache report: the report extra is not installed ({missing}); "
    "install it from otel-kvcache's checkout with: pip install '.[report]'"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-dir", type=Path, required=True, metavar="DIR",
                        help="directory with traces.jsonl and metrics.jsonl (OTLP JSON lines)")
    parser.add_argument("-o", "--output", type=Path, default=Path("report.html"), metavar="FILE",
                        help="the HTML file to write (default: report.html)")  # fmt: skip


def _missing_extra() -> str | None:
    for module in ("altair", "vl_convert"):
        try:
            __import__(module)
        except ImportError:
            return module
    return None


def run(arguments: argparse.Namespace) -> int:
    missing = _missing_extra()
    if missing:
        print(EXTRA_MISSING.format(missing=missing), file=sys.stderr)
        return 2
    from otel_kvcache.commands.report.build import NothingToReport, write

    try:
        write(arguments.otlp_dir, arguments.output)
    except NothingToReport as nothing:
        print(f"otel-kvcache report: nothing to report: {nothing}", file=sys.stderr)
        return 2
    print(arguments.output)
    return 0
