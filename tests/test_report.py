"""``otel-kvcache report``: the page holds what the OTLP files hold (read here on their
own), opens in headless Chromium with no console error and draws every chart;
reading streams in bounded memory; nothing to report, or no report extra, exits 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from headless_chromium import open_and_check
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from otlp_files import T0, Run, kv_span, line, metrics_request, traces_request, write_lines

from otel_kvcache import names
from otel_kvcache.commands import cli
from otel_kvcache.commands.report.buckets import TimeBuckets
from otel_kvcache.commands.report.request_charts import HOLDING, PREEMPTED, WAITING, phases
from otel_kvcache.commands.report.sample import RowSample
from otel_kvcache.commands.report.trace_digest import Event, RequestRow, read_traces

pytestmark = pytest.mark.vllm_independent  # the same on every vLLM: tested in the default environment

def script_json(page: str, element_id: str):
    """The JSON in the page's ``<script type="application/json" id=...>`` block."""
    match = re.search(rf'<script type="application/json"[^>]* id="{element_id}">(.*?)</script>', page, re.S)
    assert match, f"no #{element_id} block in the page"
    return json.loads(match.group(1))


def make_report(otlp: Path, out: Path) -> str:
    assert cli.main(["report", "--otlp-dir", str(otlp), "-o", str(out)]) == 0
    return out.read_text()


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> Path:
    return Run().write(tmp_path_factory.mktemp("otlp"))


@pytest.fixture(scope="module")
def page(run_files, tmp_path_factory) -> str:
    return make_report(run_files, tmp_path_factory.mktemp("report") / "report.html")


# --- the files, read on their own ------------------------------------------------


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _attributes(items: list[dict]) -> dict:
    return {a["key"]: next(iter(a["value"].values())) for a in items}


def spans_in(otlp: Path, name: str = names.KV_REQUEST_SPAN) -> list[dict]:
    return [
        span
        for request in _lines(otlp / "traces.jsonl")
        for resource_spans in request["resourceSpans"]
        for scope_spans in resource_spans["scopeSpans"]
        for span in scope_spans["spans"]
        if span["name"] == name
    ]


def points_in(otlp: Path, name: str) -> list[tuple[int, float, dict]]:
    """(time, value, attributes) of every point of one metric."""
    found = []
    for request in _lines(otlp / "metrics.jsonl"):
        for resource_metrics in request["resourceMetrics"]:
            for scope_metrics in resource_metrics["scopeMetrics"]:
                for metric in scope_metrics["metrics"]:
                    if metric["name"] == name:
                        for p in (metric.get("gauge") or metric.get("sum"))["dataPoints"]:
                            value = float(p.get("asInt", p.get("asDouble")))
                            found.append((int(p["timeUnixNano"]), value, _attributes(p["attributes"])))
    return found


def last_value(otlp: Path, name: str) -> float:
    return max(points_in(otlp, name), key=lambda p: p[0])[1]


# --- what the page holds -----------------------------------------------------------


def test_summary_is_what_the_files_hold(run_files, page):
    summary = script_json(page, "summary")
    spans = spans_in(run_files)
    findings = [
        e for span in spans + spans_in(run_files, names.FINDING_SPAN) for e in span["events"]
        if e["name"] in (names.EVENT_LEAK, names.EVENT_ZOMBIE)
    ]  # fmt: skip
    finishes = Counter(_attributes(s["attributes"])[names.FINISH_REASON] for s in spans)
    blocks = points_in(run_files, names.BLOCKS)
    assert summary == {
        "requests": len(spans),
        "preempted_requests": sum(int(_attributes(s["attributes"])[names.PREEMPTIONS]) > 0 for s in spans),
        "preemptions": last_value(run_files, names.PREEMPTIONS),
        "allocation_stalls": last_value(run_files, names.ALLOCATION_STALLS),
        "evictions": last_value(run_files, names.EVICTIONS),
        "leak_findings": len(findings),
        "prefix_cache_hit_ratio": last_value(run_files, names.PREFIX_CACHE_HITS)
        / last_value(run_files, names.PREFIX_CACHE_QUERIES),
        "pool_blocks": 16,
        "peak_used_blocks": max(v for _, v, a in blocks if a[names.BLOCK_STATE] == "used"),
        "peak_cached_blocks": max(v for _, v, a in blocks if a[names.BLOCK_STATE] == "cached"),
        "finish_reasons": dict(sorted(finishes.items())),
        "leak_gate": "FAIL",  # the zombie gauge reads 1 at the end
        "leak_gate_problems": ["engine 0: zombie requests 1 > tolerance 0"],
    }  # fmt: skip
    assert "FAIL" in page and "zombie requests 1 &gt; tolerance 0" in page  # the card shows it too


def test_pool_chart_holds_every_reading_and_mark(run_files, page):
    spec = script_json(page, "spec-pool")
    blocks = points_in(run_files, names.BLOCKS)
    expected = sorted((round((t - T0) / 1e9, 4), a[names.BLOCK_STATE], v) for t, v, a in blocks)
    assert sorted((r["t"], r["state"], r["blocks"]) for r in spec["datasets"]["pool"]) == expected

    used_at_events = [
        (round((int(e["timeUnixNano"]) - T0) / 1e9, 4), int(_attributes(e["attributes"])[names.POOL_USED_BLOCKS]))
        for span in spans_in(run_files) for e in span["events"] if names.POOL_USED_BLOCKS in _attributes(e["attributes"])
    ]  # fmt: skip
    # One reading per 1 ms bucket, the fuller pool where two events share one.
    by_bucket: dict = {}
    for t, used in used_at_events:
        by_bucket[int(t * 1000)] = max(by_bucket.get(int(t * 1000), (0, -1)), (t, used), key=lambda r: (r[1], r[0]))
    assert sorted((r["t"], r["used"]) for r in spec["datasets"]["events"]) == sorted(by_bucket.values())

    marks = Counter()
    for r in spec["datasets"]["marks"]:
        marks[r["kind"]] += r["count"]
    preempted = [e for s in spans_in(run_files) for e in s["events"] if e["name"] == names.EVENT_PREEMPTED]
    assert marks == {
        "preemptions": len(preempted),
        "allocation stalls": last_value(run_files, names.ALLOCATION_STALLS),
        "leak findings": 2,
    }


def test_timeline_has_a_row_per_request_cut_at_its_events(run_files, page):
    rows = script_json(page, "spec-timeline")["datasets"]["requests"]
    spans = spans_in(run_files)
    by_request = {_attributes(s["attributes"])[names.REQUEST_ID]: s for s in spans}
    assert {r["request"] for r in rows} == set(by_request)
    for request, span in by_request.items():
        mine = [r for r in rows if r["request"] == request]
        assert {r["trace_id"] for r in mine} == {span["traceId"]}
        events = span["events"]
        preempted = sum(e["name"] == names.EVENT_PREEMPTED for e in events)
        assert sum(r["phase"] == PREEMPTED for r in mine) == preempted
        assert sum(r["phase"] == HOLDING for r in mine) == sum(
            e["name"] in (names.EVENT_ADMITTED, names.EVENT_RESUMED) for e in events
        )
        held = sum(r["seconds"] for r in mine if r["phase"] == HOLDING)
        assert held == pytest.approx(_held_seconds(events), abs=1e-3)
        assert {r["finish"] for r in mine} == {_attributes(span["attributes"])[names.FINISH_REASON]}
    # Rows in arrival order.
    firsts = {}
    for r in rows:
        firsts.setdefault(r["row"], r["from"])
    assert list(firsts.values()) == sorted(firsts.values())


def _held_seconds(events: list[dict]) -> float:
    held, since = 0.0, None
    for e in events:
        t = int(e["timeUnixNano"]) / 1e9
        if e["name"] in (names.EVENT_ADMITTED, names.EVENT_RESUMED):
            since = t
        elif e["name"] in (names.EVENT_PREEMPTED, names.EVENT_RELEASED) and since is not None:
            held, since = held + t - since, None
    return held


def test_distributions_count_every_request(run_files, page):
    data = script_json(page, "spec-distributions")["datasets"]
    spans = [_attributes(s["attributes"]) for s in spans_in(run_files)]

    def counts(rows):
        return {round(r["value"], 2): r["count"] for r in rows}

    assert counts(data["peak_blocks"]) == Counter(int(a[names.BLOCKS_PEAK]) for a in spans)
    assert counts(data["preemptions"]) == Counter(int(a[names.PREEMPTIONS]) for a in spans)
    hit_and_prompt = [(int(a[names.CACHE_READ_INPUT_TOKENS]), int(a[names.INPUT_TOKENS])) for a in spans]
    ratios = Counter(min(hit, prompt) * 100 // prompt / 100 for hit, prompt in hit_and_prompt)  # floored to a percent
    assert counts(data["prefix_hit_ratio"]) == ratios


def test_who_holds_the_kv_cache_is_every_series_reading_and_its_last_total(run_files, page):
    data = script_json(page, "spec-holders")["datasets"]
    held = [p for p in points_in(run_files, names.HELD_BLOCKS) if names.OFFLOAD_MEDIUM not in p[2]]  # the GPU pool's
    used = {t: v for t, v, a in points_in(run_files, names.BLOCKS) if a[names.BLOCK_STATE] == "used"}
    rows = {(r["t"], r["holder"]): r["blocks"] for r in data["held"]}
    # Every reading of the pool, each series' blocks then (0 where it had no point): the
    # series stack up to the used blocks.
    assert len(rows) == len(used) * len(Run.models)
    for time, blocks in used.items():
        t = round((time - T0) / 1e9, 4)
        assert sum(rows[(t, model)] for model in Run.models) == blocks
    assert {(round((t - T0) / 1e9, 4), a[names.MODEL]): v for t, v, a in held} == {k: v for k, v in rows.items() if v}
    last = {}
    for t, v, a in sorted(points_in(run_files, names.OCCUPANCY), key=lambda p: p[0]):
        last[a[names.MODEL]] = v
    assert {r["holder"]: r["block_seconds"] for r in data["occupancy"]} == last


def test_session_gaps_count_each_returning_request_by_whether_it_kept_its_prefix(run_files, page):
    rows = script_json(page, "spec-session_gaps")["datasets"]["turn_gaps"]
    returning = [_attributes(s["attributes"]) for s in spans_in(run_files)]
    returning = [a for a in returning if names.SESSION_TURN_GAP in a]
    assert sorted((r["gap"], r["kept"], r["requests"]) for r in rows) == sorted(
        ("≤ 60 s" if a[names.SESSION_TURN_GAP] > 30 else "≤ 0.5 s",
         "prefix evicted" if int(a[names.PREFIX_EVICTED_TOKENS]) else "prefix kept", 1) for a in returning
    )  # fmt: skip


def test_what_if_curve_is_each_scales_latest_reading(run_files, page):
    rows = script_json(page, "spec-whatif")["datasets"]["projected"]
    points = points_in(run_files, names.PROJECTED_HIT_RATIO)
    latest = {}
    for t, v, a in sorted(points, key=lambda p: p[0]):
        latest[float(a[names.POOL_SCALE])] = v
    assert {r["scale"]: r["ratio"] for r in rows} == latest


def test_the_tier_what_if_is_each_scales_latest_reading_by_its_bytes(run_files, page):
    datasets = script_json(page, "spec-tierwhatif")["datasets"]
    ratios, sizes = {}, {}
    for metric, latest in ((names.OFFLOAD_PROJECTED_HIT_RATIO, ratios), (names.OFFLOAD_PROJECTED_SIZE, sizes)):
        for _, value, attributes in sorted(points_in(run_files, metric), key=lambda p: p[0]):
            latest[float(attributes[names.OFFLOAD_SCALE])] = value
    assert {r["scale"]: (r["GiB"], r["ratio"]) for r in datasets["tier_projected"]} == {
        scale: (sizes[scale] / 2**30, ratio) for scale, ratio in ratios.items() if scale  # scale 0: no tier
    }
    assert datasets["tier_none"] == [{"ratio": ratios[0.0], "tier": "cpu tier"}]
    assert datasets["tier_today"] == [{"GiB": sizes[1.0] / 2**30}]


def test_a_first_tiers_what_if_draws_without_the_tiers_rules(tmp_path):
    """An engine with no tier exports a first tier's projection, with no medium and no scale 0:
    the curve alone, which Chromium draws without a warning from Vega."""
    run = Run(first_tier=True, tier_scales=(1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0))
    path = tmp_path / "report.html"
    make_report(run.write(tmp_path / "otlp"), path)
    datasets = script_json(path.read_text(), "spec-tierwhatif")["datasets"]
    assert [r["tier"] for r in datasets["tier_projected"]] == ["a first tier"] * 7
    assert datasets["tier_today"] == [] and datasets["tier_none"] == []
    others = {"pool", "device", "tier", "holders", "timeline", "session_gaps", "distributions", "whatif"}
    shares = open_and_check(path, {"tierwhatif"}, frozenset(others))
    assert shares["tierwhatif"] > 0.003, shares


def test_the_tier_chart_is_every_reading_of_the_offload_tier(run_files, page):
    rows = script_json(page, "spec-tier")["datasets"]["tier"]
    points = points_in(run_files, names.OFFLOAD_BLOCKS)
    assert sorted((r["t"], r["tier"], r["state"], r["blocks"]) for r in rows) == sorted(
        (round((t - T0) / 1e9, 4), a[names.OFFLOAD_MEDIUM], a[names.BLOCK_STATE], v) for t, v, a in points
    )
    assert len(rows) == 2 * len(Run().tier)


def test_no_what_if_chart_without_its_gauge(tmp_path):
    page = make_report(Run(with_what_if=False).write(tmp_path / "otlp"), tmp_path / "report.html")
    assert 'id="spec-whatif"' not in page and 'id="spec-tierwhatif"' not in page
    assert 'id="spec-pool"' in page and 'id="spec-timeline"' in page


def test_device_memory_is_nvmls_line(run_files, page):
    rows = script_json(page, "spec-device")["datasets"]["device"]
    usage = points_in(run_files, names.GPU_MEMORY_USAGE)
    assert sorted((r["t"], r["GiB"]) for r in rows) == sorted(
        (round((t - T0) / 1e9, 4), round(v / 2**30, 3)) for t, v, _ in usage
    )


def test_the_page_needs_no_network(page):
    without_data = re.sub(r'<script type="application/json".*?</script>', "", page, flags=re.S)
    assert not re.search(r"""<(script|link|img)[^>]+(src|href)=["']?https?:""", without_data)
    assert "vegaEmbed" in page  # the bundle is inlined
    assert len(page.encode()) < 1_500_000


# --- in a browser ----------------------------------------------------------------


def test_the_page_renders_every_chart_in_headless_chromium(page, tmp_path):
    path = tmp_path / "report.html"
    path.write_text(page)
    shares = open_and_check(
        path, {"pool", "device", "tier", "holders", "timeline", "session_gaps", "distributions", "whatif", "tierwhatif"}
    )
    # Marks drawn in colour, not only axes and grey gridlines: the stacked pool is most
    # of its plot, a thin NVML line the least.
    assert shares["pool"] > 0.25, shares
    assert shares["device"] > 0.005, shares
    assert shares["tier"] > 0.005, shares
    assert shares["timeline"] > 0.05, shares
    assert shares["distributions"] > 0.03, shares
    assert shares["whatif"] > 0.003, shares
    assert shares["tierwhatif"] > 0.003, shares
    assert shares["holders"] > 0.05, shares
    assert shares["session_gaps"] > 0.01, shares


# --- nothing to report -----------------------------------------------------------


def _report_exit(capsys, otlp: Path, tmp_path: Path) -> tuple[int, str]:
    code = cli.main(["report", "--otlp-dir", str(otlp), "-o", str(tmp_path / "r.html")])
    return code, capsys.readouterr().err


def test_an_empty_directory_exits_2_saying_what_it_lacks(tmp_path, capsys):
    (tmp_path / "otlp").mkdir()
    code, err = _report_exit(capsys, tmp_path / "otlp", tmp_path)
    assert code == 2 and "has neither traces.jsonl nor metrics.jsonl" in err, err
    code, err = _report_exit(capsys, tmp_path / "missing", tmp_path)
    assert code == 2 and "is not a directory" in err, err
    assert not (tmp_path / "r.html").exists()


def test_a_foreign_directory_exits_2(tmp_path, capsys):
    otlp = tmp_path / "otlp"
    other = kv_span("x", 9, 0, 1, "stop", [])
    other.name = "GET /health"
    write_lines(otlp / "traces.jsonl", [traces_request([other])])
    write_lines(otlp / "metrics.jsonl", [metrics_request([], scope="some.other.meter")])
    (otlp / "metrics.jsonl").open("a").write("not json at all\n")
    code, err = _report_exit(capsys, otlp, tmp_path)
    assert code == 2, err
    assert "holds no otel-kvcache telemetry: 2 OTLP export requests, 1 lines that are not OTLP JSON" in err, err


def test_a_cut_line_is_skipped_and_said(run_files, tmp_path):
    otlp = tmp_path / "otlp"
    otlp.mkdir()
    for name in ("traces.jsonl", "metrics.jsonl"):
        (otlp / name).write_text((run_files / name).read_text())
    with (otlp / "traces.jsonl").open("a") as f:
        f.write('{"resourceSpans": [{"resource"')  # a collector killed mid-write
    page = make_report(otlp, tmp_path / "report.html")
    assert script_json(page, "summary")["requests"] == len(spans_in(run_files))
    assert "1 lines were not OTLP JSON and were skipped" in page


def test_without_the_report_extra_it_says_how_to_install_it(run_files, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "altair", None)  # import altair raises ImportError
    code, err = _report_exit(capsys, run_files, tmp_path)
    assert code == 2
    assert "pip install '.[report]'" in err, err


def test_the_command_is_on_the_path(run_files, tmp_path):
    """The console script, as a user runs it: the path on stdout, exit 0."""
    out = tmp_path / "sub" / "report.html"
    result = subprocess.run(
        [sys.executable, "-m", "otel_kvcache.commands.cli", "report", "--otlp-dir", str(run_files), "-o", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out) and out.stat().st_size > 0


# --- bounded reading -------------------------------------------------------------


def test_time_buckets_stay_bounded_and_keep_the_peak():
    buckets: TimeBuckets[float] = TimeBuckets(max, limit=100)
    for second in range(86_400):  # a day of once-a-second readings
        buckets.add(T0 + second * 1_000_000_000, 1000.0 if second == 50_000 else float(second % 7))
    assert 50 <= len(buckets) <= 100
    assert max(v for _, _, v in buckets) == 1000.0
    starts = [start for start, _, _ in buckets]
    assert starts == sorted(starts)


def test_row_sample_keeps_the_preempted_first_and_says_its_rule():
    sample: RowSample[int] = RowSample(cap=10)
    for i in range(1000):
        sample.offer(i, interesting=i % 100 == 0)  # 10 preempted requests
    rows = sample.rows()
    assert len(rows) == 10 and sorted(rows) == list(range(0, 1000, 100))
    assert sample.rule() == (
        "10 of 1000 requests: the preempted and leaked ones first (10), then a uniform sample of the others"
    )
    small: RowSample[int] = RowSample(cap=10)
    for i in range(3):
        small.offer(i, interesting=False)
    assert small.rows() == [0, 1, 2] and small.rule() == "every request (3)"


def test_phases_cut_a_request_at_its_events():
    ns = 1_000_000_000
    row = RequestRow("r", "t", 0, 10 * ns, "abort", 10, 0, 3, 1, 0, [
        Event(names.EVENT_ADMITTED, 1 * ns, 2, 0),
        Event(names.EVENT_PREEMPTED, 4 * ns, 3, None),
    ])  # fmt: skip  # aborted while preempted: no resume, no release event
    assert phases(row) == [
        (WAITING, 0, 1 * ns, None, None),
        (HOLDING, 1 * ns, 4 * ns, 2, 0),
        (PREEMPTED, 4 * ns, 10 * ns, 3, None),
    ]


@pytest.mark.slow
def test_reading_a_large_traces_file_streams(tmp_path):
    """20,000 requests, about 30 MB: memory stays at the bounded aggregates plus one
    export request (a line), far below the file."""
    path, templates = tmp_path / "traces.jsonl", Run().spans()
    with path.open("w") as f:
        for batch in range(100):
            spans = []
            for i in range(200):
                n, start = batch * 200 + i, batch * 10.0 + i * 0.05
                spans.append(Span())
                spans[-1].CopyFrom(templates[1 if n % 50 == 0 else 0])
                spans[-1].trace_id, spans[-1].start_time_unix_nano = n.to_bytes(16, "big"), T0 + int(start * 1e9)
            f.write(line(traces_request(spans)))
    size = path.stat().st_size
    tracemalloc.start()
    try:
        digest = read_traces(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert digest.requests == 20_000 and digest.preempted_requests == 400
    assert len(digest.sample.rows()) == 200
    assert size > 20e6 and peak < size / 5, (size, peak)
