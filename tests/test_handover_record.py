"""The hand-over contract: what the engine hands over at a release, read back the way the
helper reads it (through the wire format and ``record.finished_request``), against what
vLLM's own ``Request`` objects say, on the real scheduler. A field the engine wrote in
another place than the contract reads it from fails here."""

from __future__ import annotations

from vllm.lora.request import LoRARequest
from vllm.v1.request import RequestStatus

from otel_kvcache import names
from otel_kvcache.export import wire_format
from otel_kvcache.handover.record import RequestEnded, finished_request

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _handed_over(engine, monkeypatch) -> list[tuple]:
    """Each release's fields, as the engine hands them to its record sink (passed on to it)."""
    sink = engine.scheduler._otel_kvcache_engine.record_sink
    handed, hand_on = [], sink.request_ended

    def request_ended(fields):
        handed.append(fields)
        hand_on(fields)

    monkeypatch.setattr(sink, "request_ended", request_ended)
    return handed


def test_a_released_record_reads_back_as_vllm_released_the_request(make_engine, monkeypatch):
    engine = make_engine(num_blocks=40)  # tight: preemptions
    handed = _handed_over(engine, monkeypatch)
    adapter = LoRARequest("support-adapter", 1, "/adapters/support")
    sent = [
        engine.make_request(f"r{k}", 24 + 9 * k, shared_prefix=16, max_tokens=24 + 8 * k, priority=k % 3,
                            session_id=f"session-{k % 2}", lora_request=adapter if k % 2 else None,
                            trace_headers={"traceparent": TRACEPARENT} if k % 3 else None)
        for k in range(10)
    ]  # fmt: skip
    for request in sent:
        engine.add(request)
    for _ in range(6):
        engine.step()
    engine.abort(sent[-1].request_id)
    engine.run()

    # As the helper reads them: one frame through the wire format, then the contract's decode.
    flat = [field for fields in handed for field in fields]
    encoded = wire_format.frame(flat, [], None)
    records, taken = wire_format.whole_frames(bytearray(encoded.data))
    assert taken == len(encoded.data) and encoded.records == len(handed) == len(sent)
    assert all(len(fields) == len(RequestEnded._fields) for fields in handed)
    finished = {record.request_id: finished_request(record) for record in records}

    served = engine.scheduler.vllm_config.model_config.served_model_name
    truth = engine.truth
    assert sum(request.num_preemptions for request in sent) > 0, "no preemption: the pool was not tight"
    for request in sent:
        read = finished[request.request_id]
        rid = request.request_id
        assert read.start_ns == int(request.arrival_time * 1e9)
        assert read.input_tokens == request.num_prompt_tokens
        assert read.output_tokens == request.num_output_tokens
        assert read.finish_reason == str(request.get_finished_reason())
        assert read.trace_headers == request.trace_headers
        assert read.engine_attributes == {names.ENGINE_INDEX: 0}
        assert read.connector is None
        assert read.attribution.model == (request.lora_request.lora_name if request.lora_request else served)
        assert read.attribution.priority == request.priority
        assert read.attribution.session_id == request.session_id
        assert read.preemptions == request.num_preemptions
        assert read.freed == truth.last_held_blocks[rid]
        assert read.block_size == engine.block_size
        assert read.peak == truth.peak_blocks[rid]
        kinds = [event[0] for event in read.events]
        assert kinds.count(names.EVENT_PREEMPTED) == request.num_preemptions
        assert kinds[-1] == names.EVENT_RELEASED
        released = read.events[-1]
        assert released[2] == truth.last_held_blocks[rid] and released[3] == read.finish_reason
    aborted = finished[sent[-1].request_id]
    assert sent[-1].status is RequestStatus.FINISHED_ABORTED and aborted.finish_reason == "abort"
