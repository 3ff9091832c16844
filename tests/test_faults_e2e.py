"""Faults a production meets, on vLLM's real server: its default shutdown, a killed
helper, a collector that is not there. Expected values come from vLLM's responses
and from what reaches a real OTLP receiver."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from demo.load import LoadClient
from demo.otlp_sink import OTLPSink, attributes_of
from demo.server import ServerConfig, VLLMServer, free_port
from otel_kvcache import names

from test_serving_e2e import kv_spans, wait_for


@pytest.fixture
def sink():
    sink = OTLPSink().start()
    yield sink
    sink.stop()


def _serve(tiny_model, sink, tmp_path) -> VLLMServer:
    # vLLM's default shutdown: no --shutdown-timeout, so it SIGKILLs the EngineCore's tree at once.
    config = ServerConfig(model=tiny_model, otlp_endpoint=sink.endpoint, num_blocks=256, max_num_seqs=32)
    return VLLMServer(config, tmp_path / "server.log").start()


def _burst(server: VLLMServer, count: int, max_tokens: int = 8, concurrency: int = 32) -> list:
    async def send():
        client = LoadClient(server.url, str(server.config.model))
        limit = asyncio.Semaphore(concurrency)

        async def one(i):
            async with limit:
                return await client.complete("burst", f"Request {i}: how many blocks?", max_tokens)

        try:
            return await asyncio.gather(*(one(i) for i in range(count)))
        finally:
            await client.close()

    sent = asyncio.run(send())
    assert all(s.status == 200 for s in sent)
    return sent


def _helpers_of(engine_pid: int) -> list[psutil.Process]:
    """The helper processes of one EngineCore (no children of it: they are reparented)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "otel_kvcache.export.helper" in cmdline and cmdline[-1] == str(engine_pid):
            found.append(process)
    return found


def _has_exited(pid: int) -> bool:
    """Gone, or a zombie (this machine's init does not reap orphans)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _what_otel_kvcache_said(tmp_path) -> list[str]:
    """The server log's lines of ours (a helper's death, a give-up), for a failure's message."""
    return [line for line in (tmp_path / "server.log").read_text().splitlines() if "otel-kvcache" in line]


def _latest_totals(sink: OTLPSink, metric_name: str, engine_pid: int) -> dict[tuple, int]:
    """A cumulative counter's latest value from one process, per attribute set."""
    latest: dict[tuple, tuple[int, int]] = {}
    for resource, metric in sink.metrics(metric_name):
        if resource.get("process.pid") != engine_pid:
            continue
        for point in metric.sum.data_points:
            key = tuple(sorted((k, str(v)) for k, v in attributes_of(point.attributes).items()))
            if key not in latest or point.time_unix_nano >= latest[key][0]:
                latest[key] = (point.time_unix_nano, point.as_int)
    return {key: value for key, (_, value) in latest.items()}


@pytest.mark.serving
def test_sigint_right_after_a_burst_loses_no_kv_span(tiny_model, tmp_path):
    """A collector that takes a quarter of a second to answer each export: when vLLM's
    shutdown kills the EngineCore's process tree (within milliseconds of the SIGINT),
    the helper is still sending the burst's last spans. (Slower, and a busy machine
    made the helper's backlog outlast its 10 s deadline.)"""
    sink = OTLPSink(trace_delay=0.25).start()
    try:
        server = _serve(tiny_model, sink, tmp_path)
        try:
            sent = _burst(server, 60)
        finally:
            server.stop(settle=0)  # SIGINT at once, then whatever is left in its session is killed
        trace_ids = [s.trace_id for s in sent]
        deadline = time.monotonic() + 40  # the helper's deadline, and then some
        while len(arrived := kv_spans(sink, trace_ids)) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.25)
    finally:
        sink.stop()
    assert len(arrived) == len(sent), _what_otel_kvcache_said(tmp_path)
    tokens = {s.trace_id: s.usage["completion_tokens"] for s in sent}
    assert all(attributes_of(span.attributes)[names.OUTPUT_TOKENS] == tokens[span.trace_id.hex()]
               for _, span in arrived)


@pytest.mark.serving
def test_a_killed_helper_is_replaced_and_the_drop_counter_covers_what_was_lost(tiny_model, sink, tmp_path):
    server = _serve(tiny_model, sink, tmp_path)
    try:
        sent = _burst(server, 20)
        [(resource, _)] = wait_for(lambda: kv_spans(sink, [sent[0].trace_id]))
        engine_pid = resource["process.pid"]
        [helper] = _helpers_of(engine_pid)

        async def load_with_a_kill():
            client = LoadClient(server.url, str(server.config.model))
            try:
                during = [asyncio.ensure_future(client.complete("during", f"Story {i}", 40)) for i in range(24)]
                await asyncio.sleep(0.5)
                helper.kill()  # while requests run and finish
                return await asyncio.gather(*during)
            finally:
                await client.close()

        during = asyncio.run(load_with_a_kill())
        assert all(s.status == 200 for s in during)  # serving went on
        after = _burst(server, 20)
        trace_ids = [s.trace_id for s in sent + during + after]
        # Spans arrive again from a new helper (within a second or two here; a busy machine
        # makes its start slower).
        def after_arrived():
            return len(kv_spans(sink, [s.trace_id for s in after]))

        try:
            wait_for(lambda: after_arrived() == len(after), timeout=60)
        except AssertionError:
            dropped = _latest_totals(sink, names.TELEMETRY_DROPPED, engine_pid)
            helpers = [(p.pid, p.status()) for p in _helpers_of(engine_pid)]
            raise AssertionError(
                f"{after_arrived()} of {len(after)} spans arrived after the kill; dropped: {dropped}; "
                f"helpers: {helpers}; the server said: {_what_otel_kvcache_said(tmp_path)}"
            ) from None
        [replacement] = _helpers_of(engine_pid)
        assert replacement.pid != helper.pid and _has_exited(helper.pid)

        def accounted():
            arrived = kv_spans(sink, trace_ids)
            dropped = sum(_latest_totals(sink, names.TELEMETRY_DROPPED, engine_pid).values())
            return (len(arrived) + dropped >= len(trace_ids)) and (arrived, dropped)

        arrived, dropped = wait_for(accounted, timeout=20)
    finally:
        server.stop()
    # Every request has its span, once, or is counted. A span can be counted and arrive all the
    # same only if the helper was killed after sending it and before saying so, so only a record
    # handed over before the kill.
    arrived_ids = [span.trace_id for _, span in arrived]
    assert len(set(arrived_ids)) == len(arrived_ids)
    missing = len(trace_ids) - len(arrived_ids)
    assert missing <= dropped <= missing + len(sent) + len(during)


def _engine_script(tmp_path, body: str) -> str:
    """A program that instruments (spans through the helper), builds an engine on the real
    scheduler as ``engine``, then runs ``body``."""
    tests = os.path.dirname(os.path.abspath(__file__))
    prologue = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path[:0] = [{tests!r}, {os.path.dirname(tests)!r}]
        from conftest import Telemetry
        from engine_harness import EngineHarness
        from harness.scheduler import make_model_config, make_scheduler
        from otel_kvcache import VLLMKVCacheInstrumentor

        VLLMKVCacheInstrumentor().instrument(meter_provider=Telemetry().meter_provider)
        engine = EngineHarness(make_scheduler(make_model_config({str(tmp_path)!r}), num_blocks=64))
        """
    )
    return prologue + textwrap.dedent(body)


def _helper_environment(endpoint: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "OTEL_KVCACHE_EXPORTER_PROCESS": "on",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        **extra,
    }


@pytest.mark.slow
def test_a_helper_whose_collector_is_unreachable_exits_soon_after_its_engine(tmp_path):
    """The engine ends as vLLM's shutdown ends it (SIGKILL), leaving its helper frames it
    cannot deliver (each export retries for 30 s): the helper gives up at its deadline,
    says so, and does not outlive the engine by more."""
    from otel_kvcache.export.helper import SHUTDOWN_SECONDS

    code = _engine_script(
        tmp_path,
        """
        exporter = engine.scheduler._otel_kvcache_engine.record_sink
        for wave in range(3):  # three frames, one after another
            for i in range(4):
                engine.add(engine.make_request(f"w{wave}-{i}", prompt_len=40, max_tokens=4))
            engine.run()
            time.sleep(1)
        while exporter.helper_pid is None:
            exporter.flush()
            time.sleep(0.05)
        print(f"helper={exporter.helper_pid}", flush=True)
        os.kill(os.getpid(), 9)
        """,
    )
    # Nothing listens there; each export retries for 30 s.
    environment = _helper_environment(f"http://127.0.0.1:{free_port()}", OTEL_EXPORTER_OTLP_TIMEOUT="30")
    # The helper inherits the engine's stderr: a file, so that nothing here waits for the helper.
    with open(tmp_path / "stderr.log", "w") as stderr:
        engine = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr,
                                text=True, timeout=300, env=environment)
    killed_at = time.monotonic()
    assert engine.returncode == -signal.SIGKILL, (tmp_path / "stderr.log").read_text()
    [helper_pid] = [int(word.split("=")[1]) for word in engine.stdout.split() if word.startswith("helper=")]
    assert not _has_exited(helper_pid), "the helper went with its engine: nothing could drain"
    while not _has_exited(helper_pid) and time.monotonic() - killed_at < SHUTDOWN_SECONDS + 10:
        time.sleep(0.2)
    assert _has_exited(helper_pid)
    assert time.monotonic() - killed_at > SHUTDOWN_SECONDS - 1  # it did try, for the time it had
    assert "gives up" in (tmp_path / "stderr.log").read_text()


@pytest.mark.slow
def test_vllms_first_process_waits_for_the_helpers_at_its_exit(tmp_path):
    """In a container, the main process's exit kills every process left: the first
    process (here one that runs its engine in-process, as ``LLM`` can) exits only once
    its helper has exported what it was handed, through a collector that is slow."""
    code = _engine_script(
        tmp_path,
        """
        for i in range(6):
            engine.add(engine.make_request(f"r{i}", prompt_len=40, max_tokens=4))
        engine.run()
        print(f"first={os.getpid()}", flush=True)
        """,
    )
    sink = OTLPSink(trace_delay=2.0).start()
    environment = _helper_environment(sink.endpoint)
    try:
        with open(tmp_path / "stderr.log", "w") as stderr:
            first = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr,
                                   text=True, timeout=300, env=environment)
        assert first.returncode == 0, (tmp_path / "stderr.log").read_text()
        # By the time the first process is gone, the helper has delivered.
        received = [s for _, s in sink.spans() if s.name == names.KV_REQUEST_SPAN]
        [first_pid] = [w.split("=")[1] for w in first.stdout.split() if w.startswith("first=")]
    finally:
        sink.stop()
    assert len(received) == 6
    assert not (tempfile.gettempdir() / Path(f"otel-kvcache-helpers-{first_pid}.lock")).exists()


OUTAGE_SECONDS = 45


@pytest.mark.serving
def test_a_collector_gone_for_45_s_while_requests_come_loses_no_span(tiny_model, tmp_path):
    """The collector stops, requests keep coming for 45 s, and it comes back on its port:
    every request's KV span arrives, once, with its parent (the API server's span, held
    there as the KV span is in the helper), and nothing is counted as dropped."""
    first = OTLPSink().start()
    server = _serve(tiny_model, first, tmp_path)
    try:
        before = _burst(server, 6)
        wait_for(lambda: len(kv_spans(first, [s.trace_id for s in before])) == len(before))
        first.stop()
        stopped, during = time.monotonic(), []
        while time.monotonic() - stopped < OUTAGE_SECONDS:
            during += _burst(server, 3)
            time.sleep(2)
        back = OTLPSink(port=first.port).start()
        try:
            after = _burst(server, 3)
            late = [s.trace_id for s in during + after]
            wait_for(lambda: len(kv_spans(back, late)) >= len(late), timeout=180)
            # The engine's metrics reach the collector again, with its drop counter if it counted.
            wait_for(lambda: any(True for _ in back.metrics(names.BLOCKS)), timeout=60)
            time.sleep(2)  # one more export of every process's metrics
        finally:
            server.stop()
            back.stop()
    finally:
        first.stop()
    assert len(during) >= 15  # requests kept coming all along
    sent = before + during + after
    # Each span arrived once, in one collector or the other (a parent may have been held
    # across the stop while its KV span was not).
    arrived = kv_spans(first, [s.trace_id for s in sent]) + kv_spans(back, [s.trace_id for s in sent])
    assert sorted(span.trace_id.hex() for _, span in arrived) == sorted(s.trace_id for s in sent)
    assert sorted(span.trace_id.hex() for _, span in kv_spans(back, late)) == sorted(late)
    servers = [span.span_id for sink in (first, back) for _, span in sink.spans() if span.kind == span.SPAN_KIND_SERVER]
    assert len(servers) == len(set(servers))
    assert all(span.parent_span_id in set(servers) for _, span in arrived), _what_otel_kvcache_said(tmp_path)
    dropped = [point.as_int for sink in (first, back) for _, metric in sink.metrics(names.TELEMETRY_DROPPED)
               for point in metric.sum.data_points]  # fmt: skip
    assert not any(dropped), _what_otel_kvcache_said(tmp_path)
    assert any("is unreachable (connection refused); spans are held" in line for line in _what_otel_kvcache_said(tmp_path))
