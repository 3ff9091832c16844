"""Serving throughput on the CPU tiny model: instrumented vs not, paired rounds.

    python -m benchmarks.serving [--rounds N]

Two servers of the same config — one under ``opentelemetry-instrument``
exporting to a local OTLP receiver, one plain — receive the same batch of
concurrent completions in alternating order; each round's output tokens per
second are compared pair by pair. The server not being measured is frozen
(SIGSTOP to its process group, SIGCONT after): on a 2-core machine an idle
vLLM still takes CPU, and two live servers disturbed each other so much that a
first version of this benchmark (both running) could conclude nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from demo.otlp_sink import OTLPSink
from demo.server import ServerConfig, VLLMServer
from demo.tiny_model import make_tiny_model

PROMPTS = [f"Request {i}: tell me how the KV cache of a large language model works." for i in range(16)]


async def batch_tokens_per_second(url: str, model: str, max_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        started = time.perf_counter()
        responses = await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={"model": model, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True},
                )
                for p in PROMPTS
            )
        )
        elapsed = time.perf_counter() - started
    return sum(r.json()["usage"]["completion_tokens"] for r in responses) / elapsed


@contextlib.contextmanager
def _frozen(servers: list[VLLMServer]):
    """Stops these servers' process groups (SIGSTOP) while another one is measured."""
    for server in servers:
        os.killpg(server.process.pid, signal.SIGSTOP)
    time.sleep(0.5)  # let what was running settle
    try:
        yield
    finally:
        for server in servers:
            os.killpg(server.process.pid, signal.SIGCONT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    model = make_tiny_model(work / "model")
    sink = OTLPSink().start()
    servers = {
        "instrumented": VLLMServer(ServerConfig(model=model, otlp_endpoint=sink.endpoint, num_blocks=512,
                                                max_model_len=2048, max_num_seqs=16), work / "otel.log"),
        "plain": VLLMServer(ServerConfig(model=model, num_blocks=512, max_model_len=2048, max_num_seqs=16,
                                         instrumented=False), work / "plain.log"),
    }  # fmt: skip
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():  # warm both up
            asyncio.run(batch_tokens_per_second(server.url, str(model), args.max_tokens))
        rates: dict[str, list[float]] = {name: [] for name in servers}
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                with _frozen([server for other, server in servers.items() if other != name]):
                    rate = asyncio.run(batch_tokens_per_second(servers[name].url, str(model), args.max_tokens))
                rates[name].append(rate)
    finally:
        for server in servers.values():
            os.killpg(server.process.pid, signal.SIGCONT)
            server.stop(settle=0)
        sink.stop()
    ratios = sorted(i / p for i, p in zip(rates["instrumented"], rates["plain"]))
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"output tokens/s, {len(PROMPTS)} concurrent completions x {args.max_tokens} tokens, {args.rounds} paired rounds:")
    for name, values in rates.items():
        print(f"  {name:<13} median {statistics.median(values):8.1f}  (min {min(values):.1f}, max {max(values):.1f})")
    print(f"  instrumented / plain: median {statistics.median(ratios):.3f} (p25 {quartiles[0]:.3f}, p75 {quartiles[2]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
