"""Leaks made on purpose in the real scheduler are found, named and gated; healthy storms are not."""

from __future__ import annotations

import logging
import socket

import pytest
from opentelemetry import trace

from engine_harness import break_free_for
from otel_kvcache import names
from otel_kvcache.commands import gate

@pytest.fixture
def leak_settings(monkeypatch):
    # A pass at every step: a finding must show at the first step after the leak.
    monkeypatch.setenv("OTEL_KVCACHE_RECONCILE_SECONDS", "0")
    monkeypatch.setenv("OTEL_KVCACHE_ZOMBIE_GRACE_SECONDS", "0")
    monkeypatch.setenv("OTEL_KVCACHE_STUCK_STEPS", "4")


class TraceContextOfLogs(logging.Handler):
    """Keeps each finding log record with the trace id current when it was logged."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.getMessage(), trace.get_current_span().get_span_context().trace_id))


@pytest.fixture
def finding_logs():
    handler = TraceContextOfLogs()
    logger = logging.getLogger("otel_kvcache.findings")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _gauge(telemetry, name) -> float:
    return telemetry.total(name)


def _run_until_gone(engine, request_id: str) -> None:
    while request_id in engine.scheduler.requests:
        engine.step()


def test_a_request_vllm_does_not_free_is_found_named_and_lands_on_its_span(
    leak_settings, make_engine, telemetry, monkeypatch, finding_logs
):
    engine = make_engine(num_blocks=64)
    break_free_for(monkeypatch, engine, "victim", orphan=False)
    engine.add(engine.make_request("victim", prompt_len=70, max_tokens=4))
    others = [engine.add(engine.make_request(f"other-{i}", prompt_len=40, max_tokens=60)) for i in range(2)]
    _run_until_gone(engine, "victim")
    leaked = engine.held_blocks("victim")  # vLLM's own KV manager still lists them
    assert leaked > 0

    span = telemetry.span_by_request()["victim"]
    leak_events = [e for e in span.events if e.name == names.EVENT_LEAK]
    assert [e.attributes[names.BLOCKS] for e in leak_events] == [leaked]
    assert any("victim" in m and t == span.context.trace_id for m, t in finding_logs.records)

    engine.step()  # the finding must show by the end of the first step after the release
    assert _gauge(telemetry, names.ZOMBIE_REQUESTS) == 1
    assert _gauge(telemetry, names.ZOMBIE_BLOCKS) == leaked
    assert _gauge(telemetry, names.ORPHANED_BLOCKS) == 0  # the blocks have an owner: the dead request
    findings = [s for s in telemetry.spans.get_finished_spans() if s.name == names.FINDING_SPAN]
    [finding] = findings
    assert finding.parent.span_id == span.context.span_id  # in the victim's trace, under its span
    assert finding.events[0].name == names.EVENT_ZOMBIE
    assert finding.events[0].attributes[names.REQUEST_ID] == "victim"
    engine.run()
    assert all(telemetry.span_by_request()[r.request_id].attributes[names.FINISH_REASON] == "length" for r in others)


def test_references_nobody_owns_are_orphaned_blocks(leak_settings, make_engine, telemetry, monkeypatch):
    engine = make_engine(num_blocks=64)
    lost = break_free_for(monkeypatch, engine, "victim", orphan=True)
    engine.add(engine.make_request("victim", prompt_len=70, max_tokens=4))
    engine.add(engine.make_request("bystander", prompt_len=40, max_tokens=60))
    _run_until_gone(engine, "victim")
    assert lost and all(block.ref_cnt > 0 for block in lost)
    engine.step()  # the finding must show by the end of the first step after the release
    assert _gauge(telemetry, names.ORPHANED_BLOCKS) == len(lost)
    assert _gauge(telemetry, names.ZOMBIE_REQUESTS) == 0


def _no_findings_at_every_step(telemetry):
    def check(harness):
        for name in (names.ORPHANED_BLOCKS, names.ZOMBIE_REQUESTS, names.STUCK_REQUESTS):
            assert _gauge(telemetry, name) == 0, f"{name} at step {harness.steps}"

    return check


@pytest.mark.parametrize("storm", ["aborts", "prefix sharing", "preemptions"])
def test_healthy_storms_raise_no_finding(leak_settings, monkeypatch, make_engine, telemetry, storm):
    engine = make_engine(num_blocks=24 if storm == "preemptions" else 96)
    check = _no_findings_at_every_step(telemetry)
    if storm == "aborts":
        requests = [engine.add(engine.make_request(f"a{i}", prompt_len=30 + i, max_tokens=80)) for i in range(30)]
        for wave in range(5):
            engine.step()
            check(engine)
            engine.abort(*(r.request_id for r in requests[wave::5] if r.request_id in engine.scheduler.requests))
            check(engine)
    elif storm == "prefix sharing":
        for i in range(40):
            engine.add(engine.make_request(f"p{i}", prompt_len=80, shared_prefix=64, max_tokens=6))
    else:
        requests = [
            engine.add(engine.make_request(f"q{i}", prompt_len=40 + 8 * i, shared_prefix=32, max_tokens=90))
            for i in range(6)
        ]
    engine.run(after_step=check)
    if storm == "preemptions":
        assert sum(r.num_preemptions for r in requests) > 0
    spans = telemetry.spans.get_finished_spans()
    assert not [s for s in spans if s.name == names.FINDING_SPAN]
    assert not [e for s in spans for e in s.events if e.name in (names.EVENT_LEAK, names.EVENT_ZOMBIE, names.EVENT_STUCK)]


def test_tail_slack_and_prefix_composition_match_vllms_state(leak_settings, monkeypatch, make_engine, telemetry):
    engine = make_engine(num_blocks=40)
    for i in range(8):
        engine.add(engine.make_request(f"s{i}", prompt_len=50 + 5 * i, shared_prefix=32, max_tokens=40))

    def check(harness):
        slack = 0
        for request in harness.scheduler.requests.values():
            held = harness.held_blocks(request.request_id)
            if held and not request.is_finished():
                slack += held * harness.block_size - request.num_computed_tokens
        assert _gauge(telemetry, names.TAIL_SLACK) == slack
        used = harness.pool_scan()["used"]
        assert _gauge(telemetry, names.TAIL_SLACK_RATIO) == (slack / (used * harness.block_size) if used else 0)
        assert _gauge(telemetry, names.CACHED_BLOCKS_HIT_AGAIN) == harness.hits.cached_blocks_hit_again()
        hit_again_seen.append(harness.hits.cached_blocks_hit_again())

    hit_again_seen = []
    engine.run(after_schedule=check)  # reconciliation passes run once schedule() returned
    assert max(hit_again_seen) > 0, "the workload must reuse prefixes that then sit free"
    # More requests than the pool holds: cached prefixes were evicted, and aged.
    assert engine.events.removed_hashes > 0
    assert _gauge(telemetry, names.EVICTIONS) == engine.events.removed_hashes
    assert _gauge(telemetry, names.EVICTION_AGE) > 0
    assert _gauge(telemetry, names.RECOMPUTED_TOKENS) == sum(
        s.attributes[names.RECOMPUTED_TOKENS] for s in telemetry.kv_spans()
    )


def test_the_gate_passes_a_clean_run_and_fails_a_leaking_one(
    leak_settings, make_engine, telemetry, monkeypatch, tmp_path, capsys
):
    clean = make_engine(num_blocks=64)
    for i in range(4):
        clean.add(clean.make_request(f"c{i}", prompt_len=50, max_tokens=5))
    clean.run()
    telemetry.write_otlp_json(tmp_path / "clean")
    assert gate.main(["--otlp-dir", str(tmp_path / "clean")]) == 0
    assert "PASS" in capsys.readouterr().out

    leaking = make_engine(num_blocks=64, data_parallel_rank=1)
    break_free_for(monkeypatch, leaking, "victim", orphan=False)
    leaking.add(leaking.make_request("victim", prompt_len=70, max_tokens=4))
    leaking.run()  # the engine goes idle: it reconciles at once
    telemetry.write_otlp_json(tmp_path / "leaking")
    assert gate.main(["--otlp-dir", str(tmp_path / "leaking")]) == 1
    err = capsys.readouterr().err
    assert "engine 1: zombie requests 1 > tolerance 0" in err
    assert "request victim (kv_cache.leak" in err and "request victim (kv_cache.zombie" in err
    assert "engine 0" not in err
    # Tolerances are the gate's to set.
    assert gate.main(["--otlp-dir", str(tmp_path / "leaking"), "--max-zombie-requests", "1"]) == 0


def test_the_gate_says_so_when_it_cannot_read_the_endpoint(capsys):
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/metrics"
    assert gate.main(["--prometheus", url]) == 2
    assert f"FAIL: cannot read {url}" in capsys.readouterr().err


def test_the_gate_reads_a_prometheus_endpoints_text():
    text = (
        "# HELP vllm_kv_cache_orphaned_blocks Block references no live request accounts for.\n"
        'vllm_kv_cache_orphaned_blocks{vllm_engine_index="0"} 3\n'
        'vllm_kv_cache_zombie_requests{vllm_engine_index="0"} 0\n'
        'vllm_kv_cache_tail_slack_ratio{vllm_engine_index="0"} 0.1\n'
    )
    readings = gate.readings_from_prometheus(text)
    assert gate.evaluate(readings, gate.Tolerances()) == ["engine 0: orphaned blocks 3 > tolerance 0"]
