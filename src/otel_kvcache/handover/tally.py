"""A live request's tally: one flat list of counts, indexed by the constants below.

The engine keeps one per live request (``EngineTelemetry.requests``) and, when
the request ends, hands its bytes (``PACKED``) to the exporter, which reads them
back into a ``FinishedRequest`` (``record.finished_request``). Flat on
purpose: a tally made of Python objects (a slotted object, its event list and
tuples) is a dozen small objects allocated at admission, scattered over the heap,
all cold again when the request ends, when the engine thread reads them. A list is
one object, and CPython specializes reading and writing its items by index (an
``array`` converts each item written through ``PyArg_Parse``). At release the list
is packed into bytes in one C call (``PACKED``). Bytes are no object the garbage
collector tracks, so the records and the series' counts that hold them until later
add none. What each form cost: ``docs/overhead.md#tally``.

Events other than the first admission and the release (preempted, resumed,
stuck, zombie) are rare, and kept apart as tuples (``EngineTelemetry.event``).
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence
from struct import Struct

FIELDS = (
    # What the span reports. The prefix-hit, peak and allocated counts sum the
    # admission periods closed so far: a preemption closes one on the engine
    # thread, the exporter closes the last (``close_admission_period``).
    "start_ns",
    "block_size",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "peak",
    "allocated",
    "prefix_hit_blocks",
    "freed",
    "preemptions",
    "recomputed_tokens",
    "stalls",
    "evicted_tokens",  # of the missed tokens, those whose blocks were evicted (``miss_reasons.py``)
    "missed_tokens",  # prompt tokens the prefix lookups missed: evicted, or else cold
    "still_held",
    "request_id_length",  # a client's request id that was cut: its length (``bounds.py``), else 0
    "occupancy_block_ns",  # blocks held, integrated over time: the stretches closed so far (``hold``)
    "turn_gap_ns",  # from the session's previous release here to this arrival; -1: none
    # The first admission and the release, as events: when, blocks, prefix-hit
    # tokens (admission), and the pool's free blocks then (its used ones are the
    # rest of its limit).
    "admitted_ns",
    "admitted_blocks",
    "admitted_hit_tokens",
    "admitted_pool_free",
    "released_ns",
    "released_pool_free",
    "pool_limit",
    # The engine's own bookkeeping.
    "period_hit_tokens",  # prefix-hit tokens of the admission period under way
    "last_stall_step",
    "progress_tokens",  # computed tokens when the reconciler last looked
    "progress_step",
    "stretch_start_ns",  # when the running stretch of held blocks began (0: none running)
    "stretch_start_blocks",  # the blocks held then
    "stretch_start_tokens",  # the computed tokens then
    "released_tokens",  # computed tokens at release: where the last stretch ends (``released_occupancy``)
    "session_id_length",  # a client's session id that was cut: its length (``bounds.py``), else 0
    "lookup_serial",  # its missed lookups' number in what the helper is handed (0: none), ``miss_reasons.py``
    "period_hit_blocks",  # the blocks the prefix hit of the admission period under way gave it
)
(
    START_NS,
    BLOCK_SIZE,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    CACHE_READ_TOKENS,
    PEAK,
    ALLOCATED,
    PREFIX_HIT_BLOCKS,
    FREED,
    PREEMPTIONS,
    RECOMPUTED_TOKENS,
    STALLS,
    EVICTED_TOKENS,
    MISSED_TOKENS,
    STILL_HELD,
    REQUEST_ID_LENGTH,
    OCCUPANCY_BLOCK_NS,
    TURN_GAP_NS,
    ADMITTED_NS,
    ADMITTED_BLOCKS,
    ADMITTED_HIT_TOKENS,
    ADMITTED_POOL_FREE,
    RELEASED_NS,
    RELEASED_POOL_FREE,
    POOL_LIMIT,
    PERIOD_HIT_TOKENS,
    LAST_STALL_STEP,
    PROGRESS_TOKENS,
    PROGRESS_STEP,
    STRETCH_START_NS,
    STRETCH_START_BLOCKS,
    STRETCH_START_TOKENS,
    RELEASED_TOKENS,
    SESSION_ID_LENGTH,
    LOOKUP_SERIAL,
    PERIOD_HIT_BLOCKS,
) = range(len(FIELDS))

REPORTED = FIELDS[: TURN_GAP_NS + 1]
"""The counts the span reports as they are, named as ``record.FinishedRequest``'s fields
(the missed tokens but the evicted ones are its ``cold_tokens``)."""
PACKED = Struct(f"{len(FIELDS)}q")
"""A released tally's bytes, 64-bit counts in the machine's order: ``PACKED.pack(*tally)``
(``packed_clamped`` where a count is past 64 bits), read back by ``PACKED.unpack``."""

Tally = MutableSequence[int]
"""A request's counts, indexed by the constants above: a list while it lives and where a
released one is read back."""


def blank_tally(block_size: int, pool_limit: int) -> Tally:
    """The tally of a request nothing has happened to yet (new ones are copies: ``blank[:]``)."""
    tally = [0] * len(FIELDS)
    tally[BLOCK_SIZE] = block_size
    tally[POOL_LIMIT] = pool_limit
    tally[LAST_STALL_STEP] = -1
    tally[PROGRESS_TOKENS] = -1
    tally[TURN_GAP_NS] = -1
    return tally


_SMALLEST, _LARGEST = -(1 << 63), (1 << 63) - 1


def packed_clamped(tally: Tally) -> bytes:
    """The tally's bytes, each count held within 64 bits (``PACKED.pack`` failed on one: a
    sum past 9.2e18, or a count vLLM gave as a float), so that the record still goes out."""
    return PACKED.pack(*(min(max(int(count), _SMALLEST), _LARGEST) for count in tally))


def close_admission_period(tally: Tally, held: int) -> None:
    """An admission period ends (preempted, or released) holding ``held`` blocks:
    its prefix hits, its peak, and the new blocks among those it holds.

    With full attention a request's blocks only grow while it runs, so the
    blocks it holds when preempted or released are its most in that period.
    """
    hit_blocks = count_period_hits(tally)
    tally[ALLOCATED] += max(held - hit_blocks, 0)
    if held > tally[PEAK]:
        tally[PEAK] = held
    tally[PERIOD_HIT_TOKENS] = tally[PERIOD_HIT_BLOCKS] = 0


def hold(tally: Tally, now_ns: int, tokens: int, blocks: int) -> None:
    """The request, at ``tokens`` computed tokens, holds ``blocks`` from ``now_ns`` on (0 when
    preempted or released): the stretch since the last change joins its occupancy."""
    if tally[STRETCH_START_NS]:
        tally[OCCUPANCY_BLOCK_NS] += stretch_block_ns(tally, now_ns, tokens)
    tally[STRETCH_START_NS] = now_ns if blocks else 0
    tally[STRETCH_START_BLOCKS] = blocks
    tally[STRETCH_START_TOKENS] = tokens


def stretch_block_ns(tally: Sequence[int], now_ns: int, tokens: int) -> int:
    """Block-nanoseconds of the running stretch, up to ``now_ns`` and ``tokens`` computed.

    A running request's blocks follow its tokens: one more each time its computed tokens
    cross a multiple of ``block_size`` (vLLM allocates for the tokens a step schedules).
    The steps from the stretch's start to now computed one token each (decode), at an
    even pace: each step held the blocks its tokens needed, counted from the blocks held
    at the start. Exact but for the pace; a whole stretch costs a few integer operations.
    Against vLLM's block lists read at every step: ``tests/test_attribution.py``.
    """
    start_ns = tally[STRETCH_START_NS]
    if now_ns <= start_ns:
        return 0
    start_tokens = tally[STRETCH_START_TOKENS]
    steps = tokens - start_tokens + 1  # the steps' computed tokens: start_tokens ... tokens
    if steps <= 1:
        return tally[STRETCH_START_BLOCKS] * (now_ns - start_ns)
    size = tally[BLOCK_SIZE]
    more_blocks = _blocks_summed(tokens, size) - _blocks_summed(start_tokens - 1, size) - steps * -(-start_tokens // size)
    return (tally[STRETCH_START_BLOCKS] * steps + more_blocks) * (now_ns - start_ns) // steps


def _blocks_summed(tokens: int, size: int) -> int:
    """The blocks ``n`` tokens fill (``ceil(n / size)``), summed over ``n = 1 ... tokens``."""
    if tokens <= 0:
        return 0
    full, rest = divmod(tokens, size)
    return size * full * (full + 1) // 2 + rest * (full + 1)


def released_occupancy(tally: Sequence[int]) -> int:
    """A released request's block-nanoseconds, its last stretch closed at its release
    (``RELEASED_NS``, ``RELEASED_TOKENS``). Read off the engine thread, which hands the
    tally on unchanged: by the exporter, for the span, and at a collection, for the
    series' count (``attribution.py``)."""
    closed = tally[OCCUPANCY_BLOCK_NS]
    if tally[STRETCH_START_NS]:
        return closed + stretch_block_ns(tally, tally[RELEASED_NS], tally[RELEASED_TOKENS])
    return closed


def occupancy_until(tally: Sequence[int], now_ns: int, tokens: int) -> int:
    """Block-nanoseconds held up to ``now_ns``, at ``tokens`` computed tokens then (read on
    the metric reader's thread: changes nothing)."""
    closed = tally[OCCUPANCY_BLOCK_NS]
    return closed + stretch_block_ns(tally, now_ns, tokens) if tally[STRETCH_START_NS] else closed


def count_period_hits(tally: Tally) -> int:
    """The period's prefix hits join the request's; returns them in blocks (as many as
    the hit gave it, across its KV cache groups: ``EngineTelemetry._admitted``). Also for
    a later admission in the same period (a streaming session's next chunk): the
    earlier one's hits count then, the new one's when the period closes."""
    hit_blocks = tally[PERIOD_HIT_BLOCKS]
    tally[CACHE_READ_TOKENS] += tally[PERIOD_HIT_TOKENS]
    tally[PREFIX_HIT_BLOCKS] += hit_blocks
    return hit_blocks
