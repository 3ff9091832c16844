"""The main job: serve a tiny model under `opentelemetry-instrument`, load it, read the telemetry back.

    scripts/demo.sh [--short] [--out DIR] [--num-blocks N] [--keep-serving]

``scripts/demo.sh`` builds the environment first if it needs to, then runs
``python -m demo``. Spans and metrics go to OTLP JSON files in ``DIR/otlp``
through a local OTLP receiver, unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set:
then they go to that collector, and the report is left to your backend;
otherwise the table is printed and ``DIR/report.html`` written (``otel-kvcache report``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import NamedTuple

from rich.console import Console

from demo.load import TENANT_KEY, LoadShape, run_load
from demo.otlp_sink import OTLPSink
from demo.report import (
    format_curve,
    format_holders,
    format_summary,
    holders_summary,
    format_table,
    kv_spans,
    pool_summary,
    projected_curve,
    request_rows,
)
from demo.server import (
    EXCLUDE_ASGI_SPANS,
    EXCLUDED_ASGI_SPANS,
    ServerConfig,
    VLLMServer,
    prefix_cache_hit_ratio,
    requests_ended_on_their_own,
)
from demo.tiny_model import make_tiny_model
from demo.top_frame import BusiestFrame
from otel_kvcache import config, names
from otel_kvcache.commands import gate
from otel_kvcache.commands.command_line import CommandLine
from otel_kvcache.commands.report.build import write as write_report
from otel_kvcache.commands.top.frame import View, render

SERVED_MODEL_NAME = "tiny-llama"
BLOCK_SIZE, MAX_MODEL_LEN = ServerConfig.block_size, ServerConfig.max_model_len
FEWEST_BLOCKS = -(-MAX_MODEL_LEN // BLOCK_SIZE) + 1
"""vLLM starts only if its longest request fits the pool, beside the null block it keeps."""
ATTRIBUTION_SETTINGS = {
    config.BAGGAGE_KEYS: TENANT_KEY,
    config.ATTRIBUTION: f"{names.MODEL},{TENANT_KEY}",
}
"""Who holds the KV cache, by model and by the tenant each request's baggage names."""
SETTLE_SECONDS = 2.5
"""With --keep-serving: how long the last exports are given before the results are read
(as ``VLLMServer.stop`` gives them before it stops the server)."""

SHORT_LOAD = LoadShape(chats=4, turns=3, chat_max_tokens=96, burst=4, burst_max_tokens=16, streams=2)

DESCRIPTION = """\
The main job: makes a tiny random-weight llama, serves it with vLLM's OpenAI
server on the CPU under opentelemetry-instrument, loads it (requests sharing one
system prompt, multi-turn chats, streaming clients that leave mid-answer), then
prints each request's KV span, the pool's metrics and the leak gate's verdict,
and writes a picture of it all to DIR/report.html. With --keep-serving, vLLM
then keeps serving, for otel-kvcache top and requests of your own, until Ctrl-C.
scripts/demo.sh builds the environment (.venv) first if it needs to."""

EPILOG = f"""\
environment:
  OTEL_EXPORTER_OTLP_ENDPOINT        send the telemetry to this collector
                                     instead of DIR/otlp (then no report)
  {EXCLUDE_ASGI_SPANS}  ASGI spans FastAPI's instrumentation
                                     leaves out (default here: {EXCLUDED_ASGI_SPANS})"""


class Progress:
    """One line per step, with a spinner while a slow step runs."""

    def __init__(self) -> None:
        self.console = Console(stderr=True, highlight=False)

    @contextmanager
    def step(self, text: str):
        started = time.monotonic()
        with self.console.status(f"{text} ..."):
            yield self
        self.console.print(f"[green]✓[/green] {text} ({time.monotonic() - started:.0f}s)")

    def note(self, text: str) -> None:
        self.console.print(f"  · {text}")


def held_blocks_exported(sink: OTLPSink) -> bool:
    """Whether a metric collection has found blocks held (``vllm.kv_cache.held_blocks``):
    the holders' table and the report's chart of them are read from those points."""
    points = (point for _, metric in sink.metrics(names.HELD_BLOCKS) for point in metric.gauge.data_points)
    return any(point.as_double > 0 for point in points)


def aborted(count: int) -> str:
    """The requests vLLM's engine did not end: aborted when their clients left."""
    if count == 0:
        return "none was aborted: every streaming client's request ended in the engine first"
    if count == 1:
        return "the other one was aborted when its client left"
    return f"the other {count} were aborted when their clients left"


def command(script: str, *arguments: object) -> str:
    """One of this environment's commands as the user can paste it where they stand (the
    environment need not be active): its path from there, or from the root above it."""
    path = Path(sys.executable).parent / script
    if path.is_relative_to(Path.cwd()):
        path = Path(".", path.relative_to(Path.cwd()))
    return shlex.join([str(path), *map(str, arguments)])


def vllm_failure(log_path: Path) -> str:
    """What vLLM said when it failed: the first exception its log names, raised or logged
    as an error by one of its processes (the cause; the API server's own, "Engine core
    initialization failed", comes after)."""
    raised = re.compile(r"^(?:\(.*?\) ERROR .*?\] )?\s*([\w.]*(?:Error|Exception): .*)")
    lines = log_path.read_text(errors="replace").splitlines()
    for at, line in enumerate(lines):
        if found := raised.match(line):
            # pydantic's (vLLM's configuration) says what was wrong on the indented line after
            detail = lines[at + 1].strip() if at + 1 < len(lines) and lines[at + 1][:1].isspace() else ""
            return f"{found.group(1)}: {detail}" if detail else found.group(1)
    return "no exception in its log"


def main(argv: list[str] | None = None) -> int:
    parser = CommandLine(
        prog="scripts/demo.sh",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out"), metavar="DIR",
                        help="where the model, logs and OTLP files go, from where you stand (default: out)")
    parser.add_argument("--short", action="store_true", help="a shorter load, as CI runs it")
    parser.add_argument("--keep-serving", action="store_true",
                        help="after the load and its results, keep vLLM serving (and its telemetry going) until Ctrl-C")
    parser.add_argument("--num-blocks", type=int, default=64, metavar="N",
                        help=f"vLLM's KV blocks of {BLOCK_SIZE} tokens, one of them its null block "
                             f"(default: 64, a 63-block pool; at least {FEWEST_BLOCKS})")
    args = parser.parse_args(argv)
    if args.num_blocks < FEWEST_BLOCKS:
        parser.error(
            f"--num-blocks {args.num_blocks} is too few: vLLM needs its longest request ({MAX_MODEL_LEN} tokens) "
            f"to fit the pool, {FEWEST_BLOCKS - 1} blocks of {BLOCK_SIZE} tokens beside its null block: "
            f"use --num-blocks {FEWEST_BLOCKS} or more"
        )
    progress = Progress()
    collector = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")

    with progress.step("making a tiny random-weight llama and its tokenizer"):
        model = make_tiny_model(args.out / "tiny-llama")

    sink = None if collector else OTLPSink(args.out / "otlp").start()
    endpoint = collector or sink.endpoint
    server = VLLMServer(
        ServerConfig(
            model=model, otlp_endpoint=None if collector else sink.endpoint, num_blocks=args.num_blocks,
            served_model_name=SERVED_MODEL_NAME, extra_env=ATTRIBUTION_SETTINGS,
        ),
        args.out / "vllm-server.log",
    )  # fmt: skip
    shape = SHORT_LOAD if args.short else LoadShape()
    try:
        pool = f"{args.num_blocks - 1} KV blocks + 1 null"  # vLLM keeps one of --num-blocks as its null block
        try:
            with progress.step(f"starting vLLM (CPU) under opentelemetry-instrument, {pool}"):
                server.start()
        except (RuntimeError, TimeoutError) as failed:
            progress.note(f"{failed}: {vllm_failure(server.log_path)}")
            return 1
        progress.note(f"server {server.url}, telemetry to {endpoint}")
        progress.note(f"{EXCLUDE_ASGI_SPANS}={server.environment()[EXCLUDE_ASGI_SPANS]}")
        for variable, value in ATTRIBUTION_SETTINGS.items():
            progress.note(f"{variable}={value}")
        watch = BusiestFrame(SERVED_MODEL_NAME, exported=None if sink is None else partial(held_blocks_exported, sink))
        with progress.step("running the load through the OpenAI API"), watch as top:
            load = run_load(
                server.url, server.config.model_name, shape, progress=progress.note, streams_stay_until=top.load_seen
            )
            sent = asyncio.run(load)
        progress.note(
            f"otel-kvcache top read {len(top.snapshots)} snapshots of the engine during the load,"
            f" at most {top.widest_gap():.1f} s apart"
        )
        # vLLM's own view, to read the table against: which requests its engine ended.
        time.sleep(1)  # the API server's stats trail the last responses
        metrics_text = server.metrics_text()
        vllm_says = VLLMSays(requests_ended_on_their_own(metrics_text), prefix_cache_hit_ratio(metrics_text))
        if args.keep_serving:
            time.sleep(SETTLE_SECONDS)  # the load's last spans and metrics reach the files
            code = show_results(args, sent, top, vllm_says, collector, server, progress)
            return serve_until_stopped(server, endpoint) or code
    finally:
        with progress.step("stopping vLLM; its processes flush their telemetry"):
            server.stop()
        if sink is not None:
            sink.stop()
    return show_results(args, sent, top, vllm_says, collector, server, progress)


class VLLMSays(NamedTuple):
    """vLLM's own view of the load, from its /metrics."""

    ended_in_engine: dict[str, int]
    hit_ratio: float | None


def show_results(args, sent, top, vllm_says: VLLMSays, collector, server, progress) -> int:
    """Prints the load's telemetry, the leak gate's verdict and the commands to go further;
    writes the report. 0 when every request has its span and the gate passes."""
    failed = [s for s in sent if s.status != 200]
    if failed:
        progress.note(f"{len(failed)} requests failed; see {server.log_path}")
        return 1
    if collector:
        progress.note(f"{len(sent)} requests sent; spans and metrics went to {collector}")
        return 0

    if top.frame is not None:  # the engine's own live snapshot, as `otel-kvcache top` reads it
        (args.out / "top.json").write_text(json.dumps(top.frame, indent=2))
        print("otel-kvcache top --once, at the busiest moment of the load:")
        Console(width=120, highlight=False).print(render(top.frame, View()))
        print()
    otlp = args.out / "otlp"
    spans = kv_spans(otlp / "traces.jsonl")
    scenario_by_trace = {s.trace_id: s.scenario for s in sent}
    print(format_table(request_rows(spans, scenario_by_trace)))
    print()
    print(format_summary(pool_summary(otlp / "metrics.jsonl")))
    print()
    print(format_holders(holders_summary(otlp / "metrics.jsonl", spans)))
    print()
    curve, free_scale = projected_curve(otlp / "metrics.jsonl")
    print(format_curve(curve, free_scale, vllm_says.hit_ratio))
    print()
    ended = ", ".join(f"{reason} {count}" for reason, count in sorted(vllm_says.ended_in_engine.items()))
    print(f"vLLM's /metrics, requests its engine ended (vllm:request_success_total): {ended or 'none'};")
    print(f"  {aborted(len(sent) - sum(vllm_says.ended_in_engine.values()))}")
    print(f"{len(spans)} KV spans for {len(sent)} requests; OTLP JSON in {otlp}/traces.jsonl and metrics.jsonl")
    print(f"leak gate ({command('otel-kvcache-gate', '--otlp-dir', otlp)}):")
    leaks = gate.main(["--otlp-dir", str(otlp)])
    report_path = args.out / "report.html"
    write_report(otlp, report_path)
    print(f"report ({command('otel-kvcache', 'report', '--otlp-dir', otlp, '-o', report_path)}): {report_path}")
    return 0 if len(spans) == len(sent) and leaks == 0 else 1


def serve_until_stopped(server: VLLMServer, endpoint: str) -> int:
    """Says how to watch and use the server, then waits for SIGINT or SIGTERM (the server,
    in a session of its own, gets neither from the terminal). 1 if vLLM exits first."""
    request = json.dumps({"model": SERVED_MODEL_NAME, "prompt": "Who holds the KV cache?", "max_tokens": 32})
    print()
    print(f"vLLM keeps serving at {server.url} (model {SERVED_MODEL_NAME}), its telemetry going to {endpoint}.")
    print(f"  watch its KV cache: {command('otel-kvcache', 'top')}")
    print(f"  send it a request:  curl -s {server.url}/v1/completions -H 'Content-Type: application/json' "
          f"-d {shlex.quote(request)}")  # fmt: skip
    print(f"  stop it: Ctrl-C here (or kill -INT {os.getpid()})", flush=True)
    stopped = threading.Event()
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: stopped.set())
    while not stopped.wait(1.0):
        if server.process.poll() is not None:
            print(f"vLLM exited with {server.process.returncode}; see {server.log_path}", flush=True)
            return 1
    return 0

if __name__ == "__main__":
    sys.exit(main())
