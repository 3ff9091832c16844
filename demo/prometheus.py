"""A Prometheus server (Debian's package) that scrapes one target, for the dashboard's test and picture."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

from demo.server import free_port


def wait_for_url(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(url)


class PrometheusServer:
    def __init__(self, target: str, directory: Path, scrape_interval: str = "1s") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = directory / "prometheus.yml"
        config.write_text(
            f"global: {{scrape_interval: {scrape_interval}}}\n"
            "scrape_configs:\n"
            f"  - job_name: vllm-kv\n    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self._command = [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--enable-feature=exemplar-storage",
        ]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusServer:
        self.process = subprocess.Popen(self._command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_url(f"{self.url}/-/ready", 60)
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(30)

    def api(self, path: str, **params) -> dict:
        query = "?" + urllib.parse.urlencode(params) if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as response:
            return json.loads(response.read())["data"]
