"""The engine's end of the pipe to its span helper (``helper.py``), in the EngineCore process.

``HelperPipe`` holds each finished request (``record.RequestEnded``'s fields) and each
``Finding`` as the engine hands it over. Taking a record is one ``list.extend`` on
the engine thread: the fields are kept one after another in one list, not as a tuple
each, so that a second's worth of records adds no objects for the garbage collector
to count. Every ``FLUSH_SECONDS`` the engine puts the lists it filled in the pipe's
thread's queue, takes fresh ones, and wakes the thread (``flush_if_due``); it never
waits for the thread's lock. An engine that goes idle hands over at once, on its own
thread: it has nothing else to do then.

The pipe's thread (``_look_after_the_pipe``) encodes each hand-over as a frame
(``wire_format.frame``), writes what the pipe takes, retries the rest
``RETRY_SECONDS`` later, reads the helper's acknowledgements and replaces a helper
that died (``helper_process.py``). It holds the interpreter's lock while each
``marshal`` runs, as any Python thread would (``docs/overhead.md#hand-over``). While an idle
engine's records are unacknowledged, or the helper holds spans for a collector that
takes nothing, it reads the acknowledgements every ``IDLE_SECONDS``, so that failed
exports are counted without a step; it sleeps on an event otherwise.

With the records go the prefix events the helper finds each request's miss reasons
from (``miss_reasons.MissesForTheHelper``): two ``list.extend`` an event on the engine
thread. Past ``MOST_BUFFERED_FOR_PREFIX_EVENTS`` unwritten, the prefix events are
dropped first, so that records keep flowing.

Nothing is ever waited for, and nothing is lost without being counted in
``otel_kvcache.telemetry.dropped``, by stage:

- ``pipe``: the helper fell more than ``MAX_BUFFERED_BYTES`` behind; a new frame's
  records are dropped;
- ``helper_died``: records written to a helper that then died before it acknowledged
  them, and those a dead helper that is not replaced would get. A helper killed
  between sending a batch and saying so has those counted too: the counter may count
  a batch that arrived, never miss one that did not;
- ``export``: spans the helper's exporter refused or failed to send, as the helper
  acknowledged them.

A helper that dies (its pipes close) is noticed at the next hand-over, at most
``FLUSH_SECONDS`` later while the engine steps (``IDLE_SECONDS`` while it is idle), and
replaced, unless too many died lately: then the engine starts no more, says so once,
and counts what it would have sent.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
from typing import Any

from otel_kvcache import names
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.export.helper_process import DEATHS_WINDOW_SECONDS, Deaths, HelperProcess, helper_environment
from otel_kvcache.export.wire_format import frame, records_in
from otel_kvcache.handover.miss_reasons import MissesForTheHelper, PrefixEvents
from otel_kvcache.handover.record import Finding
from otel_kvcache.vllm_compat.layouts import PrefixLayout

_logger = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0
"""Well inside the SDK's own batching (the batch span processor exports every 5 s); each
write wakes the helper."""
RETRY_SECONDS = 0.05
IDLE_SECONDS = 0.5
"""While the engine is idle with records outstanding: how often the pipe is looked after."""
MAX_BUFFERED_BYTES = 8 << 20
MOST_BUFFERED_FOR_PREFIX_EVENTS = 2 << 20
"""Past this many bytes not yet written, a hand-over's prefix events are dropped (an error
counted) and its records still go: a block hash costs 37 bytes, a record a few hundred,
so the events would fill the 8 MB long before the records do. The helper's history then
misses them, and the misses there lean cold."""
CLOSE_SECONDS = 5.0
"""At the engine's exit, the most time spent handing the helper what is left."""
HOOK = "exporter_process"
"""The name our errors in the pipe are counted under."""


class TelemetryLost(RuntimeError):
    """Records lost between the engine and the helper (counted by stage)."""


class _Frame:
    """A frame not yet wholly written to the helper: its bytes left and its records."""

    __slots__ = ("unwritten", "records", "started")

    def __init__(self, size: int, records: int) -> None:
        self.unwritten = size
        self.records = records
        self.started = False
        """Written in part: a helper that dies now has half of it, the next would get garbage."""


class HelperPipe:
    """The engine's end of the pipe to its helper process (a ``record.RecordSink``)."""

    def __init__(self, handed_down: dict[str, Any], errors: InstrumentationErrors, dropped: Any) -> None:
        self.errors = errors
        self._dropped_counter = dropped
        self._environment = helper_environment(handed_down)
        self._pending: list = []
        """Finished requests' ``RequestEnded`` fields, one after another (flat)."""
        self.request_ended = self._pending.extend
        """Takes a finished request's ``RequestEnded`` fields until the next hand-over: one C
        call on the engine's hot path; bound anew to each fresh list (``queue_pending``)."""
        self._findings: list[tuple] = []
        self._misses = MissesForTheHelper([])
        self._pool_blocks = 0
        self._layout = PrefixLayout(unit=1)
        self._queued: collections.deque[tuple[list, list, list]] = collections.deque()
        """What the engine thread handed over, as lists it no longer touches: records' fields,
        findings, prefix events. For the pipe's thread to encode."""
        self._outgoing = bytearray()  # frames, not yet all written
        self._frames: collections.deque[_Frame] = collections.deque()
        self._deaths = Deaths()
        self._gave_up = False
        self.due = time.monotonic() + FLUSH_SECONDS
        self.dropped = 0
        """Records lost so far, all stages together."""
        self._lock = threading.Lock()
        """Held by whoever looks after the pipe: the pipe's thread, or an engine going idle."""
        self._wake = threading.Event()
        """Wakes the pipe's thread: something to hand over, the engine idle, the exit."""
        self._engine_idle = False
        self._closed = False
        self._start_helper()
        threading.Thread(target=self._look_after_the_pipe, name="otel-kvcache-pipe", daemon=True).start()
        atexit.register(self.close)

    # --- the helper ---------------------------------------------------------------

    def _start_helper(self) -> None:
        self._helper = HelperProcess(self._environment)
        self._sent = 0  # records in frames wholly written to this helper
        self._failed_counted = 0  # of the spans it acknowledged as failed

    @property
    def helper_pid(self) -> int | None:
        """The helper's process id, once it has said it (its first acknowledgement)."""
        return self._helper.pid

    @property
    def unwritten(self) -> int:
        """Bytes handed over that the pipe has not taken yet."""
        return len(self._outgoing)

    @property
    def in_flight(self) -> int:
        """Records written to the helper that it has not yet acknowledged as done."""
        return self._sent - self._helper.said.done

    def _take_acknowledgements(self) -> None:
        """Reads what the helper said, counting the spans it failed to export, and replaces
        it if it died."""
        if self._gave_up:
            return
        alive = self._helper.read_acknowledgements()
        self._count_failed()
        if not alive:
            self._helper_died()

    def _count_failed(self) -> None:
        failed = self._helper.said.failed
        if failed > self._failed_counted:
            self._drop(failed - self._failed_counted, names.STAGE_EXPORT)
            self._failed_counted = failed

    def _helper_died(self) -> None:
        """Counts what the dead helper took with it, and starts another (or gives up,
        unless too many died lately) for the frames not yet written."""
        self._helper.read_acknowledgements()  # its last words
        self._count_failed()
        lost = self.in_flight
        if self._frames and self._frames[0].started:
            partial = self._frames.popleft()
            del self._outgoing[: partial.unwritten]
            lost += partial.records
        if lost:
            self._drop(lost, names.STAGE_HELPER_DIED)
        self._helper.close()
        if not self._deaths.one_more():
            self._give_up(f"died {len(self._deaths)} times within {DEATHS_WINDOW_SECONDS:.0f} s")
            return
        _logger.warning("otel-kvcache: the span helper process died; starting a new one (%d records lost)", lost)
        try:
            self._start_helper()
        except OSError as exc:  # no process could be started (out of memory, of descriptors)
            self._give_up(f"died and could not be started again ({exc})")

    def _give_up(self, why: str) -> None:
        self._gave_up = True
        _logger.error(
            "otel-kvcache: the span helper process %s; this engine starts no more, and counts its "
            "requests' spans as dropped (%s)",
            why,
            names.TELEMETRY_DROPPED,
        )
        unsent = sum(frame.records for frame in self._frames)
        if unsent:
            self._drop(unsent, names.STAGE_HELPER_DIED)
        self._frames.clear()
        self._outgoing.clear()

    # --- the hand-over -----------------------------------------------------------

    def miss_reasons(self, pool_blocks: int, layout: PrefixLayout) -> MissesForTheHelper:
        """Where the engine's requests' miss reasons are found: in the helper (its one
        engine's pool of ``pool_blocks`` sizes the history there)."""
        self._pool_blocks, self._layout = pool_blocks, layout
        self._misses.unit = layout.unit
        return self._misses

    def finding(self, finding: Finding) -> None:
        self._findings.append(tuple(finding))
        self.flush()

    def flush_if_due(self, now: float) -> None:
        """Every ``FLUSH_SECONDS`` while the engine steps (it calls when ``due``): what it
        handed over since, to the pipe's thread, which encodes and writes it."""
        if now >= self.due:
            self.due = now + FLUSH_SECONDS
            self._engine_idle = False
            self.queue_pending()
            if self._closed:  # the pipe's thread has ended: counted as lost
                self.flush()
            self._wake.set()

    def queue_pending(self) -> None:
        """The engine thread's share of a hand-over: the lists it filled go to the pipe's
        thread's queue, and fresh ones take their place, so that the engine thread alone
        writes to the lists it holds, and never waits for the pipe's lock."""
        pending, findings, misses = self._pending, self._findings, self._misses
        if pending or findings or misses.events:
            self._queued.append((pending, findings, misses.events))  # a deque: safe across threads
            self._pending, self._findings, misses.events = [], [], []
            self.request_ended = self._pending.extend

    def went_idle(self) -> None:
        """The engine has no request left: hands over what is pending now, and has the
        pipe's thread read the acknowledgements until nothing is outstanding."""
        self.flush()
        self._engine_idle = True
        if self.in_flight or self._helper.said.held:
            self._wake.set()

    def _look_after_the_pipe(self) -> None:
        """The pipe's thread: encodes and writes what the engine queued, reads the helper's
        acknowledgements, and replaces a helper that died."""
        while True:
            self._wake.wait(self._next_look())
            self._wake.clear()
            with self._lock:
                if self._closed:
                    return
                try:
                    self._take_acknowledgements()
                    self._hand_over_queued()
                    self._write_outgoing()
                except Exception as exc:  # noqa: BLE001 - ours: counted, and the thread goes on
                    self.errors.count(HOOK, exc)

    def _next_look(self) -> float | None:
        """Seconds until the pipe's thread looks again unwoken: soon while the pipe could not
        take everything; every ``IDLE_SECONDS`` while an idle engine's records are not
        acknowledged (their failed exports are counted then); else once woken."""
        if self._gave_up:
            return None
        if self._outgoing:
            return RETRY_SECONDS
        outstanding = self.in_flight or self._helper.said.held
        return IDLE_SECONDS if self._engine_idle and outstanding else None

    def flush(self) -> None:
        """Hands over, on the calling thread, whatever the engine handed over and the pipe's
        thread has not (an engine going idle, a finding, a test)."""
        with self._lock:
            self.queue_pending()
            if self._closed:  # records handed over after the exit's hand-over: never sent
                while self._queued:
                    pending, findings, _ = self._queued.popleft()
                    self._drop(records_in(pending, findings), names.STAGE_PIPE)
                return
            self._take_acknowledgements()
            self._hand_over_queued()
            self._write_outgoing()
        if self._outgoing:  # what the pipe could not take, the pipe's thread writes
            self._wake.set()

    def _write_outgoing(self) -> None:
        if self._outgoing and self._write_what_fits() < 0:
            self._helper_died()
            if not self._gave_up:
                self._write_what_fits()  # to the new helper

    def _hand_over_queued(self) -> None:
        """A frame for each hand-over queued, in turn (held: the lock)."""
        while self._queued:
            pending, findings, prefix_events = self._queued.popleft()
            # Prefix events are no records: lost with a frame's, the helper's history misses
            # them (its next misses lean cold), and no span does.
            if self._gave_up:
                self._drop(records_in(pending, findings), names.STAGE_HELPER_DIED)
            elif len(self._outgoing) > MAX_BUFFERED_BYTES:  # the helper is that far behind
                self._drop(records_in(pending, findings), names.STAGE_PIPE)
            else:
                if prefix_events and len(self._outgoing) > MOST_BUFFERED_FOR_PREFIX_EVENTS:
                    lost = TelemetryLost(f"{len(prefix_events)} entries of prefix events lost at {names.STAGE_PIPE}")
                    self.errors.count(HOOK, lost)
                    prefix_events = []
                events = PrefixEvents(self._pool_blocks, tuple(self._layout), prefix_events) if prefix_events else None
                encoded = frame(pending, findings, events)
                if encoded.prefix_events_error is not None:
                    self.errors.count(HOOK, encoded.prefix_events_error)
                if encoded.unwritable:
                    self._drop(encoded.unwritable, names.STAGE_PIPE)
                self._outgoing += encoded.data
                self._frames.append(_Frame(len(encoded.data), encoded.records))

    def _write_what_fits(self) -> int:
        """Bytes of ``_outgoing`` the pipe took, until it is full; -1 if the helper is gone."""
        with memoryview(self._outgoing) as outgoing:
            written = self._helper.write(outgoing)
        if written > 0:
            del self._outgoing[:written]
            self._note_written(written)
        return written

    def _note_written(self, written: int) -> None:
        frames = self._frames
        while frames and written >= frames[0].unwritten:
            written -= frames[0].unwritten
            self._sent += frames.popleft().records
        if frames and written:
            frames[0].unwritten -= written
            frames[0].started = True

    def _drop(self, count: int, stage: str) -> None:
        self.dropped += count
        try:
            self._dropped_counter.add(count, {names.STAGE: stage})
        except Exception:  # noqa: BLE001 - a broken SDK must not reach vLLM
            pass
        self.errors.count(HOOK, TelemetryLost(f"{count} records lost at {stage}; {self.dropped} so far"), count)

    def close(self, wait: float = 0.0) -> bool:
        """At exit: hand the helper everything pending within ``CLOSE_SECONDS``, then close
        its stdin (it exports and exits on its own); ``wait`` seconds more for it to exit,
        reading its acknowledgements. Not waiting, the engine reads no more of them: the
        helper counts what it fails to export from then on. Whether it exited (False if
        not waited for)."""
        with self._lock:
            self._closed = True
            self._wake.set()  # the pipe's thread ends
            self.queue_pending()
            if not self._helper.stdin_open or self._gave_up:
                return False
            self._take_acknowledgements()
            self._hand_over_queued()
            self._write_outgoing()
            deadline = time.monotonic() + CLOSE_SECONDS
            while self._outgoing and time.monotonic() < deadline:
                self._helper.wait_writable(deadline - time.monotonic())
                if self._write_what_fits() < 0:
                    break
            if self._outgoing:
                self._drop(sum(frame.records for frame in self._frames), names.STAGE_PIPE)
            self._helper.close_stdin()
        if wait:
            return self.wait_for_helper(wait)
        self._helper.read_acknowledgements()
        self._count_failed()
        self._helper.stop_reading()
        return False

    def wait_for_helper(self, timeout: float) -> bool:
        """Whether the helper exited (its stdout closed) within ``timeout`` seconds, its
        acknowledgements read meanwhile."""
        exited = self._helper.wait_for_exit(timeout)
        self._count_failed()
        return exited
