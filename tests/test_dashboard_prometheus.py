"""A real Prometheus (Debian's package) scrapes an instrumented engine and answers every dashboard query."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from demo.server import free_port
from test_pipeline_configs import dashboard_queries

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed")

SOURCE = Path(__file__).resolve().parent / "metrics_source.py"


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _wait(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


def test_prometheus_answers_every_dashboard_query_with_data(tmp_path):
    source_port, prometheus_port = free_port(), free_port()
    source = subprocess.Popen([sys.executable, str(SOURCE), str(source_port), "120"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: vllm-kv\n    static_configs: [{{targets: ['127.0.0.1:{source_port}']}}]\n"
    )
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{prometheus_port}", "--enable-feature=exemplar-storage"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{prometheus_port}"
    try:
        _wait(f"http://127.0.0.1:{source_port}/metrics", 120)
        _wait(f"{base}/-/ready", 60)
        unanswered = dashboard_queries()
        deadline = time.monotonic() + 90
        while unanswered and time.monotonic() < deadline:
            time.sleep(2)
            unanswered = [
                q for q in unanswered
                if not _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": q}))["data"]["result"]
            ]
        assert not unanswered, f"no data for: {unanswered}"
        targets = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"]
    finally:
        prometheus.terminate()
        source.terminate()
        prometheus.wait(30)
        source.wait(30)
