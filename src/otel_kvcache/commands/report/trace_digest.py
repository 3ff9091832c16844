"""What the traces file says about requests, folded in one pass.

Every ``vllm.kv_cache.request`` span counts in the totals and the
distributions (kept as counts of values, bounded by the values a request can
take); only a sample of them keeps its events for the timeline (``sample.py``).
Preemptions and leak findings are marked on the time axis from their events'
timestamps, in bounded time buckets (``buckets.py``). The pool readings that
every KV event carries (used and free blocks at that moment) give the pool's
used line between the gauge's once-a-second readings.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry.proto.trace.v1.trace_pb2 import Span

from otel_kvcache import names
from otel_kvcache.commands.otlp_json import LineCount, attributes, spans
from otel_kvcache.commands.report.buckets import TimeBuckets, TimeRange
from otel_kvcache.commands.report.sample import RowSample

FINDINGS = (names.EVENT_LEAK, names.EVENT_ZOMBIE)
"""The events the leak gate names a request by (``gate.named_leaks``)."""

GAP_BOUNDS = (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
"""Seconds: the session-gap histogram's buckets (``vllm.kv_cache.session.turn_gap``'s)."""

MARK_PREEMPTION = "preemptions"
MARK_LEAK = "leak findings"


@dataclass
class Event:
    name: str
    time: int
    blocks: int | None
    prefix_hit_tokens: int | None


@dataclass
class RequestRow:
    """One request's span, as the timeline draws it."""

    request_id: str
    trace_id: str
    start: int
    end: int
    finish: str
    input_tokens: int
    cached_tokens: int
    peak_blocks: int
    preemptions: int
    stalls: int
    events: list[Event]
    turn_gap: float | None = None
    """For a returning session's request, seconds since its previous turn's release."""
    prefix_kept: bool = True
    """No prompt token missed the prefix cache because it had been evicted."""


def _used_at_latest(a: tuple, b: tuple) -> tuple:
    """Of two (time, used, free) readings in one bucket, the fuller pool (the later on a tie)."""
    return max(a, b, key=lambda reading: (reading[1], reading[0]))


@dataclass
class TraceDigest:
    lines: LineCount = field(default_factory=LineCount)
    requests: int = 0
    preempted_requests: int = 0
    preemptions_on_spans: int = 0
    stalls_on_spans: int = 0
    leak_findings: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    peak_blocks: Counter = field(default_factory=Counter)
    hit_ratio_percent: Counter = field(default_factory=Counter)
    """Per request, min(prefix-hit tokens / prompt tokens, 1), floored to a percent
    (the ratio ``vllm.kv_cache.request.prefix_hit_ratio`` records)."""
    preemptions: Counter = field(default_factory=Counter)
    marks: dict[str, TimeBuckets[int]] = field(default_factory=dict)
    used_at_events: dict[object, TimeBuckets[tuple]] = field(default_factory=dict)
    """Engine -> (time, used, free blocks) that each KV event saw."""
    turn_gaps: Counter = field(default_factory=Counter)
    """(gap bucket's upper bound in seconds, prefix kept) -> returning session requests."""
    sample: RowSample[RequestRow] = field(default_factory=RowSample)
    times: TimeRange = field(default_factory=TimeRange)

    def mark(self, kind: str, time_ns: int) -> None:
        self.marks.setdefault(kind, TimeBuckets(lambda a, b: a + b)).add(time_ns, 1)

    def add_request(self, span: Span, engine) -> None:
        row = request_row(span)
        self._count(row)
        if row.turn_gap is not None:
            bound = next((b for b in GAP_BOUNDS if row.turn_gap <= b), math.inf)
            self.turn_gaps[(bound, row.prefix_kept)] += 1
        self._fold_events(span, engine)
        leaked = any(e.name in FINDINGS for e in row.events)
        self.sample.offer(row, interesting=row.preemptions > 0 or leaked)

    def _count(self, row: RequestRow) -> None:
        """The totals and distributions, over every request."""
        self.requests += 1
        self.finish_reasons[row.finish] += 1
        self.peak_blocks[row.peak_blocks] += 1
        self.preemptions[row.preemptions] += 1
        self.preempted_requests += row.preemptions > 0
        self.preemptions_on_spans += row.preemptions
        self.stalls_on_spans += row.stalls
        if row.input_tokens:
            self.hit_ratio_percent[min(row.cached_tokens, row.input_tokens) * 100 // row.input_tokens] += 1
        self.times.saw(row.start)
        self.times.saw(row.end)

    def _fold_events(self, span: Span, engine) -> None:
        """Marks and pool readings from any span's events (a finding span has them too)."""
        for event in span.events:
            name, time_ns = event.name, event.time_unix_nano
            self.times.saw(time_ns)
            if name == names.EVENT_PREEMPTED:
                self.mark(MARK_PREEMPTION, time_ns)
            elif name in FINDINGS:
                self.leak_findings += 1
                self.mark(MARK_LEAK, time_ns)
            a = attributes(event.attributes)
            used, free = a.get(names.POOL_USED_BLOCKS), a.get(names.POOL_FREE_BLOCKS)
            if used is not None and free is not None:
                series = self.used_at_events.setdefault(engine, TimeBuckets(_used_at_latest))
                series.add(time_ns, (time_ns, int(used), int(free)))

    def add_finding(self, span: Span, engine) -> None:
        self._fold_events(span, engine)


def request_row(span: Span) -> RequestRow:
    a = attributes(span.attributes)
    return RequestRow(
        request_id=str(a.get(names.REQUEST_ID, "?")),
        trace_id=span.trace_id.hex(),
        start=span.start_time_unix_nano,
        end=span.end_time_unix_nano,
        finish=str(a.get(names.FINISH_REASON, "unknown")),
        input_tokens=int(a.get(names.INPUT_TOKENS) or 0),
        cached_tokens=int(a.get(names.CACHE_READ_INPUT_TOKENS) or 0),
        peak_blocks=int(a.get(names.BLOCKS_PEAK) or 0),
        preemptions=int(a.get(names.PREEMPTIONS) or 0),
        stalls=int(a.get(names.ALLOCATION_STALLS) or 0),
        events=sorted((_event(e) for e in span.events), key=lambda e: e.time),
        turn_gap=None if a.get(names.SESSION_TURN_GAP) is None else float(a[names.SESSION_TURN_GAP]),
        prefix_kept=not a.get(names.PREFIX_EVICTED_TOKENS),
    )


def _event(event: Span.Event) -> Event:
    a = attributes(event.attributes)
    blocks, hit = a.get(names.BLOCKS), a.get(names.EVENT_PREFIX_HIT_TOKENS)
    return Event(
        name=event.name,
        time=event.time_unix_nano,
        blocks=None if blocks is None else int(blocks),
        prefix_hit_tokens=None if hit is None else int(hit),
    )


def read_traces(path: Path) -> TraceDigest:
    digest = TraceDigest()
    for resource, _scope, span in spans(path, digest.lines):
        name = span.name
        if name == names.KV_REQUEST_SPAN:
            digest.add_request(span, resource.get(names.ENGINE_INDEX, 0))
        elif name == names.FINDING_SPAN:
            digest.add_finding(span, resource.get(names.ENGINE_INDEX, 0))
    return digest
