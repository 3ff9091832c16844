"""Miss reasons, the what-if curve and who preempted whom, against vLLM's own numbers.

The curve is checked against the truth: the same recorded stream replayed by
real schedulers with pools of other sizes, uninstrumented, each in a fresh
process, their hit ratios taken from vLLM's ``PrefixCacheStats``.
"""

from __future__ import annotations

import multiprocessing

import pytest

import prefix_stream
from otel_kvcache import names
from otel_kvcache.engine import whatif
from otel_kvcache.engine.whatif import SCALES
from otel_kvcache.handover.miss_reasons import FREED, LOOKUP

TOLERANCE = 0.05
CHECKED_SCALES = (0.5, 2.0, 4.0)


class ReadBetweenFieldsAndHashes(list):
    """The curve's pending events, read (``catch_up``) each time the engine thread has
    written an event's fields and not yet its blocks' hashes: where a reader on another
    thread may take the GIL."""

    def __init__(self, reuse: whatif.PrefixReuse) -> None:
        super().__init__()
        self.reuse = reuse
        self.left_waiting: list[int] = []

    def extend(self, entries) -> None:
        super().extend(entries)
        if isinstance(entries, tuple) and entries[0] in (LOOKUP, FREED) and entries[-1]:
            self.reuse.catch_up()
            self.left_waiting.append(len(self))  # what it could not take in yet


class HashesFailOnce(list):
    """The curve's pending events, where the first call adding an event's hashes fails, as
    a ``MemoryError`` or an interrupt between an event's two calls would have it; what
    ``at_failure()`` returned then is kept in ``failed_at``."""

    def __init__(self, at_failure=lambda: True) -> None:
        super().__init__()
        self.at_failure = at_failure
        self.failed_at = None

    def extend(self, entries) -> None:
        if type(entries) is list and entries and self.failed_at is None:
            self.failed_at = self.at_failure()
            raise MemoryError("injected between an event's fields and its hashes")
        super().extend(entries)


def pending_events_in(monkeypatch, make_events) -> list:
    """Every ``PrefixReuse`` made from now on keeps its pending events in ``make_events(reuse)``;
    returns those lists, as they are made."""
    made = []
    init = whatif.PrefixReuse.__init__

    def init_with_events(reuse, *args, **kwargs):
        init(reuse, *args, **kwargs)
        reuse._curve_events = make_events(reuse)
        made.append(reuse._curve_events)

    monkeypatch.setattr(whatif.PrefixReuse, "__init__", init_with_events)
    return made


@pytest.mark.slow
@pytest.mark.parametrize(
    ("most_pending", "read_mid_event"),
    [(1 << 62, False), (8, False), (1 << 62, True)],
    ids=["caught-up-when-read", "caught-up-on-the-engine-thread", "read-between-an-events-fields-and-hashes"],
)
def test_the_projected_curve_is_what_vllm_hits_with_pools_of_those_sizes(
    make_engine, telemetry, tmp_path, capsys, monkeypatch, most_pending, read_mid_event
):
    # The curve's work waits for its reader; with nobody reading for long, the engine
    # thread takes some in at each step; a reader may come while an event is half
    # written: the same curve every way.
    monkeypatch.setattr(whatif, "MOST_PENDING", most_pending)
    interleaved = pending_events_in(monkeypatch, ReadBetweenFieldsAndHashes) if read_mid_event else []
    engine_slices = []
    catch_up = whatif.PrefixReuse.catch_up

    def counting_catch_up(reuse, most=None, wait=True):
        if most is not None:  # a slice the engine thread took in (catch_up_if_behind)
            engine_slices.append(most)
        catch_up(reuse, most, wait)

    monkeypatch.setattr(whatif.PrefixReuse, "catch_up", counting_catch_up)
    sizes = [int(scale * prefix_stream.POOL_BLOCKS) for scale in CHECKED_SCALES]
    with multiprocessing.get_context("spawn").Pool(2) as pool:  # uninstrumented: a process of their own
        measured = pool.map_async(prefix_stream.measured_hit_ratio, sizes)
        engine = prefix_stream.replay(make_engine(num_blocks=prefix_stream.POOL_BLOCKS, max_num_seqs=32))
        assert bool(engine_slices) == (most_pending == 8)  # the engine thread took slices in only when bound
        if read_mid_event:  # each read left the half-written event alone: its fields, 9 or 2
            [events] = interleaved
            assert events.left_waiting and set(events.left_waiting) == {9, 2}
        measured = dict(zip(CHECKED_SCALES, measured.get(timeout=600)))

    projected = {p.attributes[names.POOL_SCALE]: p.value for p in telemetry.points(names.PROJECTED_HIT_RATIO)}
    assert sorted(projected) == sorted(SCALES)
    assert abs(projected[1.0] - engine.truth.prefix_hits / engine.truth.prefix_queries) < 1e-9
    with capsys.disabled():  # the README quotes these
        print("\nscale  projected  measured by vLLM")
        for scale in CHECKED_SCALES:
            print(f"{scale:5}  {projected[scale]:.3f}      {measured[scale]:.3f}")
    assert measured[4.0] - measured[0.5] > 0.3, "the stream must make the pool's size matter"
    for scale in CHECKED_SCALES:
        assert abs(projected[scale] - measured[scale]) < TOLERANCE, (scale, projected, measured)
    # Half the pool preempted in vLLM (the stream's peak demand does not fit it): so says the gauge.
    [free_scale] = [p.value for p in telemetry.points(names.PROJECTED_PREEMPTION_FREE_SCALE)]
    assert 0.5 < free_scale <= 1.0

    # The gate fails this load test when doubling the pool would gain more than it allows.
    from otel_kvcache.commands import gate

    telemetry.write_otlp_json(tmp_path)
    gain = projected[2.0] - projected[1.0]
    assert gate.main(["--otlp-dir", str(tmp_path), "--min-projected-hit-gain", f"{gain + 0.01}"]) == 0
    assert gate.main(["--otlp-dir", str(tmp_path), "--min-projected-hit-gain", f"{gain - 0.01}"]) == 1
    assert "the KV pool is too small for this traffic" in capsys.readouterr().err


def test_the_miss_reasons_add_up_to_vllms_misses(make_engine, telemetry):
    engine = prefix_stream.replay(make_engine(num_blocks=prefix_stream.POOL_BLOCKS, max_num_seqs=32))
    misses = {
        reason: telemetry.total(names.PREFIX_CACHE_MISSES, **{names.MISS_REASON: reason})
        for reason in (names.MISS_EVICTED, names.MISS_COLD, names.MISS_UNCACHEABLE)
    }
    assert sum(misses.values()) == engine.truth.prefix_queries - engine.truth.prefix_hits
    assert engine.events.removed_hashes and misses[names.MISS_EVICTED]  # vLLM evicted: some misses say so
    spans = telemetry.kv_spans()
    assert sum(s.attributes[names.PREFIX_EVICTED_TOKENS] for s in spans) == misses[names.MISS_EVICTED]
    assert sum(s.attributes[names.PREFIX_COLD_TOKENS] for s in spans) == misses[names.MISS_COLD]


def test_a_pool_that_never_evicts_has_no_evicted_misses(make_engine, telemetry):
    engine = make_engine(num_blocks=4096)
    for turn in range(3):  # the same prefix again and again, and new ones
        for chat in range(4):
            engine.add(engine.make_request(f"chat-{chat}-{turn}", prompt_len=90 + 40 * turn, shared_prefix=64))
        engine.run()
    assert engine.events.removed_hashes == 0  # vLLM's own KV events: nothing was evicted
    block_size = engine.block_size
    for span in telemetry.kv_spans():
        a = span.attributes
        assert a[names.PREFIX_EVICTED_TOKENS] == 0
        cacheable = (a[names.INPUT_TOKENS] - 1) // block_size * block_size
        assert a[names.PREFIX_COLD_TOKENS] == cacheable - a[names.CACHE_READ_INPUT_TOKENS]


def test_evicted_tokens_are_the_tokens_that_would_have_hit(model_config, make_engine, telemetry):
    """A prompt comes back after a flood evicted it: its evicted tokens are what vLLM hits
    for it, on the same pool, when nothing came in between."""
    from engine_harness import EngineHarness
    from harness.scheduler import make_scheduler

    def first_then_again(engine, flood: bool) -> None:
        engine.add(engine.make_request("first", prompt_len=150, shared_prefix=150, max_tokens=2))
        engine.run()
        if flood:  # unrelated prompts that need every block of the pool
            for index in range(6):
                engine.add(engine.make_request(f"flood-{index}", prompt_len=160, max_tokens=2))
                engine.run()
        engine.add(engine.make_request("again", prompt_len=150, shared_prefix=150, max_tokens=2))
        engine.run()

    flooded = make_engine(num_blocks=32)
    first_then_again(flooded, flood=True)
    quiet = EngineHarness(make_scheduler(model_config, num_blocks=32))
    hits_before = quiet.truth.prefix_hits
    first_then_again(quiet, flood=False)
    would_have_hit = quiet.truth.prefix_hits - hits_before
    assert would_have_hit > 0 and flooded.events.removed_hashes > 0

    again = [s for s in telemetry.kv_spans() if s.attributes[names.REQUEST_ID] == "again"]
    flooded_again = again[0].attributes  # the flooded engine's request ended first
    assert flooded_again[names.CACHE_READ_INPUT_TOKENS] == 0
    assert flooded_again[names.PREFIX_EVICTED_TOKENS] == would_have_hit
    assert flooded_again[names.PREFIX_COLD_TOKENS] == 0


def test_a_preemption_names_and_links_the_request_vllm_was_scheduling(make_engine, telemetry):
    engine = make_engine(num_blocks=12, max_num_seqs=2)
    engine.add(engine.make_request("early", prompt_len=40, max_tokens=100))
    engine.step()
    engine.add(engine.make_request("late", prompt_len=50, max_tokens=100))  # fills the last block first
    scheduled_when_preempted: dict[str, list[set]] = {}
    while engine.scheduler.has_requests():
        output = engine.step()
        for request_id in output.preempted_req_ids or ():
            # vLLM's own record of the step: what it scheduled while it preempted.
            scheduled_when_preempted.setdefault(request_id, []).append(set(output.num_scheduled_tokens))
    assert scheduled_when_preempted, "the pool must be small enough to preempt"
    spans, named, linked = telemetry.span_by_request(), 0, 0
    for victim, steps in scheduled_when_preempted.items():
        events = [e for e in spans[victim].events if e.name == names.EVENT_PREEMPTED]
        assert len(events) == len(steps) == engine.requests[victim].num_preemptions
        preemptors = set()
        for event, scheduled in zip(events, steps):
            preemptor = event.attributes.get(names.PREEMPTED_FOR)
            if preemptor is not None:  # absent: vLLM preempted the request it was scheduling
                assert preemptor != victim and preemptor in scheduled
                preemptors.add(preemptor)
        named += len(preemptors)
        ended_first = {p for p in preemptors if spans[p].end_time < spans[victim].end_time}
        assert {link.attributes[names.REQUEST_ID] for link in spans[victim].links} == ended_first
        linked += len(spans[victim].links)
        for link in spans[victim].links:
            assert link.context.span_id == spans[link.attributes[names.REQUEST_ID]].context.span_id
    assert named and linked, "some preemption must have been for another request, which ended first"


def test_a_bounded_lookup_misses_nothing_past_its_bound(make_engine, telemetry):
    """vLLM 0.34 bounds a prompt-scoring request's prefix lookup (``prefix_cache_hit_limit``,
    the first scored row): the cached blocks past the bound are not looked up, so they
    are neither evicted nor cold misses."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    if not hasattr(Request, "get_max_cache_hit_length"):
        pytest.skip("vLLM before 0.34 has no bounded lookup")
    engine = make_engine(num_blocks=256)
    warm = engine.add(engine.make_request("warm", prompt_len=120, shared_prefix=112, max_tokens=2))
    engine.run()
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=1, prompt_logprob_start=40, skip_reading_prefix_cache=False)
    scored = engine.add(Request(request_id="scored", prompt_token_ids=list(warm.prompt_token_ids),
                                sampling_params=scoring, pooling_params=None, block_hasher=engine.block_hasher))
    assert scored.prefix_cache_hit_limit == 40
    engine.run()
    assert engine.events.removed_hashes == 0
    hit = engine.truth.first_admission_cached_tokens["scored"]
    assert hit == 40 // engine.block_size * engine.block_size  # vLLM read no further than the bound
    span = telemetry.span_by_request()["scored"].attributes
    assert span[names.CACHE_READ_INPUT_TOKENS] == hit
    assert span[names.PREFIX_EVICTED_TOKENS] == span[names.PREFIX_COLD_TOKENS] == 0


def test_a_failing_curve_event_is_dropped_and_counted_and_vllm_runs_on(make_engine, telemetry, monkeypatch):
    monkeypatch.setattr(whatif, "MOST_PENDING", 8)  # the engine thread takes events in at every step
    taken = []
    curve_lookup = whatif.PrefixReuse._curve_lookup

    def fails_first(reuse, *args):
        taken.append(args)
        if len(taken) == 1:
            raise RuntimeError("injected into the curve")
        curve_lookup(reuse, *args)

    monkeypatch.setattr(whatif.PrefixReuse, "_curve_lookup", fails_first)
    engine = prefix_stream.replay(make_engine(num_blocks=prefix_stream.POOL_BLOCKS, max_num_seqs=32))

    assert not engine.scheduler.has_requests()  # vLLM served the whole stream
    [error] = telemetry.points(names.INSTRUMENTATION_ERRORS)
    assert (error.attributes[names.HOOK], error.value) == ("Scheduler.schedule", 1)
    assert len(taken) > 1  # the failed event went; the ones after it were taken in
    # Each lookup taken in once, the failed one too: their tokens are vLLM's queries.
    assert sum(queried_tokens for _, _, _, queried_tokens, *_ in taken) == engine.truth.prefix_queries


def test_an_event_whose_hashes_never_came_costs_the_curve_a_restart_and_no_more(make_engine, telemetry, monkeypatch):
    """An event's hashes follow its fields in a second call: where that call fails (a
    ``MemoryError``, an interrupt), the entries after it cannot be read as events. The
    reader finds that (the kinds are objects no field or hash can be), drops what waits,
    and the curve starts again: counted, vLLM served, and the events after it taken in."""
    monkeypatch.setattr(whatif, "MOST_PENDING", 8)  # the engine thread reads at every step
    made, taken = [], []  # each lookup's keys and queried tokens, as the engine saw it and as the curve took it in
    on_lookup, curve_lookup = whatif.PrefixReuse.on_lookup, whatif.PrefixReuse._curve_lookup

    def recording_on_lookup(reuse, keys, hit_blocks, block_size, queried_tokens, *rest):
        made.append((list(keys), queried_tokens))
        return on_lookup(reuse, keys, hit_blocks, block_size, queried_tokens, *rest)

    def recording_curve_lookup(reuse, keys, hit_blocks, block_size, queried_tokens, *rest):
        taken.append((list(keys), queried_tokens))
        curve_lookup(reuse, keys, hit_blocks, block_size, queried_tokens, *rest)

    pending = pending_events_in(monkeypatch, lambda reuse: HashesFailOnce(at_failure=lambda: len(made)))
    monkeypatch.setattr(whatif.PrefixReuse, "on_lookup", recording_on_lookup)
    monkeypatch.setattr(whatif.PrefixReuse, "_curve_lookup", recording_curve_lookup)
    engine = prefix_stream.replay(make_engine(num_blocks=prefix_stream.POOL_BLOCKS, max_num_seqs=32))

    assert not engine.scheduler.has_requests()  # vLLM served the whole stream
    [events] = pending
    assert events.failed_at is not None
    errors = {p.attributes[names.HOOK]: p.value for p in telemetry.points(names.INSTRUMENTATION_ERRORS)}
    assert errors.pop("Scheduler.schedule") >= 1  # the reading that found the loss (catch_up_if_behind, at a step)
    assert sum(errors.values()) == 1  # the hook whose call failed, once
    assert not events  # all taken in at the collection
    # The lookups after the loss went into the curve as vLLM made them, to the last one.
    later = made[events.failed_at + 1 :]
    assert len(later) > 20 and taken[-len(later) // 2 :] == later[-len(later) // 2 :]


def test_a_read_that_lost_the_events_order_starts_the_curve_again_rather_than_sticking():
    """One lookup's hashes lost (their call failed), then a lookup without a hit. Read as
    the lost hashes, the next event's kind leaves the reader on that lookup's hit count, 0:
    while the kinds were integers, taken for a lookup whose count was a hash, a ``TypeError``
    at every reading from then on and the events waiting without bound. Kinds that no field
    can be let the reader find the loss: it drops what waits, and the curve starts again."""
    import hashlib

    block_hash = [hashlib.sha256(bytes([n])).digest() for n in range(3)]  # as vLLM's hasher makes them
    reuse = whatif.PrefixReuse(pool_blocks=64, sample_rate=0.5)
    reuse._curve_events = HashesFailOnce()
    with pytest.raises(MemoryError):
        reuse.on_lookup(block_hash[:1], 0, 16, 32, 0, 1.0)
    reuse.on_lookup(block_hash[1:3], 0, 16, 48, 1, 2.0)
    failures = []
    for _ in range(3):
        try:
            reuse.catch_up()
        except Exception as exc:  # noqa: BLE001 - what the caller counts
            failures.append(type(exc))
    assert failures and failures[-1] is ValueError and len(failures) <= 2
    assert not reuse._curve_events  # dropped, not left waiting
    reuse.on_lookup(block_hash[1:3], 2, 16, 48, 2, 3.0)  # the curve goes on
    assert reuse.projected_hit_ratios(now=3.0)  # taken in: a window with looked-up tokens
