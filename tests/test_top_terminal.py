"""``otel-kvcache top`` as an operator runs it, against an instrumented process of three
engines under load (``tests/metrics_source.py``: the real scheduler, one engine with
vLLM's NIXL connector, one with a CPU offload tier): fleet mode against a real Prometheus,
the live view in a real terminal (tmux), and the engines once their process is killed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from demo.prometheus import PrometheusServer, wait_for_url
from demo.server import free_port
from otel_kvcache import config, names

pytestmark = pytest.mark.host_tools

SOURCE = Path(__file__).resolve().parent / "metrics_source.py"
TENANT = "tenant"
ENGINES = 3


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    directory = tmp_path_factory.mktemp("top-snapshots")
    directory.chmod(0o700)
    environment = {**os.environ, config.TOP_DIR: str(directory), config.BAGGAGE_KEYS: TENANT,
                   config.ATTRIBUTION: f"{names.MODEL},{TENANT}", "NO_COLOR": ""}  # fmt: skip
    environment.pop("NO_COLOR")
    port = free_port()
    process = subprocess.Popen([sys.executable, str(SOURCE), str(port), "600"], env=environment,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for_url(f"http://127.0.0.1:{port}/metrics", 120)
        deadline = time.monotonic() + 60
        while len(list(directory.glob("engine-*.json"))) < ENGINES and time.monotonic() < deadline:
            time.sleep(0.5)
        yield process, port, environment
    finally:
        process.kill()
        process.wait(30)


def top(environment, *arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "otel_kvcache.commands.cli", "top", *arguments], env=environment,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip


def top_json(environment, *arguments: str) -> dict:
    return json.loads(top(environment, "--json", *arguments).stdout)


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed")
def test_fleet_mode_shows_every_engine_prometheus_scrapes(source, tmp_path):
    process, port, environment = source
    with PrometheusServer(f"127.0.0.1:{port}", tmp_path) as prometheus:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            scraped = {s["metric"]["vllm_engine_index"] for s in prometheus.api("query", query="vllm_kv_cache_blocks")["result"]}
            held = prometheus.api("query", query="vllm_kv_cache_held_blocks")["result"]
            if scraped == {str(index) for index in range(ENGINES)} and held:
                break
            time.sleep(1)
        frame = top_json(environment, "--prometheus", prometheus.url)
        limits = {s["metric"]["vllm_engine_index"]: int(float(s["value"][1]))
                  for s in prometheus.api("query", query="vllm_kv_cache_blocks_limit")["result"]}  # fmt: skip
        text = top(environment, "--once", "--prometheus", prometheus.url).stdout
    assert frame["source"] == prometheus.url
    engines = {e["engine"]: e for e in frame["engines"]}
    assert sorted(engines) == list(range(ENGINES))
    for index, engine in engines.items():
        assert engine["replica"] == {"job": "vllm-kv", "instance": f"127.0.0.1:{port}"}
        pool = engine["pool"]
        assert pool["limit"] == limits[str(index)]
        assert pool["used"] + pool["cached"] + pool["free"] == pool["limit"]
        assert engine["requests"] == []
    # Engine 0's requests carry a tenant in their baggage: its holders are by model and tenant.
    tenants = {h["attributes"].get(TENANT) for h in engines[0]["holders"]}
    assert tenants <= {"team-a", "team-b", None} and tenants & {"team-a", "team-b"}
    assert all(f"engine {index}" in text for index in range(ENGINES)) and "\x1b[" not in text  # no colour into a pipe


def capture(session: str, colours: bool = False) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", *(["-e"] if colours else []), "-t", session],
                          capture_output=True, text=True).stdout  # fmt: skip


def wait_for_screen(session: str, test, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        screen = capture(session)
        if test(screen):
            return screen
        time.sleep(0.3)
    raise AssertionError(f"the terminal never showed it; it shows:\n{capture(session)}")


def tenants_in_rows(screen: str) -> set[str]:
    return set(re.findall(r"\bteam-[ab]\b", screen.split("holding blocks", 1)[-1]))


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_live_view_in_a_terminal_sorts_filters_and_quits(source):
    process, port, environment = source
    session = f"otel-kvcache-top-{os.getpid()}"
    exports = " ".join(f"{k}={v}" for k, v in environment.items() if k in (config.TOP_DIR, "PATH", "PYTHONPATH"))
    command = f"env -u COLUMNS -u LINES TERM=xterm-256color {exports} {sys.executable} -m otel_kvcache.commands.cli top"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "60", command], check=True)
    try:
        screen = wait_for_screen(session, lambda s: "engine 1" in s and "sorted by blocks" in s and "Quit" in s)
        assert "engine 0" in screen and "pool" in screen
        assert tenants_in_rows(screen) == {"team-a", "team-b"}
        assert "\x1b[" in capture(session, colours=True)  # colour, on a terminal
        subprocess.run(["tmux", "send-keys", "-t", session, "s"], check=True)
        wait_for_screen(session, lambda s: "sorted by age" in s)
        subprocess.run(["tmux", "send-keys", "-t", session, "s"], check=True)
        wait_for_screen(session, lambda s: "sorted by preemptions" in s)
        # One burst, as a quick typist or a loaded host delivers it: the keys after "f" reach
        # the application before the filter field has the focus.
        subprocess.run(["tmux", "send-keys", "-t", session, "fteam-a", "Enter"], check=True)
        screen = wait_for_screen(session, lambda s: "filter: 'team-a'" in s)
        assert tenants_in_rows(screen) == {"team-a"}
        subprocess.run(["tmux", "send-keys", "-t", session, "Escape"], check=True)
        screen = wait_for_screen(session, lambda s: "filter:" not in s and tenants_in_rows(s) == {"team-a", "team-b"})
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        deadline = time.monotonic() + 15
        while subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "q did not quit"
            time.sleep(0.2)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_a_killed_engine_shows_as_stale_then_goes(source):
    process, port, environment = source
    directory = Path(environment[config.TOP_DIR])
    assert [e["stale"] for e in top_json(environment)["engines"]] == [False] * ENGINES
    process.kill()
    process.wait(30)
    deadline = time.monotonic() + 30
    while True:
        engines = top_json(environment)["engines"]
        if [e["stale"] for e in engines] == [True] * ENGINES:
            break
        assert time.monotonic() < deadline, engines
        time.sleep(0.5)
    assert all(e["age_s"] > 5 for e in engines)
    assert "STALE" in top(environment, "--once").stdout
    assert top_json(environment, "--forget-after", "1")["engines"] == []
    assert [path.name for path in directory.iterdir()] == ["watching"]  # the reader's own mark
