"""The collector configs, the Prometheus configs and the dashboard agree with what the package emits."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

from otel_kvcache import names

from conftest import prometheus_scrape_of_a_run

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "vllm-kv-cache.json"
COLLECTOR_CONFIGS = sorted((REPO / "collector-config").glob("*.yaml"))
CONTRIB = json.loads((Path(__file__).parent / "data" / "otelcol_contrib_components.json").read_text())
PROMQL_KEYWORDS = {"sum", "max", "min", "avg", "by", "rate", "histogram_quantile", "le", "without", "count"}


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard, its variables filled in as Grafana would."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries += [v["query"].removeprefix("label_values(").split(",")[0] for v in dashboard["templating"]["list"]
                if v["type"] == "query"]
    return [q.replace("$__rate_interval", "30s").replace("$engine", ".*") for q in queries]


NAME_PATTERN = re.compile(r'__name__=~"([^"]*)"')
"""A metric named by a regular expression: a name the exporters spell differently."""


def promql_identifiers(query: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) a PromQL expression uses; a name given as ``__name__=~"re"``
    is the regular expression."""
    patterns = set(NAME_PATTERN.findall(query))
    query = NAME_PATTERN.sub("", query)
    labels = set(re.findall(r"(\w+)\s*=~?", query)) | {
        label.strip() for group in re.findall(r"by \(([^)]*)\)", query) for label in group.split(",")
    }
    words = set(re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*", re.sub(r'"[^"]*"|\[[^\]]*\]', "", query)))
    return (words - labels - PROMQL_KEYWORDS) | patterns, labels - {"le"}


def test_every_dashboard_metric_and_label_is_one_the_package_exports(make_engine, telemetry):
    """Names through the real OpenTelemetry Prometheus exporter, from a real engine run."""
    exposition, _ = prometheus_scrape_of_a_run(make_engine, telemetry)
    exported = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line and line[0] != "#"}
    exported |= {name.removesuffix("_bucket") for name in exported}
    attribute_labels = {re.sub(r"[^a-zA-Z0-9_]", "_", v) for k, v in vars(names).items() if isinstance(v, str)}
    for query in dashboard_queries():
        metrics, labels = promql_identifiers(query)
        assert metrics, query
        unknown = {m for m in metrics if m not in exported and not any(re.fullmatch(m, e) for e in exported)}
        assert not unknown, f"{sorted(unknown)} in {query!r}"
        assert labels <= attribute_labels, f"{sorted(labels - attribute_labels)} in {query!r}"


@pytest.mark.parametrize("path", COLLECTOR_CONFIGS, ids=lambda p: p.name)
def test_collector_configs_are_consistent_and_use_contrib_components(path):
    config = yaml.safe_load(path.read_text())
    kinds = ("receivers", "processors", "exporters", "connectors", "extensions")
    for kind in kinds:
        for component in config.get(kind) or {}:
            assert component.split("/")[0] in CONTRIB[kind], f"{kind}: {component} is not in otelcol-contrib"
    service = config["service"]
    for extension in service.get("extensions", []):
        assert extension in config["extensions"]
    connectors = set(config.get("connectors") or {})
    for name, pipeline in service["pipelines"].items():
        assert name.split("/")[0] in ("traces", "metrics", "logs")
        for kind in ("receivers", "processors", "exporters"):
            declared = set(config.get(kind) or {}) | (connectors if kind != "processors" else set())
            for component in pipeline.get(kind, []):
                assert component in declared, f"pipeline {name}: {component} is not declared"
    authenticators = re.findall(r"authenticator: (\S+)", path.read_text())
    assert set(authenticators) <= set(config.get("extensions") or {})


def test_tail_sampling_rules_name_what_the_package_emits():
    config = yaml.safe_load((REPO / "collector-config" / "gateway.yaml").read_text())
    values = {v for v in vars(names).values() if isinstance(v, str)}
    policies = config["processors"]["tail_sampling"]["policies"]
    keys = [p[p["type"]]["key"] for p in policies if "key" in p.get(p["type"], {})]
    assert keys and set(keys) <= values
    conditions = [c for p in policies if p["type"] == "ottl_condition"
                  for group in ("span", "spanevent") for c in p["ottl_condition"].get(group, [])]
    quoted = {re.search(r'"([^"]+)"', c).group(1) for c in conditions}
    assert quoted == {names.FINDING_SPAN, names.EVENT_LEAK, names.EVENT_ZOMBIE, names.EVENT_STUCK, names.EVENT_LOAD_FAILED}
    [finish] = [p for p in policies if p.get("string_attribute", {}).get("key") == names.FINISH_REASON]
    assert set(finish["string_attribute"]["values"]) == {"abort", "error"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus) is not installed")
def test_prometheus_configs_pass_promtool():
    for path in (REPO / "deploy").rglob("prometheus*.yml"):
        result = subprocess.run(["promtool", "check", "config", str(path)],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_histograms_carry_exemplars_of_exported_kv_spans(make_engine, telemetry):
    engine = make_engine(num_blocks=64)
    for i in range(3):
        engine.add(engine.make_request(f"e{i}", prompt_len=40, max_tokens=4))
    engine.run()
    otlp = encode_metrics(telemetry.reader.get_metrics_data())
    span_ids = {span.span_id for span in encode_spans(telemetry.kv_spans()).resource_spans[0].scope_spans[0].spans}
    exemplars = [
        exemplar
        for rm in otlp.resource_metrics for sm in rm.scope_metrics for metric in sm.metrics
        if metric.name in (names.REQUEST_BLOCKS, names.REQUEST_PREEMPTIONS, names.REQUEST_PREFIX_HIT_RATIO)
        for point in metric.histogram.data_points for exemplar in point.exemplars
    ]
    assert exemplars
    assert {e.span_id for e in exemplars} <= span_ids
