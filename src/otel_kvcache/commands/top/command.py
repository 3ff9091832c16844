"""``otel-kvcache top``: the live view, one frame (``--once``), or the JSON frame (``--json``)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from otel_kvcache.commands.command_line import http_url
from otel_kvcache.commands.top.frame import SORT_KEYS, View, device_readings, json_frame, render
from otel_kvcache.engine.snapshot_files import FORGET_AFTER_SECONDS, Published, read_snapshots

TEXTUAL_MISSING = (
    "otel-kvcache top: the live view needs Textual: pip install 'otel-kvcache[top]' "
    "(--once and --json work without it)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="print one frame and exit, as plain nvidia-smi does")
    parser.add_argument("--json", action="store_true", help="print one frame as JSON and exit (docs/top.md)")
    parser.add_argument(
        "--prometheus", metavar="URL", type=http_url,
        help="fleet mode: every replica and engine this Prometheus scrapes (pool lines, no requests)",
    )  # fmt: skip
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default 1)")
    parser.add_argument("--sort", choices=SORT_KEYS, default="blocks", help="requests sorted by (default blocks)")
    parser.add_argument("--filter", default="", help="only requests and holders whose model or baggage contains this")
    parser.add_argument(
        "--forget-after", type=float, default=FORGET_AFTER_SECONDS, metavar="SECONDS",
        help="delete a stale snapshot whose process is gone once it is this old (default 60)",
    )  # fmt: skip


def frame_reader(arguments: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    """Reads a frame from the snapshots on this host, or from Prometheus."""
    if arguments.prometheus:
        from otel_kvcache.commands.top.fleet import read_fleet

        return lambda: json_frame(read_fleet(arguments.prometheus), [], arguments.prometheus)
    from otel_kvcache.gpu.nvml import NVMLSource

    nvml = NVMLSource()
    return lambda: json_frame(read_detailed(arguments.forget_after), device_readings(nvml), "snapshots")


def read_detailed(forget_after: float, patience: float = 5.0) -> list[Published]:
    """The snapshots, once every live engine has published its holders and requests:
    they do only while a reader watches, which this read has just told them."""
    deadline = time.monotonic() + patience
    while True:
        published = read_snapshots(forget_after)
        waiting = [p for p in published if not p.stale and not p.snapshot.get("detailed", True)]
        if not waiting or time.monotonic() > deadline:
            return published
        time.sleep(0.1)


def run(arguments: argparse.Namespace) -> int:
    from otel_kvcache.commands.top.fleet import PrometheusError

    read_frame = frame_reader(arguments)
    view = View(arguments.sort, arguments.filter)
    try:
        if arguments.json:
            json.dump(read_frame(), sys.stdout, indent=2)
            sys.stdout.write("\n")
            return 0
        if arguments.once or not sys.stdout.isatty():
            from rich.console import Console

            Console(width=shutil.get_terminal_size((120, 40)).columns).print(render(read_frame(), view))
            return 0
    except PrometheusError as exc:
        print(f"otel-kvcache top: {exc}", file=sys.stderr)
        return 1
    try:
        from otel_kvcache.commands.top.app import TopApp
    except ImportError:
        print(TEXTUAL_MISSING, file=sys.stderr)
        return 2
    TopApp(read_frame, arguments.interval, view).run()
    return 0
