"""A real Prometheus (Debian's package) scrapes an instrumented engine and answers every dashboard query
and every query of `otel-kvcache top --prometheus`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from demo.prometheus import PrometheusServer, wait_for_url
from demo.server import free_port
from test_pipeline_configs import dashboard_queries

from otel_kvcache.commands.top import fleet

pytestmark = [
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus is not installed"),
    pytest.mark.vllm_independent,
]

SOURCE = Path(__file__).resolve().parent / "metrics_source.py"


@pytest.mark.slow
def test_prometheus_answers_every_dashboard_and_fleet_query_with_data(tmp_path):
    port = free_port()
    source = subprocess.Popen([sys.executable, str(SOURCE), str(port), "120"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_url(f"http://127.0.0.1:{port}/metrics", 120)
        with PrometheusServer(f"127.0.0.1:{port}", tmp_path) as prometheus:
            # The dashboard's queries, and those of `otel-kvcache top --prometheus` (names derived from names.py).
            unanswered = dashboard_queries() + list(fleet.QUERIES.values())
            deadline = time.monotonic() + 90
            while unanswered and time.monotonic() < deadline:
                time.sleep(2)
                unanswered = [q for q in unanswered if not prometheus.api("query", query=q)["result"]]
            assert not unanswered, f"no data for: {unanswered}"
            assert [t["health"] for t in prometheus.api("targets")["activeTargets"]] == ["up"]
    finally:
        source.terminate()
        source.wait(30)
