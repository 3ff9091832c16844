"""End to end: prefill and decode on two real vLLM servers, through the demo's proxy, in one trace.

Two instrumented CPU servers share KV through vLLM's example shared-storage
connector (``ExampleConnector``: the prefill server writes each prompt's KV to a
directory, the decode server loads it by the prompt's tokens). A client's request
goes through ``demo/disagg_proxy.py``, which forwards its trace context; both
servers export to one OTLP receiver. What the decode server loaded is checked
against vLLM's own ``/metrics`` and against the KV the prefill server stored.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from safetensors import safe_open

from demo.disagg_proxy import build_app
from demo.load import traceparent
from demo.otlp_sink import attributes_of
from demo.server import ServerConfig, VLLMServer, free_port, prometheus_value
from demo.trace_text import render_trace
from otel_kvcache import names
from test_serving_e2e import wait_for

pytestmark = pytest.mark.serving

PROMPT = [20 + (7 * k) % 480 for k in range(200)]
"""Token ids, so that the length is exact: 200 tokens, six whole 32-token blocks and a tail
(the example connector stores whole blocks before the last token)."""


def shared_storage(role: str, directory) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(directory)}}  # fmt: skip


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def servers(tiny_model, sink, storage, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-disagg")
    started = []
    try:
        for role, service in (("kv_producer", "vllm-prefill"), ("kv_consumer", "vllm-decode")):
            config = ServerConfig(model=tiny_model, otlp_endpoint=sink.endpoint, block_size=32, num_blocks=64,
                                  kv_transfer_config=shared_storage(role, storage),
                                  extra_env={"OTEL_SERVICE_NAME": service})  # fmt: skip
            started.append(VLLMServer(config, logs / f"{service}.log").start())
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def proxy(servers, sink):
    """The demo's proxy in a thread, exporting its spans to the same receiver."""
    prefill, decode = servers
    provider = TracerProvider(resource=Resource.create({"service.name": "disagg-proxy"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sink.endpoint, insecure=True)))
    port = free_port()
    app = build_app(prefill.url, decode.url, tracer_provider=provider)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)
    provider.shutdown()


def stored_tokens(storage) -> dict[str, int]:
    """Tokens of KV each stored prompt has on disk (one tensor a layer, a row a token)."""
    stored = {}
    for folder in storage.iterdir():
        layer = next(folder.glob("*.safetensors"))
        with safe_open(str(layer), "pt") as tensors:
            stored[folder.name] = tensors.get_slice("kv_cache").get_shape()[0]
    return stored


def test_prefill_then_decode_is_one_trace_and_the_decode_loads_what_the_prefill_stored(
    servers, proxy, sink, storage
):
    prefill, decode = servers
    before = decode.metrics_text()
    trace_id, header = traceparent()
    body = {"model": str(prefill.config.model), "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True}
    response = httpx.post(f"{proxy}/v1/completions", json=body, headers={"traceparent": header}, timeout=120)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 8

    def kv_spans():
        found = {r["service.name"]: s for r, s in sink.spans()
                 if s.name == names.KV_REQUEST_SPAN and s.trace_id.hex() == trace_id}  # fmt: skip
        return found if len(found) == 2 else None

    spans = wait_for(kv_spans)
    producer, consumer = spans["vllm-prefill"], spans["vllm-decode"]
    produced, consumed = attributes_of(producer.attributes), attributes_of(consumer.attributes)
    assert produced[names.CONNECTOR_ROLE] == names.ROLE_PRODUCER
    assert consumed[names.CONNECTOR_ROLE] == names.ROLE_CONSUMER
    assert produced[names.CONNECTOR_NAME] == consumed[names.CONNECTOR_NAME] == "ExampleConnector"
    assert produced[names.OUTPUT_TOKENS] == 1  # the proxy's prefill leg
    [link] = consumer.links
    assert (link.trace_id, link.span_id) == (producer.trace_id, producer.span_id)

    # What the decode server loaded: vLLM's count, and the KV the prefill server wrote.
    after = decode.metrics_text()
    loaded, local = (prometheus_value(after, name) - prometheus_value(before, name)
                     for name in ("vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total"))  # fmt: skip
    [stored] = stored_tokens(storage).values()
    assert consumed[names.CONNECTOR_HIT_TOKENS] == loaded == stored > 0
    assert produced[names.CONNECTOR_HIT_TOKENS] == 0
    assert consumed[names.CACHE_READ_INPUT_TOKENS] == local + loaded

    # The proxy's span is the parent of both servers' HTTP spans: one trace, one tree.
    def whole_trace():  # each server's HTTP span ends, and is exported, after its KV span
        trace = [(r, s) for r, s in sink.spans() if s.trace_id.hex() == trace_id]
        proxied = [s for r, s in trace if r.get("service.name") == "disagg-proxy"]
        children = [s for _, s in trace for p in proxied if s.parent_span_id == p.span_id]
        return trace if len(children) == 2 else None

    trace = wait_for(whole_trace)
    [proxied] = [s for r, s in trace if r.get("service.name") == "disagg-proxy"]
    assert proxied.parent_span_id == bytes.fromhex(header.split("-")[2])  # the caller's span
    print("\n" + render_trace(trace))
