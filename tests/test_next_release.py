"""Rehearsals of the next vLLM release: a later version, and each piece we depend on taken away.

A release we have not verified must still be instrumented (the declared range
has a lower bound only), with one warning naming what it lacks. Each hook
point and each internal is taken away in turn, as a release that renamed it
would (the table names what vLLM no longer has, as 0.34's rename of
``KVCacheBlock._block_hash`` did), and a busy run of the real scheduler must
then: finish every request; make ``doctor`` name exactly that piece; and
record everything that does not depend on it exactly as vLLM's own state says.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import Telemetry
from engine_harness import EngineHarness
from harness.scheduler import make_scheduler

from otel_kvcache import VLLMKVCacheInstrumentor, names
from otel_kvcache.commands import doctor
from otel_kvcache.vllm_compat import hook_points, internals
from otel_kvcache.vllm_compat.versions import installed_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPENTELEMETRY_INSTRUMENT = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")

# What each check of vLLM's ground truth depends on: hook-point roles and internal keys.
# Every check not listed for a piece must still hold without it.
CHECKS = {
    "preemptions": {"preempt"},
    "peak_blocks": {"preempt"},
    "cached_tokens": {"prefix_lookup", "new_requests"},
    "prefix_hits": {"prefix_lookup", "lookup_enabled"},
    "pool": {"queue_prepend", "queue_append", "touch"},
}


def _busy_run(model_config) -> tuple[EngineHarness, list]:
    """Shared prefixes, preemptions (24 blocks for six requests), an abort."""
    engine = EngineHarness(make_scheduler(model_config, num_blocks=24))
    requests = [
        engine.add(engine.make_request(f"req-{i}", prompt_len=40 + 8 * i, shared_prefix=32, max_tokens=40))
        for i in range(6)
    ]
    for step in range(600):
        if not engine.scheduler.has_requests():
            break
        if step == 10:
            engine.abort("req-1")
        engine.step()
    return engine, requests


def _pieces() -> list:
    hook = [pytest.param("hook point", p.qualname, id=p.qualname) for p in hook_points.hook_points_of()]
    internal = [pytest.param("internal", i.key, id=i.qualname) for i in internals.INTERNALS]
    return hook + internal


@pytest.fixture
def take_away(monkeypatch):
    """Renames one hook point or internal in the tables, as a release that renamed it in vLLM."""

    def take(kind: str, key: str) -> tuple[str, bool]:
        if kind == "hook point":
            table = list(hook_points.HOOK_POINTS)
            [index] = [i for i, point in enumerate(table) if point.qualname == key][:1]
            gone = table[index] = table[index]._replace(method=table[index].method + "_renamed")
            monkeypatch.setattr(hook_points, "HOOK_POINTS", tuple(table))
            return gone.qualname, bool(gone.why_core)
        table = list(internals.INTERNALS)
        [index] = [i for i, internal in enumerate(table) if internal.key == key]
        gone = table[index] = table[index]._replace(name=table[index].name + "_renamed")
        monkeypatch.setattr(internals, "INTERNALS", tuple(table))
        internals.missing.cache_clear()
        core = bool(gone.why_core) and (gone.fallback is None or not internals.is_present(gone.fallback))
        return gone.qualname, core

    yield take
    monkeypatch.undo()
    internals.missing.cache_clear()


def _internal(key: str):
    [internal] = [internal for internal in internals.INTERNALS if internal.key == key]
    return internal


def _doctor() -> tuple[list[str], bool]:
    """doctor's lines but its verdict, and the verdict."""
    lines, ready = doctor.report()
    return [line for line in lines if not line.startswith(("NOT READY", "ready"))], ready


@pytest.fixture(scope="module")
def doctor_before() -> list[str]:
    return _doctor()[0]


@pytest.mark.parametrize("kind, key", _pieces())
def test_without_one_piece_vllm_serves_doctor_names_it_and_the_rest_is_exact(
    kind, key, take_away, doctor_before, model_config, caplog
):
    qualname, core = take_away(kind, key)
    if kind == "hook point":  # what the checks below expect goes by what it records: its role
        [point] = [p for p in hook_points.HOOK_POINTS if p.qualname == qualname]
        key = point.role
    after, ready = _doctor()
    changed = [line for line in after if line not in doctor_before]
    assert len(changed) == 1 and qualname in changed[0], changed
    fallback = kind == "internal" and internals.read_from(_internal(key)) is not None
    if fallback:  # read from the second source vLLM offers: nothing is off
        assert changed[0].split()[0] == "found" and "read from" in changed[0], changed[0]
    else:
        assert changed[0].split()[0] == "missing", changed[0]
    assert ready is not core

    if kind == "hook point":  # an engine's line names the hook points of the modules it imported
        importlib.import_module(point.module)
    telemetry = Telemetry()
    instrumentor = VLLMKVCacheInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
    try:
        with caplog.at_level(logging.INFO, logger="vllm.otel_kvcache"):
            engine, requests = _busy_run(model_config)
    finally:
        instrumentor.uninstrument()

    # vLLM served: every request ran to its end.
    assert all(request.is_finished() for request in requests)
    assert sum(len(request.output_token_ids) == 40 for request in requests) == 5
    # One line in vLLM's log names the piece and what it costs: the engine's start-up line,
    # or, for the hook that builds the engine, the patcher's.
    logged = [r for r in caplog.records if r.name == "vllm.otel_kvcache" and r.levelno >= logging.WARNING]
    if fallback:  # on a verified release, nothing to warn about
        assert not logged, [r.getMessage() for r in logged]
        line = ""
    else:
        [line] = [r.getMessage() for r in logged if qualname in r.getMessage()]
        assert "missing" in line or "has no" in line, line
    spans = telemetry.span_by_request()
    if core:
        assert "no request spans" in line or key == "scheduler_init"
        assert not spans and not telemetry.points(names.BLOCKS)
        return
    assert set(spans) == {request.request_id for request in requests}
    assert telemetry.total(names.INSTRUMENTATION_ERRORS) == 0

    truth = engine.truth
    holds = {check for check, depends_on in CHECKS.items() if key not in depends_on}
    if "preemptions" in holds:
        assert sum(r.num_preemptions for r in requests) > 0  # the run preempts
        for request in requests:
            assert spans[request.request_id].attributes[names.PREEMPTIONS] == request.num_preemptions
        assert telemetry.total(names.PREEMPTIONS) == sum(r.num_preemptions for r in requests)
    if "peak_blocks" in holds:
        for request in requests:
            assert spans[request.request_id].attributes[names.BLOCKS_PEAK] == truth.peak_blocks[request.request_id]
    if "cached_tokens" in holds:
        for request_id, cached in truth.first_admission_cached_tokens.items():
            assert spans[request_id].attributes[names.CACHE_READ_INPUT_TOKENS] >= cached
    if "prefix_hits" in holds:
        assert truth.prefix_hits > 0
        assert telemetry.total(names.PREFIX_CACHE_HITS) == truth.prefix_hits
        assert telemetry.total(names.PREFIX_CACHE_QUERIES) == truth.prefix_queries
    if "pool" in holds:
        assert telemetry.blocks_by_state() == engine.pool_scan()


@pytest.mark.slow
def test_a_later_vllm_is_instrumented_by_opentelemetry_instrument(tmp_path):
    """A made-up vLLM 0.99.0 (its metadata shadows the installed one's): the loader admits
    the instrumentor, the engine warns once that the release is not verified, and every
    request gets its span."""
    distribution, _ = installed_vllm()
    metadata = tmp_path / f"{distribution.replace('-', '_')}-0.99.0.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.99.0\n")
    program = textwrap.dedent(
        """
        import tempfile
        from importlib.metadata import version
        from opentelemetry import trace
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from engine_harness import EngineHarness
        from harness.scheduler import make_model_config, make_scheduler

        spans = InMemorySpanExporter()
        trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(spans))
        engine = EngineHarness(make_scheduler(make_model_config(tempfile.mkdtemp()), num_blocks=24))
        for i in range(4):
            engine.add(engine.make_request(f"req-{i}", prompt_len=40, shared_prefix=32))
        engine.run()
        kv = sorted(s.attributes["vllm.request.id"] for s in spans.get_finished_spans()
                    if s.name == "vllm.kv_cache.request")
        print("VERSION", version(%r))
        print("SPANS", " ".join(kv))
        """
        % distribution
    )
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT, os.path.join(ROOT, "tests")]),
        "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
        "OTEL_KVCACHE_EXPORTER_PROCESS": "off", "VLLM_CONFIGURE_LOGGING": "0",
    }  # fmt: skip
    result = subprocess.run([OPENTELEMETRY_INSTRUMENT, sys.executable, "-c", program], capture_output=True,
                            text=True, timeout=300, env=environment, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "VERSION 0.99.0" in result.stdout
    assert "SPANS req-0 req-1 req-2 req-3" in result.stdout, result.stdout + result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "otel-kvcache" in line and "0.99.0" in line]
    assert len(warnings) == 1 and "not verified" in warnings[0], result.stderr[-3000:]

    # doctor says so too, and that it is still ready.
    doctor_run = subprocess.run([os.path.join(os.path.dirname(sys.executable), "otel-kvcache"), "doctor"],
                                capture_output=True, text=True, timeout=300, env=environment, cwd=ROOT)  # fmt: skip
    assert doctor_run.returncode == 0, doctor_run.stdout + doctor_run.stderr
    assert f"vLLM: {distribution} 0.99.0, not verified" in doctor_run.stdout
    assert "not a release otel-kvcache was verified on" in doctor_run.stdout
    assert "ready: the request span can be made" in doctor_run.stdout
