"""README command 1 runs to completion, and the table it prints is what the OTLP files hold."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The main job builds and serves with the default environment (.venv), whatever runs the tests.
pytestmark = [pytest.mark.serving, pytest.mark.main_job]


def _spans_in(traces_jsonl: Path) -> dict[str, dict]:
    """request id -> attributes of the KV spans in an OTLP JSON lines file, read independently."""
    spans = {}
    for line in traces_jsonl.read_text().splitlines():
        for resource_spans in json.loads(line)["resourceSpans"]:
            for scope_spans in resource_spans["scopeSpans"]:
                for span in scope_spans["spans"]:
                    if span["name"] == "vllm.kv_cache.request":
                        attrs = {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
                        spans[attrs["vllm.request.id"]] = attrs
    return spans


def test_readme_command_1_prints_the_exported_spans(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [str(REPO / "scripts" / "demo.sh"), "--short", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]

    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("request id")) + 2
    rows = [line.split() for line in lines[start : lines.index("", start)]]
    # request id, scenario (words), prompt, prefix hit, peak blocks, preempted, finish
    table = {r[0]: (int(r[-5]), int(r[-4]), int(r[-3]), int(r[-2]), r[-1]) for r in rows}

    spans = _spans_in(tmp_path / "otlp" / "traces.jsonl")
    assert set(table) == set(spans)
    for request_id, attrs in spans.items():
        assert table[request_id] == (
            int(attrs["gen_ai.usage.input_tokens"]),
            int(attrs["gen_ai.usage.cache_read.input_tokens"]),
            int(attrs["vllm.kv_cache.blocks.peak"]),
            int(attrs["vllm.kv_cache.preemptions"]),
            attrs["vllm.request.finish_reason"],
        )
    # Against vLLM's own count of the requests its engine ended: the rest were the
    # streaming clients that left mid-answer. (On a starved machine the engine can end
    # a stream before vLLM hears its client leave: then vLLM counts it, as "length".)
    [counted] = [line for line in lines if line.startswith("vLLM's /metrics")]
    ended_in_engine = dict(item.rsplit(" ", 1) for item in counted.split(": ", 1)[1].rstrip(";").split(", "))
    finishes = [row[-1] for row in rows]
    assert {reason: finishes.count(reason) for reason in ended_in_engine} == {
        reason: int(count) for reason, count in ended_in_engine.items()
    }
    left = [row for row in rows if row[-1] not in ended_in_engine]
    assert all(row[-1] == "abort" and " ".join(row[1:-5]) == "client disconnects" for row in left), left
    assert "peak used blocks" in result.stdout
    assert "starting vLLM" in result.stderr  # the progress display
