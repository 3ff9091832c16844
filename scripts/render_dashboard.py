"""Renders the Grafana dashboard's panels from real data, as one picture.

    python scripts/render_dashboard.py docs/dashboard.png   # needs matplotlib and Debian's prometheus

Runs tests/metrics_source.py (an instrumented engine under load; the GPU view
on the tests' fakes), lets a real Prometheus scrape it for a couple of
minutes, then draws every panel of deploy/grafana/dashboards/vllm-kv-cache.json
with the panel's own PromQL, through Prometheus's query_range API. The device's
series (NVML, torch's allocator) come from those fakes here: they are left out,
never drawn as if measured, and their panels say so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from demo.prometheus import PrometheusServer, wait_for_url  # noqa: E402
from demo.server import free_port  # noqa: E402

DEVICE_SERIES = ("hw_gpu_", "vllm_gpu_", "vllm_torch_")
"""Metric name prefixes of the device's and the allocator's views (``names.py``)."""


def main(output: str, seconds: int = 150) -> None:
    dashboard = json.loads((REPO / "deploy/grafana/dashboards/vllm-kv-cache.json").read_text())
    port = free_port()
    source = subprocess.Popen([sys.executable, str(REPO / "tests/metrics_source.py"), str(port), str(seconds + 60)])
    try:
        wait_for_url(f"http://127.0.0.1:{port}/metrics", 120)
        with tempfile.TemporaryDirectory() as directory, PrometheusServer(f"127.0.0.1:{port}", Path(directory)) as prom:
            start = time.time()
            time.sleep(seconds)
            end = time.time()
            panels = dashboard["panels"]
            figure, axes = plt.subplots((len(panels) + 1) // 2, 2, figsize=(16, 3.2 * ((len(panels) + 1) // 2)))
            for ax, panel in zip(axes.flat, panels):
                title = panel["title"]
                for target in panel["targets"]:
                    if any(device in target["expr"] for device in DEVICE_SERIES):
                        title = f"{title} (no GPU here: the device's series left out)"
                        continue
                    query = target["expr"].replace("$__rate_interval", "20s").replace("$engine", ".*")
                    for series in prom.api("query_range", query=query, start=start, end=end, step=2)["result"]:
                        times = [float(t) - start for t, _ in series["values"]]
                        values = [float(v) for _, v in series["values"]]
                        label = target["legendFormat"]
                        for key, value in series["metric"].items():
                            label = label.replace("{{" + key + "}}", value)
                        ax.plot(times, values, label=label, linewidth=1.2)
                ax.set_title(title, fontsize=10)
                ax.set_xlabel("seconds", fontsize=8)
                ax.tick_params(labelsize=8)
                ax.legend(fontsize=7, loc="upper left")
                ax.grid(alpha=0.3)
            figure.suptitle("vLLM KV cache (otel-kvcache): the dashboard's queries on a real Prometheus", fontsize=12)
            figure.tight_layout()
            figure.savefig(output, dpi=80)
    finally:
        source.terminate()
        source.wait(30)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/dashboard.png")
