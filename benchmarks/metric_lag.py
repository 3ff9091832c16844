"""How late the engine's metric collections arrive, idle and while streams decode flat out.

    python -m benchmarks.metric_lag [--interval-ms 1000] [--seconds 20] [--streams 4]
                                    [--env NAME=VALUE ...] [--server-arg ARG ...]

Serves the tiny model as the main job does (``demo.server.VLLMServer`` under
``opentelemetry-instrument``, the main job's attribution settings), its telemetry going
to a local OTLP/gRPC receiver (``demo.otlp_sink.OTLPSink``, writing OTLP JSON files as
the main job's does) that notes when each metric export arrives and from which process.
Four phases: idle; ``--streams`` streaming chat completions decoding flat out (each one
followed at once by the next) from this process, the receiver's, as the main job loads
from its own; the same load from a process of its own; idle again.

The SDK's ``PeriodicExportingMetricReader`` waits the interval after each export
returns, so an export is late by what its gap from the one before exceeds the interval;
that is split into

- wake: from the previous export's arrival to this collection's first data point (the
  reader's thread waking up and getting the interpreter lock, and the previous
  export's answer on its way back);
- collect: from the first data point's timestamp to the last (the observable
  instruments' callbacks run between them);
- export: from the last data point's timestamp to the arrival (encoding, gRPC, and the
  receiver's process taking the request in).

The control: a process of nothing but the SDK's reader and one gauge, exporting to the
same receiver at the same interval, which also notes how long each export call took.
If the engine's exports are no later than the control's, the lag is not the engine's.
The server's processes' CPU use in each phase is printed with them. ``--env`` and
``--server-arg`` pass variables and command-line arguments to the server (e.g.
``--server-arg=--distributed-executor-backend --server-arg=uni``).

``--spin-probe`` starts no server: the control alone, its main thread spinning for the
middle third of ``3 * --seconds`` as vLLM's shared-memory queue waits (``os.sched_yield``),
then, in a second process, running Python bytecode flat out; it prints how late the
reader's exports came before, during and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from demo.__main__ import ATTRIBUTION_SETTINGS, SERVED_MODEL_NAME
from demo.load import QUESTIONS, SYSTEM_PROMPT
from demo.otlp_sink import OTLPSink, attributes_of
from demo.server import ServerConfig, VLLMServer
from demo.tiny_model import make_tiny_model
from otel_kvcache import names


@dataclass
class Export:
    """One metric export as it arrived."""

    arrived: float
    """Wall-clock seconds."""
    first_point: float
    """The earliest data point's timestamp: a gauge's point carries when its callback
    observed it, so about when the collection's callbacks began."""
    last_point: float
    """The latest: a sum's point carries the time the SDK takes once every callback has run."""


class TimedSink(OTLPSink):
    """An OTLP receiver that notes each metric export's arrival, by process role and pid."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.exports: dict[tuple[str, int], list[Export]] = {}

    def _keep(self, kind: str, request) -> None:
        arrived = time.time()
        if kind == "metrics":
            for resource_metrics in request.resource_metrics:
                resource = attributes_of(resource_metrics.resource.attributes)
                stamps = [
                    point.time_unix_nano / 1e9
                    for scope in resource_metrics.scope_metrics
                    for metric in scope.metrics
                    for point in _points(metric)
                ]
                if stamps:
                    # The EngineCore's exporter helper process exports under the EngineCore's resource.
                    role = str(resource.get(names.PROCESS_ROLE))
                    if role == names.ROLE_ENGINE_CORE and not _holds(resource_metrics, names.BLOCKS):
                        role += " (exporter helper)"
                    key = (role, int(resource.get("process.pid", 0)))
                    with self._lock:
                        self.exports.setdefault(key, []).append(Export(arrived, min(stamps), max(stamps)))
        super()._keep(kind, request)  # written to OTLP JSON files, as the main job's receiver does


def _holds(resource_metrics, name: str) -> bool:
    return any(metric.name == name for scope in resource_metrics.scope_metrics for metric in scope.metrics)


def _points(metric):
    kind = metric.WhichOneof("data")
    return getattr(metric, kind).data_points if kind else ()


async def stream_flat_out(url: str, index: int, max_tokens: int, until: float, counts: list[int]) -> None:
    """Streams chat completions one after another until ``until`` (monotonic)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        while time.monotonic() < until:
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]},
            ]
            body = {"model": SERVED_MODEL_NAME, "messages": messages, "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        counts[0] += 1


async def load(url: str, streams: int, seconds: float, max_tokens: int) -> int:
    counts = [0]
    until = time.monotonic() + seconds
    await asyncio.gather(*(stream_flat_out(url, i, max_tokens, until, counts) for i in range(streams)))
    return counts[0]


def lateness(exports: list[Export], interval: float, start: float, end: float) -> dict[str, list[float]]:
    """Each export arriving in [start, end): its gap from the one before less the interval,
    and that split into wake, collect and export, in seconds."""
    parts: dict[str, list[float]] = {"late": [], "wake": [], "collect": [], "export": []}
    for before, this in zip(exports, exports[1:]):
        if start <= this.arrived < end:
            parts["late"].append(this.arrived - before.arrived - interval)
            parts["wake"].append(this.first_point - before.arrived - interval)
            parts["collect"].append(this.last_point - this.first_point)
            parts["export"].append(this.arrived - this.last_point)
    return parts


def summary(values: list[float]) -> str:
    if not values:
        return "no export"
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"median {statistics.median(ordered):6.3f}  p90 {p90:6.3f}  max {ordered[-1]:6.3f}  (n={len(ordered)})"


def control_sender(endpoint: str, interval_ms: int, seconds: float, log: Path, spin: str | None = None) -> None:
    """A process of nothing but the SDK's periodic reader and one gauge, exporting to the same
    receiver; it writes to ``log`` when each export call began and returned (wall clock).
    With ``spin``, a thread spins through the middle third of ``seconds``: ``yield`` as
    vLLM's shared-memory queue waits (``os.sched_yield``, giving up the interpreter lock at
    every turn), ``python`` running bytecode without a pause; ``log`` says when."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    exporter = OTLPMetricExporter(endpoint, insecure=True)
    export, calls = exporter.export, []

    def timed_export(*arguments, **keywords):
        called = time.time()
        try:
            return export(*arguments, **keywords)
        finally:
            calls.append((called, time.time()))

    exporter.export = timed_export
    reader = PeriodicExportingMetricReader(exporter, interval_ms)
    provider = MeterProvider([reader], resource=Resource({names.PROCESS_ROLE: "control", "process.pid": os.getpid()}))
    provider.get_meter("control").create_observable_gauge("control", callbacks=[lambda _: [Observation(1)]])
    spun = []
    if spin:
        time.sleep(seconds / 3)
        spun.append(time.time())
        until = time.monotonic() + seconds / 3
        while time.monotonic() < until:
            if spin == "yield":
                os.sched_yield()
        spun.append(time.time())
        time.sleep(seconds / 3)
    else:
        time.sleep(seconds)
    provider.shutdown()
    log.write_text(json.dumps({"calls": calls, "spun": spun}))


def spin_probe(interval_ms: int, seconds: float, out: Path) -> None:
    """The control alone, its main thread spinning as vLLM's shared-memory queue waits, then
    running Python flat out: how late its reader's exports come while another thread of its
    process keeps retaking, or holds, the interpreter lock."""
    for spin in ("yield", "python"):
        sink = TimedSink(out / f"otlp-{spin}").start()
        log = out / f"spin-{spin}.json"
        try:
            subprocess.run([sys.executable, "-m", "benchmarks.metric_lag", "--control-of", sink.endpoint, "--spin", spin,
                            "--interval-ms", str(interval_ms), "--seconds", str(3 * seconds), "--out", str(log)],
                           check=True)  # fmt: skip
        finally:
            sink.stop()
        spun = json.loads(log.read_text())["spun"]
        exports = sorted(next(iter(sink.exports.values())), key=lambda e: e.arrived)
        print(f"a thread spinning ({spin}), the reader exporting every {interval_ms} ms: seconds late")
        for name, start, end in (("before", 0, spun[0]), ("spinning", spun[0], spun[1]), ("after", spun[1], float("inf"))):
            print(f"  {name:<9} {summary(lateness(exports, interval_ms / 1000, start, end)['late'])}")


def sender_side(calls: list[list[float]], exports: list[Export], start: float, end: float) -> dict[str, list[float]]:
    """The control's export calls in [start, end): from the call to the receiver's handler
    (sent and received) and from there to the call's return (answered)."""
    parts: dict[str, list[float]] = {"to handler": [], "back": []}
    for called, returned in calls:
        arrived = [e.arrived for e in exports if called <= e.arrived <= returned]
        if arrived and start <= called < end:
            parts["to handler"].append(arrived[0] - called)
            parts["back"].append(returned - arrived[0])
    return parts


def cpu_seconds(root: int, roles: dict[int, str]) -> dict[str, float]:
    """CPU seconds (user and system) the server's processes have used so far, by the role
    their exports name (``roles``, by pid), else as vLLM's worker and the like."""
    used: dict[str, float] = {}
    for process in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            name = roles.get(process.pid, "worker and others")
            used[name] = used.get(name, 0.0) + times.user + times.system
    return used


def phase(phases: list, name: str, server: VLLMServer, sink: TimedSink, run, *arguments):
    """Runs one phase, noting its wall-clock span and the server's CPU seconds in it; returns
    what ``run`` returned."""
    roles = {pid: role for role, pid in sink.exports if "helper" not in role}
    started, cpu_before = time.time(), cpu_seconds(server.process.pid, roles)
    result = run(*arguments)
    cpu_after = cpu_seconds(server.process.pid, roles)
    used = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
    phases.append((name, started, time.time(), used))
    return result


def load_from_another_process(url: str, args) -> int:
    """The same load from a process of its own, leaving the receiver's process idle."""
    command = [sys.executable, "-m", "benchmarks.metric_lag", "--client-of", url, "--seconds", str(args.seconds),
               "--streams", str(args.streams), "--max-tokens", str(args.max_tokens)]  # fmt: skip
    return int(subprocess.run(command, capture_output=True, text=True, check=True).stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval-ms", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20, help="length of each phase")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the server")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="for vLLM's command line")
    parser.add_argument("--out", type=Path, help="where the model and the server's log go (default: a temporary one)")
    parser.add_argument("--client-of", metavar="URL", help=argparse.SUPPRESS)  # the load's own process
    parser.add_argument("--control-of", metavar="ENDPOINT", help=argparse.SUPPRESS)  # the control sender's
    parser.add_argument("--spin", choices=("yield", "python"), help=argparse.SUPPRESS)  # the control's spinning thread
    parser.add_argument("--spin-probe", action="store_true",
                        help="no server: the control alone, beside a thread spinning as vLLM's shared-memory queue waits")
    args = parser.parse_args(argv)
    if args.spin_probe:
        spin_probe(args.interval_ms, args.seconds, args.out or Path(tempfile.mkdtemp(prefix="metric-lag-")))
        return 0
    if args.control_of:
        control_sender(args.control_of, args.interval_ms, args.seconds, args.out, args.spin)
        return 0
    if args.client_of:
        print(asyncio.run(load(args.client_of, args.streams, args.seconds, args.max_tokens)))
        return 0
    interval = args.interval_ms / 1000
    out = args.out or Path(tempfile.mkdtemp(prefix="metric-lag-"))
    extra = dict(variable.split("=", 1) for variable in args.env)

    sink = TimedSink(out / "otlp")
    sink.start()
    server = VLLMServer(
        ServerConfig(
            model=make_tiny_model(out / "tiny-llama"), otlp_endpoint=sink.endpoint, served_model_name=SERVED_MODEL_NAME,
            extra_args=args.server_arg,
            extra_env={**ATTRIBUTION_SETTINGS, "OTEL_METRIC_EXPORT_INTERVAL": str(args.interval_ms), **extra},
        ),
        out / "vllm-server.log",
    )  # fmt: skip
    phases: list[tuple[str, float, float]] = []
    control = None
    try:
        server.start()
        control = subprocess.Popen([sys.executable, "-m", "benchmarks.metric_lag", "--control-of", sink.endpoint,
                                    "--interval-ms", str(args.interval_ms), "--seconds", str(4 * args.seconds + 10),
                                    "--out", str(out / "control.json")])  # fmt: skip
        time.sleep(3 * interval + 2)  # every process's reader has exported at least twice
        phase(phases, "idle", server, sink, time.sleep, args.seconds)
        here = phase(phases, "load, client here", server, sink, asyncio.run,
                     load(server.url, args.streams, args.seconds, args.max_tokens))  # fmt: skip
        apart = phase(phases, "load, client apart", server, sink, load_from_another_process, server.url, args)
        phase(phases, "idle after", server, sink, time.sleep, args.seconds)
    finally:
        server.stop(settle=0)
        if control is not None:
            control.wait()
        sink.stop()

    print(f"interval {args.interval_ms} ms, {args.seconds:.0f} s a phase, {args.streams} streams,"
          f" extra environment {extra or 'none'}, vLLM arguments {args.server_arg or 'none'}; streamed chunks a second: {here / args.seconds:.0f}"
          f" (client in the receiver's process), {apart / args.seconds:.0f} (client in a process of its own)")  # fmt: skip
    print(f"host load average (1 min) at the end: {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs")
    print("\nthe server's processes, CPU seconds a second of each phase:")
    for name, start, end, used in phases:
        shares = ", ".join(f"{process} {seconds / (end - start):.2f}" for process, seconds in sorted(used.items()))
        print(f"  {name:<18} {shares}")
    for (role, pid), exports in sorted(sink.exports.items()):
        exports.sort(key=lambda e: e.arrived)
        print(f"\n{role} (pid {pid}): seconds each export came after the interval")
        for name, start, end, _ in phases:
            parts = lateness(exports, interval, start, end)
            print(f"  {name:<18} late     {summary(parts['late'])}")
            for part in ("wake", "collect", "export"):
                print(f"  {'':<18}  {part:<7} {summary(parts[part])}")
    calls = json.loads((out / "control.json").read_text())["calls"]
    control = next(exports for (role, _), exports in sink.exports.items() if role == "control")
    print("\ncontrol, as its exporter saw each export call: seconds")
    for name, start, end, _ in phases:
        parts = sender_side(calls, control, start, end)
        print(f"  {name:<18} {'to handler':<10} {summary(parts['to handler'])}")
        print(f"  {'':<18} {'back':<10} {summary(parts['back'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
