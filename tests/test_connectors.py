"""KV connectors, on vLLM's real scheduler with its real NIXL and CPU-offloading connectors
(their scheduler side, which needs no NIXL library and no GPU), the workers' connector
output faked as vLLM's own tests/v1/kv_connector/unit fake it: remote prefill, remote
decode with a delayed free, failed loads, transfers that never end, a prefix loaded back
from CPU memory. Every number is checked against vLLM's request state, its prefill
stats, and what it returns to the client."""

from __future__ import annotations

import secrets
import time

import pytest
from engine_harness import KVTransfers, nixl_both
from harness.offloading import OffloadingWorker
from vllm.config import KVTransferConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from otel_kvcache import names

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
"""What vLLM's proxy sends the prefill instance."""


def nixl(kv_role: str, policy: str = "fail") -> KVTransferConfig:
    return KVTransferConfig(kv_connector="NixlConnector", kv_role=kv_role, kv_load_failure_policy=policy)


def remote_prefill(request_id: str, blocks: int) -> dict:
    """What a prefill instance's NIXL returns, as vLLM's own connector tests make it."""
    return dict(
        do_remote_prefill=True, do_remote_decode=False, remote_engine_id="prefill-engine",
        remote_request_id=f"prefill-{request_id}", remote_block_ids=list(range(blocks)),
        remote_host="prefill-host", remote_port=1234, tp_size=1,
    )  # fmt: skip


def caller_trace() -> dict[str, str]:
    return {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"}


def attributes(telemetry, request_id: str) -> dict:
    return dict(telemetry.span_by_request()[request_id].attributes)


def events(telemetry, request_id: str, name: str) -> list:
    return [e for e in telemetry.span_by_request()[request_id].events if e.name == name]


class Clock:
    """The harness's ``after_schedule`` callback: when the last ``schedule()`` returned."""

    def __init__(self) -> None:
        self.scheduled = 0.0

    def __call__(self, harness) -> None:
        self.scheduled = time.monotonic()


@pytest.fixture(autouse=True)
def no_instrumentation_error(telemetry):
    yield
    assert telemetry.total(names.INSTRUMENTATION_ERRORS) == 0


@pytest.fixture
def findings_every_step(monkeypatch):
    monkeypatch.setenv("OTEL_KVCACHE_RECONCILE_SECONDS", "0")
    monkeypatch.setenv("OTEL_KVCACHE_ZOMBIE_GRACE_SECONDS", "0")  # only the connector's timeout protects a hold


def test_remote_prefill_counts_what_the_connector_loaded_and_the_wait_for_it(make_engine, telemetry):
    decode = make_engine(num_blocks=64, kv_transfer_config=nixl("kv_consumer"))
    request = decode.add(decode.make_request("d-1", 80, max_tokens=4, kv_transfer_params=remote_prefill("d-1", 5)))
    clock = Clock()
    started = time.monotonic()
    decode.step(after_schedule=clock)
    parked = clock.scheduled
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # vLLM parks it for the load
    loaded = request.num_computed_tokens  # vLLM's external computed tokens
    assert loaded > 0
    time.sleep(0.05)
    decode.step(kv_connector_output=KVConnectorOutput(finished_recving={"d-1"}))
    ready = decode.truth.update_started, decode.truth.update_ended
    decode.run()

    attrs = attributes(telemetry, "d-1")
    assert attrs[names.CONNECTOR_NAME] == type(decode.scheduler.connector).__name__
    assert attrs[names.CONNECTOR_ROLE] == names.ROLE_CONSUMER
    assert attrs[names.CONNECTOR_HIT_TOKENS] == loaded == decode.truth.external_cached_tokens["d-1"]
    assert decode.truth.connector_hits == loaded  # vLLM's connector prefix-cache stats
    local = decode.truth.first_admission_cached_tokens["d-1"]
    assert attrs[names.CACHE_READ_INPUT_TOKENS] == local + loaded
    assert ready[0] - parked <= attrs[names.CONNECTOR_WAIT_SECONDS] <= ready[1] - started
    [event] = events(telemetry, "d-1", names.EVENT_REMOTE_KV_READY)
    assert event.attributes[names.CONNECTOR_WAIT_SECONDS] == attrs[names.CONNECTOR_WAIT_SECONDS]
    assert names.CONNECTOR_DELAYED_FREE_SECONDS not in attrs  # a consumer frees at once
    assert attrs[names.CONNECTOR_FAILED_BLOCKS] == attrs[names.CONNECTOR_RECOMPUTED_TOKENS] == 0
    assert telemetry.total(names.CONNECTOR_HIT_TOKENS) == loaded


def test_remote_decode_holds_the_blocks_until_the_send_and_the_consumer_links_the_producer(
    make_engine, telemetry, findings_every_step
):
    prefill = make_engine(num_blocks=64, kv_transfer_config=nixl("kv_producer"))
    trace = caller_trace()
    request = prefill.add(
        prefill.make_request("p-1", 80, max_tokens=1, trace_headers=trace, kv_transfer_params=REMOTE_DECODE)
    )
    prefill.step()
    finished = prefill.truth.update_started, prefill.truth.update_ended
    assert request.is_finished() and "p-1" in prefill.scheduler.requests  # vLLM holds it for the send
    held = prefill.held_blocks("p-1")
    assert held > 0
    assert telemetry.total(names.CONNECTOR_HELD_BLOCKS) == held
    assert telemetry.total(names.CONNECTOR_HELD_REQUESTS) == 1
    assert telemetry.total(names.CONNECTOR_HELD_AGE_MAX) > 0
    returned = prefill.truth.kv_transfer_params["p-1"]  # what vLLM answers the proxy
    assert returned["do_remote_prefill"]  # NIXL's own parameters are all there
    time.sleep(0.05)
    prefill.step()  # the zombie grace is 0, but the hold is within the connector's timeout
    prefill.step(kv_connector_output=KVConnectorOutput(finished_sending={"p-1"}))
    sent = prefill.truth.update_started, prefill.truth.update_ended
    assert "p-1" not in prefill.scheduler.requests

    producer = telemetry.span_by_request()["p-1"]
    attrs = dict(producer.attributes)
    assert attrs[names.CONNECTOR_ROLE] == names.ROLE_PRODUCER
    assert sent[0] - finished[1] <= attrs[names.CONNECTOR_DELAYED_FREE_SECONDS] <= sent[1] - finished[0]
    assert attrs[names.BLOCKS_FREED] == held
    [send_done] = events(telemetry, "p-1", names.EVENT_SEND_DONE)
    assert send_done.attributes[names.BLOCKS] == held
    assert not events(telemetry, "p-1", names.EVENT_ZOMBIE)
    assert telemetry.total(names.CONNECTOR_HELD_REQUESTS) == 0
    _, trace_id, span_id, flags = returned[names.PRODUCER_SPAN_PARAMETER].split("-")
    assert trace_id == trace["traceparent"].split("-")[1] == f"{producer.context.trace_id:032x}"
    assert flags == trace["traceparent"].split("-")[3]  # sampled as the caller's trace is
    assert span_id == f"{producer.context.span_id:016x}"

    # The proxy hands the producer's parameters, as vLLM returned them, to the decode instance.
    decode = make_engine(num_blocks=64, kv_transfer_config=nixl("kv_consumer"))
    decode.add(decode.make_request("p-1", 80, max_tokens=4, trace_headers=trace, kv_transfer_params=returned))
    decode.step()
    decode.step(kv_connector_output=KVConnectorOutput(finished_recving={"p-1"}))
    decode.run()
    [consumer] = [s for s in telemetry.kv_spans() if s is not producer and s.attributes[names.REQUEST_ID] == "p-1"]
    assert consumer.attributes[names.CONNECTOR_ROLE] == names.ROLE_CONSUMER
    assert consumer.context.trace_id == producer.context.trace_id
    [link] = consumer.links
    assert (link.context.trace_id, link.context.span_id) == (producer.context.trace_id, producer.context.span_id)
    assert consumer.attributes[names.CONNECTOR_HIT_TOKENS] == decode.truth.external_cached_tokens["p-1"] > 0


def test_a_producer_aborted_before_its_hand_off_hands_nothing_on(make_engine, telemetry):
    prefill = make_engine(num_blocks=64, kv_transfer_config=nixl("kv_producer"))
    prefill.add(
        prefill.make_request("p-1", 80, max_tokens=4, trace_headers=caller_trace(), kv_transfer_params=REMOTE_DECODE)
    )
    scheduler, answers = prefill.scheduler, []
    connector_finished = scheduler._connector_finished  # vLLM's: it calls the connector's request_finished
    scheduler._connector_finished = lambda request: answers.append(connector_finished(request)) or answers[-1]
    prefill.step()
    prefill.abort("p-1")
    [(delay_free, kv_transfer_params)] = answers
    assert (delay_free, kv_transfer_params) == (False, None)  # NIXL's answer to an abort, left as it was
    assert telemetry.span_by_request()["p-1"].attributes[names.FINISH_REASON] == "abort"


@pytest.mark.parametrize("sent", ["not a traceparent", 42, f"00-{'0' * 32}-{'1' * 16}-01"])
def test_a_consumer_given_a_bad_producer_span_links_nothing(make_engine, telemetry, sent):
    decode = make_engine(num_blocks=64, kv_transfer_config=nixl("kv_consumer"))
    params = {**remote_prefill("d-1", 5), names.PRODUCER_SPAN_PARAMETER: sent}  # from the client, as it is
    decode.add(decode.make_request("d-1", 80, max_tokens=2, kv_transfer_params=params))
    decode.step()
    decode.step(kv_connector_output=KVConnectorOutput(finished_recving={"d-1"}))
    decode.run()
    span = telemetry.span_by_request()["d-1"]
    assert span.attributes[names.CONNECTOR_ROLE] == names.ROLE_CONSUMER
    assert not span.links


@pytest.mark.parametrize(
    "failure, policy",
    [("invalid_block_ids", "recompute"), ("failed_recving", "recompute"), ("failed_recving", "fail")],
)
def test_a_failed_load_counts_its_blocks_and_the_tokens_vllm_recomputes(make_engine, telemetry, failure, policy):
    decode = make_engine(num_blocks=64, kv_transfer_config=nixl("kv_consumer", policy))
    request = decode.add(decode.make_request("d-1", 80, max_tokens=4, kv_transfer_params=remote_prefill("d-1", 5)))
    decode.step()
    block_ids = decode.scheduler.kv_cache_manager.get_block_ids("d-1")[0]
    computed = request.num_computed_tokens
    if failure == "invalid_block_ids":
        output = KVConnectorOutput(finished_recving={"d-1"}, invalid_block_ids={block_ids[2], 10_000})
        failed = 1  # the request's blocks among vLLM's invalid ones
    else:
        output = KVConnectorOutput(finished_recving={"d-1"}, failed_recving={"d-1"})
        failed = decode.held_blocks("d-1")  # the whole load
    decode.step(kv_connector_output=output)
    recomputed = 0 if request.is_finished() else computed - request.num_computed_tokens  # vLLM truncated it
    assert (request.status == RequestStatus.FINISHED_ERROR) == (policy == "fail")
    decode.run()

    attrs = attributes(telemetry, "d-1")
    assert attrs[names.CONNECTOR_FAILED_BLOCKS] == failed
    assert attrs[names.CONNECTOR_RECOMPUTED_TOKENS] == recomputed
    assert (recomputed > 0) == (policy == "recompute")
    [event] = events(telemetry, "d-1", names.EVENT_LOAD_FAILED)
    assert event.attributes[names.CONNECTOR_FAILED_BLOCKS] == failed
    assert telemetry.total(names.CONNECTOR_LOAD_FAILURES) == failed
    assert attrs[names.FINISH_REASON] == ("error" if policy == "fail" else "length")


def test_a_transfer_that_never_ends_is_stuck_then_a_zombie_past_the_connectors_timeout(
    make_engine, telemetry, findings_every_step, monkeypatch
):
    monkeypatch.setenv("OTEL_KVCACHE_CONNECTOR_TIMEOUT_SECONDS", "0.3")
    decode = make_engine(num_blocks=64, kv_transfer_config=nixl("kv_consumer"))
    request = decode.add(decode.make_request("d-1", 80, max_tokens=4, kv_transfer_params=remote_prefill("d-1", 5)))
    decode.step()
    decode.step()
    assert telemetry.total(names.STUCK_REQUESTS) == 0  # waiting, within the timeout
    time.sleep(0.35)
    decode.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # vLLM still waits
    assert telemetry.total(names.STUCK_REQUESTS) == 1

    # The client leaves: vLLM keeps the blocks the transfer may still write.
    decode.abort("d-1")
    decode.step()
    held = decode.held_blocks("d-1")
    assert held > 0 and request.is_finished() and "d-1" in decode.scheduler.requests
    assert telemetry.total(names.ZOMBIE_REQUESTS) == 0  # held within the timeout, grace 0 or not
    time.sleep(0.35)
    decode.step()
    assert telemetry.total(names.ZOMBIE_REQUESTS) == 1
    assert telemetry.total(names.ZOMBIE_BLOCKS) == held

    decode.step(kv_connector_output=KVConnectorOutput(finished_recving={"d-1"}))  # it ends after all
    assert "d-1" not in decode.scheduler.requests
    [stuck] = events(telemetry, "d-1", names.EVENT_STUCK)
    assert stuck.attributes[names.STUCK_REASON] == names.STUCK_REMOTE_KV_WAIT
    [zombie] = events(telemetry, "d-1", names.EVENT_ZOMBIE)
    assert zombie.attributes[names.ZOMBIE_REASON] == names.ZOMBIE_CONNECTOR_TIMEOUT
    assert zombie.attributes[names.BLOCKS] == held
    attrs = attributes(telemetry, "d-1")
    assert attrs[names.FINISH_REASON] == "abort"
    assert attrs[names.CONNECTOR_WAIT_SECONDS] >= 0.6


def test_cpu_offloading_loads_a_prefix_back_after_the_gpu_cache_lost_it(make_engine, telemetry):
    offloading = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                  kv_connector_extra_config={"cpu_bytes_to_use": 64 << 20})  # fmt: skip
    engine = make_engine(num_blocks=64, kv_transfer_config=offloading)
    worker = OffloadingWorker()

    def run(clock=None):
        for _ in range(100):
            if not (engine.scheduler.has_requests() or worker.jobs):
                return
            worker.take(engine.step(after_schedule=clock, kv_connector_output=worker.output()))
        raise AssertionError("still busy after 100 steps")

    engine.add(engine.make_request("a", 80, shared_prefix=80, max_tokens=8))
    run()  # the request, and the store of its prompt's blocks to CPU memory
    assert engine.scheduler.reset_prefix_cache()  # the GPU's copy is gone, the CPU's stays
    b = engine.add(engine.make_request("b", 96, shared_prefix=80, max_tokens=4))
    clock = Clock()
    started = time.monotonic()
    worker.take(engine.step(after_schedule=clock))
    parked = clock.scheduled
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # loading back from CPU memory
    loaded = b.num_computed_tokens
    worker.take(engine.step(kv_connector_output=worker.output()))  # the load completes
    ready = engine.truth.update_started, engine.truth.update_ended
    run()

    attrs = attributes(telemetry, "b")
    assert attrs[names.CONNECTOR_NAME] == type(engine.scheduler.connector).__name__ == "OffloadingConnector"
    assert attrs[names.CONNECTOR_HIT_TOKENS] == loaded == engine.truth.external_cached_tokens["b"] == 80
    assert attrs[names.CACHE_READ_INPUT_TOKENS] == engine.truth.first_admission_cached_tokens["b"] + loaded
    assert ready[0] - parked <= attrs[names.CONNECTOR_WAIT_SECONDS] <= ready[1] - started
    assert names.CONNECTOR_ROLE not in attrs  # kv_both, and no hand-off parameters
    stored = attributes(telemetry, "a")
    assert stored[names.CONNECTOR_HIT_TOKENS] == 0
    assert names.CONNECTOR_DELAYED_FREE_SECONDS not in stored  # its store never held its blocks


def test_an_engine_without_a_connector_reports_none_of_it(engine, telemetry):
    engine.add(engine.make_request("r-1", 40, max_tokens=2))
    engine.run()
    assert not engine.scheduler.connector
    assert not [k for k in attributes(telemetry, "r-1") if k.startswith("vllm.kv_cache.connector.")]
    assert not telemetry.points(names.CONNECTOR_HELD_BLOCKS)
    assert "update_from_output" not in vars(engine.scheduler)  # its hooks are per engine: none here


def test_uninstrument_takes_the_hooks_off_the_engine_it_patched(make_engine, telemetry):
    from otel_kvcache import VLLMKVCacheInstrumentor

    decode = make_engine(num_blocks=64, kv_transfer_config=nixl("kv_consumer"))
    patched = ("update_from_output", "_free_request")
    assert all(name in vars(decode.scheduler) for name in patched)
    assert "update_state_after_alloc" in vars(decode.scheduler.connector)
    VLLMKVCacheInstrumentor().uninstrument()
    assert not [name for name in patched if name in vars(decode.scheduler)]
    assert "update_state_after_alloc" not in vars(decode.scheduler.connector)
    decode.add(decode.make_request("d-1", 80, max_tokens=2, kv_transfer_params=remote_prefill("d-1", 5)))
    decode.step()
    decode.step(kv_connector_output=KVConnectorOutput(finished_recving={"d-1"}))
    decode.run()  # vLLM's own methods again


def test_loads_waiting_for_an_inflight_slot_are_not_stalls(make_engine, telemetry):
    """vLLM 0.34's ``--max-num-inflight-kv-loads``: a request whose remote KV cannot start
    loading yet waits at the head of ``async_kv_waiting`` with no allocation failure,
    step after step; only what vLLM's ``allocate_slots`` refused is a stall."""
    from vllm.config import SchedulerConfig

    if "max_num_inflight_kv_loads" not in SchedulerConfig.__dataclass_fields__:
        pytest.skip("vLLM before 0.34 has no cap on in-flight KV loads")
    transfers = KVTransfers(make_engine(num_blocks=64, kv_transfer_config=nixl_both(), max_num_inflight_kv_loads=1),
                            recv_steps=4)
    for _ in range(6):  # three of them load remote KV, one at a time
        transfers.add(prompt_len=48)
    transfers.run()
    truth = transfers.harness.truth
    assert transfers.loads == 3
    spans = telemetry.span_by_request()
    assert telemetry.total(names.ALLOCATION_STALLS) == len(truth.stalls)
    for request_id, span in spans.items():
        assert span.attributes[names.ALLOCATION_STALLS] == sum(1 for rid, _ in truth.stalls if rid == request_id), request_id
