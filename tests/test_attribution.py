"""Who holds the KV cache, against vLLM's own state: its ``Request`` fields, its block
lists and reference counts, its prefix-cache stats, stepped on the real scheduler."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import pytest
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from conftest import Telemetry
from otel_kvcache import VLLMKVCacheInstrumentor, config, names

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TENANT = "tenant.id"


@pytest.fixture
def attributed(monkeypatch):
    """Telemetry with the settings a test sets through ``set``, read when it instruments."""

    made = []

    def instrument(**settings: str) -> Telemetry:
        for variable, value in settings.items():
            monkeypatch.setenv(getattr(config, variable), value)
        telemetry = Telemetry()
        instrumentor = VLLMKVCacheInstrumentor()
        instrumentor.instrument(tracer_provider=telemetry.tracer_provider, meter_provider=telemetry.meter_provider)
        made.append(instrumentor)
        return telemetry

    yield instrument
    for instrumentor in made:
        instrumentor.uninstrument()


def _engine(model_config, **kwargs):
    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    return EngineHarness(make_scheduler(model_config, **kwargs))


def _with_tenant(tenant: str) -> dict[str, str]:
    return {"traceparent": TRACEPARENT, "baggage": f"{TENANT}={tenant},user.note=left%20out"}


def _tenant_of(request) -> str:
    """The tenant the client sent, as vLLM's ``Request`` carries its baggage."""
    return dict(entry.split("=") for entry in request.trace_headers["baggage"].split(","))[TENANT]


def _fair_shares(engine, series_of) -> dict:
    """vLLM's block lists, each block counted 1 / its ``ref_cnt``, summed by ``series_of(request)``."""
    shares = defaultdict(float)
    for manager in engine.scheduler.kv_cache_manager.coordinator.single_type_managers:
        for request_id, blocks in manager.req_to_blocks.items():
            for block in blocks:
                if not block.is_null:
                    shares[series_of(engine.requests[request_id])] += 1 / block.ref_cnt
    return shares


def test_the_span_says_whose_request_it_was_as_vllm_holds_it(model_config, attributed):
    telemetry = attributed(BAGGAGE_KEYS=TENANT)
    engine = _engine(model_config, num_blocks=64)
    adapter = LoRARequest("support-adapter", 1, "/adapters/support")
    sent = [
        engine.make_request("chat", 40, session_id="session-7", priority=3, lora_request=adapter,
                            trace_headers=_with_tenant("acme")),
        engine.make_request("plain", 24),
        engine.make_request("long-session", 24, session_id="s" * 5000),
    ]  # fmt: skip
    for request in sent:
        engine.add(request)
    engine.run()

    spans = telemetry.span_by_request()
    served = engine.scheduler.vllm_config.model_config.served_model_name
    chat, plain, long_session = (spans[request.request_id].attributes for request in sent)
    request = sent[0]
    assert chat[names.SESSION_ID] == request.session_id
    assert chat[names.MODEL] == request.lora_request.lora_name
    assert chat[names.PRIORITY] == request.priority == 3
    assert chat[TENANT] == "acme"
    assert "user.note" not in chat  # only the baggage keys named leave the process
    assert plain[names.MODEL] == served and plain[names.PRIORITY] == 0
    assert names.SESSION_ID not in plain and TENANT not in plain
    # A session id is a client's value: bounded as request ids are.
    limit = config.client_value_length_limit()
    assert len(long_session[names.SESSION_ID]) == limit
    assert long_session[names.SESSION_ID_ORIGINAL_LENGTH] == len(sent[2].session_id)
    # Its first turn here: no gap.
    assert names.SESSION_TURN_GAP not in chat


def test_held_blocks_are_vllms_fair_shares_and_sum_to_the_used_blocks(model_config, attributed):
    telemetry = attributed(BAGGAGE_KEYS=TENANT, ATTRIBUTION=f"{names.MODEL},{TENANT}")
    engine = _engine(model_config, num_blocks=96)
    adapters = [LoRARequest(f"adapter-{k}", k + 1, f"/adapters/{k}") for k in range(2)]
    for k in range(12):  # two shared prefixes of 48 tokens (three blocks) across models and tenants
        engine.add(engine.make_request(
            f"r{k}", 64 + 8 * k, shared_prefix=48, max_tokens=12 + 4 * k,
            lora_request=adapters[k % 2] if k % 3 else None, trace_headers=_with_tenant(f"t{k % 4}"),
        ))  # fmt: skip
    served = engine.scheduler.vllm_config.model_config.served_model_name

    def series_of(request):
        model = request.lora_request.lora_name if request.lora_request else served
        return model, _tenant_of(request)

    checked = []

    def check(engine):
        if not engine.scheduler.requests:
            return
        held = {(p.attributes[names.MODEL], p.attributes[TENANT]): p.value for p in telemetry.points(names.HELD_BLOCKS)}
        truth = _fair_shares(engine, series_of)
        assert held.keys() == {key for key, share in truth.items() if share}
        for key, share in truth.items():
            assert held.get(key, 0) == pytest.approx(share, abs=1e-9)
        used = engine.pool_scan()["used"]
        assert sum(held.values()) == pytest.approx(used, abs=1e-9)
        shared = sum(1 for b in engine.scheduler.kv_cache_manager.block_pool.blocks if b.ref_cnt > 1 and not b.is_null)
        checked.append(shared)

    engine.run(after_step=check)
    assert len(checked) > 10 and max(checked) >= 3, "prefix blocks were shared while checked"


def _record_held(samples):
    """After each ``schedule()``: the time and vLLM's blocks of every request it holds."""

    def record(engine):
        now = time.time_ns()
        for request_id in engine.scheduler.requests:
            samples[request_id].append((now, engine.held_blocks(request_id)))

    return record


def _integrals(samples, released_ns) -> dict[str, float]:
    """Block-seconds: each step's blocks held until the next step, the last until the release."""
    integrals = {}
    for request_id, points in samples.items():
        times = [t for t, _ in points[1:]] + [released_ns[request_id]]
        integrals[request_id] = sum(blocks * (end - t) for (t, blocks), end in zip(points, times)) / 1e9
    return integrals


def test_occupancy_is_the_blocks_held_integrated_over_the_steps(model_config, attributed):
    telemetry = attributed(BAGGAGE_KEYS=TENANT, ATTRIBUTION=TENANT)
    engine = _engine(model_config, num_blocks=40)  # tight: preemptions
    samples, released_ns, live_checked = defaultdict(list), {}, []
    for k in range(16):
        engine.add(engine.make_request(f"r{k}", 24 + 7 * k, max_tokens=20 + 6 * k,
                                       trace_headers=_with_tenant(f"t{k % 2}")))  # fmt: skip

    def after_step(engine):
        now = time.time_ns()
        # Released within the step's update_from_output (monotonic times): its middle, on the wall clock.
        update = (engine.truth.update_started + engine.truth.update_ended) / 2
        for request_id in set(samples) - set(engine.scheduler.requests) - set(released_ns):
            released_ns[request_id] = now - int((time.monotonic() - update) * 1e9)
        if engine.steps == 30:  # a collection while requests run counts them up to the collection
            occupancy = {p.attributes[TENANT]: p.value for p in telemetry.points(names.OCCUPANCY)}
            collected = time.time_ns()
            bounds = []
            for until in (now, collected):
                truth = _integrals(samples, {**{r: until for r in samples}, **released_ns})
                by_tenant = Counter()
                for request_id, seconds in truth.items():
                    by_tenant[_tenant_of(engine.requests[request_id])] += seconds
                bounds.append(by_tenant)
            live_checked.append((occupancy, *bounds))

    engine.run(after_schedule=_record_held(samples), after_step=after_step)
    assert sum(r.num_preemptions for r in engine.requests.values()), "the pool was tight enough to preempt"

    truth = _integrals(samples, released_ns)
    spans = telemetry.span_by_request()
    errors = {r: spans[r].attributes[names.OCCUPANCY] / seconds - 1 for r, seconds in truth.items()}
    total_error = sum(spans[r].attributes[names.OCCUPANCY] for r in truth) / sum(truth.values()) - 1
    print(f"\noccupancy vs vLLM's blocks per step: per request max {max(map(abs, errors.values())):.3f}, "
          f"total {total_error:+.4f}")  # fmt: skip
    assert max(map(abs, errors.values())) < PER_REQUEST_TOLERANCE, errors
    assert abs(total_error) < TOTAL_TOLERANCE

    counted = {p.attributes[TENANT]: p.value for p in telemetry.points(names.OCCUPANCY)}
    by_tenant = Counter()
    for request_id, seconds in truth.items():
        by_tenant[_tenant_of(engine.requests[request_id])] += seconds
    for tenant, seconds in by_tenant.items():
        assert counted[tenant] == pytest.approx(seconds, rel=TOTAL_TOLERANCE)
    [(live, before, after)] = live_checked
    for tenant in before:
        assert before[tenant] * (1 - TOTAL_TOLERANCE) <= live[tenant] <= after[tenant] * (1 + TOTAL_TOLERANCE)
        assert live[tenant] < counted[tenant]


PER_REQUEST_TOLERANCE = 0.2
"""Measured here on 0.30, 0.32 and 0.34: 3.5 to 7 % at most per request, within 0.6 % in
all; what is left is the steps' uneven pace (one run of the whole suite read 17.5 % for one
request, 2026-12-07: a step slowed by something else). The total's bound is the strict one."""
TOTAL_TOLERANCE = 0.04


def test_two_hundred_tenants_make_at_most_limit_plus_one_series(model_config, attributed):
    telemetry = attributed(BAGGAGE_KEYS=TENANT, ATTRIBUTION=TENANT, ATTRIBUTION_LIMIT="32")
    engine = _engine(model_config, num_blocks=256, max_num_seqs=128)
    for k in range(200):
        engine.add(engine.make_request(f"r{k}", 24, max_tokens=6 + k % 5, trace_headers=_with_tenant(f"tenant-{k}")))
    held_series = []

    def check(engine):
        points = telemetry.points(names.HELD_BLOCKS)
        held_series.append(len(points))
        assert sum(p.value for p in points) == pytest.approx(engine.pool_scan()["used"], abs=1e-9)

    engine.step()
    check(engine)
    engine.run(after_step=check)

    occupancy = telemetry.points(names.OCCUPANCY)
    assert len(occupancy) == 33 and max(held_series) <= 33
    overflow = [p for p in occupancy if p.attributes.get(names.METRIC_OVERFLOW) is True]
    assert len(overflow) == 1 and TENANT not in overflow[0].attributes
    spans = telemetry.kv_spans()
    assert len({s.attributes[TENANT] for s in spans}) == 200  # the spans keep every tenant
    assert sum(p.value for p in occupancy) == pytest.approx(sum(s.attributes[names.OCCUPANCY] for s in spans))


def _next_turn(engine, request_id: str, previous, session_id: str):
    """A chat's next turn: the previous prompt and answer, and 16 more tokens."""
    tokens = [*previous.prompt_token_ids, *previous.output_token_ids, *range(7, 23)]
    return engine.add(Request(
        request_id=request_id, prompt_token_ids=tokens, pooling_params=None, block_hasher=engine.block_hasher,
        sampling_params=SamplingParams(max_tokens=4, ignore_eos=True), session_id=session_id,
    ))  # fmt: skip


def test_a_session_back_after_its_prefix_was_evicted_did_not_keep_it(model_config, attributed):
    telemetry = attributed()
    engine = _engine(model_config, num_blocks=24)  # 23 usable: the filler evicts an idle session's blocks
    first = {s: engine.add(engine.make_request(f"{s}-1", 64, session_id=s, max_tokens=4)) for s in ("kept", "evicted")}
    engine.run()
    _next_turn(engine, "kept-2", first["kept"], "kept")  # in time
    engine.run()
    for k in range(6):
        engine.add(engine.make_request(f"filler-{k}", 64, max_tokens=4))
    engine.run()
    _next_turn(engine, "evicted-2", first["evicted"], "evicted")  # after the filler took its blocks
    engine.run()

    spans = telemetry.span_by_request()
    kept, evicted = spans["kept-2"].attributes, spans["evicted-2"].attributes
    cached = engine.truth.first_admission_cached_tokens
    assert cached["kept-2"] >= 64 and kept[names.CACHE_READ_INPUT_TOKENS] == cached["kept-2"]
    assert cached["evicted-2"] == 0 and engine.events.removed_hashes
    assert kept[names.PREFIX_EVICTED_TOKENS] == 0 and evicted[names.PREFIX_EVICTED_TOKENS] > 0
    # From turn one's release (its span's end) to turn two's arrival, as vLLM stamped it.
    for turn in ("kept", "evicted"):
        arrival = engine.requests[f"{turn}-2"].arrival_time
        gap = spans[f"{turn}-2"].attributes[names.SESSION_TURN_GAP]
        assert gap == pytest.approx(arrival - spans[f"{turn}-1"].end_time / 1e9, abs=1e-6)
        assert gap > 0
    assert names.SESSION_TURN_GAP not in spans["kept-1"].attributes

    gaps = {p.attributes[names.SESSION_PREFIX_KEPT]: p for p in telemetry.points(names.SESSION_TURN_GAP)}
    assert gaps[True].count == 1 and gaps[False].count == 1
    assert gaps[True].sum == pytest.approx(kept[names.SESSION_TURN_GAP])
    assert gaps[False].sum == pytest.approx(evicted[names.SESSION_TURN_GAP])
