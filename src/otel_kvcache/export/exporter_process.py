"""The engine's side of the helper process that builds its spans (``helper.py``).

``ExporterProcess`` lives in the EngineCore process: it holds each finished
request (``RequestEnded`` fields) and each ``Finding`` as the engine hands it
over, and every ``FLUSH_SECONDS`` marshals what it holds, in one C loop, into
one frame for the helper's stdin. Taking a record is one ``list.extend`` on the
engine thread (marshalling each at release ran ``marshal``'s code cold, 4-5 us
of a release). The fields are kept one after another in one list, not as a
tuple each, so that a second's worth of records adds no objects for the garbage
collector to count (``benchmarks/RESULTS.md`` has the numbers).

The marshal and the writes are the pipe's thread's (``_look_after_the_pipe``),
not the engine thread's: every ``FLUSH_SECONDS`` the engine puts the lists it
filled in the thread's queue, takes fresh ones, and wakes the thread
(``flush_if_due``), and it never waits for the thread's lock. On the engine
thread, that marshal had cost churn about 14 k instructions a finished request,
a sixth of all otel-kvcache did there (``benchmarks/RESULTS.md``). The thread takes
the interpreter's lock for as long as each ``marshal`` runs (about a millisecond
for a second of 200 requests), as any Python thread would: on a GPU engine that
should mostly fall in the engine thread's own waits for the device, which let it go
(not measured: this project's machines have no GPU).
An engine that goes idle hands over at once, on its own thread: it has nothing
else to do then, and what it finished is exported without waiting a second.

The pipe is non-blocking and as large as Linux lets it be made
(``PIPE_BYTES``); what it cannot take at once the pipe's thread writes again
``RETRY_SECONDS`` later. Nothing is ever waited for, and nothing is lost
without being counted in ``otel_kvcache.telemetry.dropped``, by stage:

- ``pipe``: the helper fell more than ``MAX_BUFFERED_BYTES`` behind; a new
  frame's records are dropped;
- ``helper_died``: records written to a helper that then died before it
  acknowledged them (it writes ``pid done failed held`` lines back on its stdout
  after each batch of frames), and those a dead helper that is not replaced would get.
  A helper killed between sending a batch and saying so has those counted too:
  the counter may count a batch that arrived, never miss one that did not;
- ``export``: spans the helper's exporter refused or failed to send, as the
  helper acknowledged them.

With the records go the prefix events the helper finds each request's miss
reasons from (``miss_reasons.py``): each free's block hashes and each missed
lookup's keys, flat in one list in the order vLLM made them, marshalled ahead of
the frame's records (``_HandedOverMisses``). On the engine thread that is two
``list.extend`` an event; their ``marshal``, about 170 instructions a hash, is
the pipe's thread's, where hashing a freed block and adding it to a set on the
engine thread had cost about 490 (``benchmarks/RESULTS.md``): about 17 M
instructions, a few milliseconds, for a second of 100,000 hashes. Past
``MOST_BUFFERED_FOR_PREFIX_EVENTS`` unwritten, the prefix events are dropped
first, so that records keep flowing.

An engine that goes idle takes no steps, so the pipe's thread also looks after
the pipe in its stead (``went_idle``): every ``IDLE_SECONDS`` while records are
unacknowledged, or the helper holds spans for a collector that takes nothing,
it reads the helper's acknowledgements (counting the spans it
failed to export). It sleeps on an event otherwise.

A helper that dies (its pipes close) is noticed at the next hand-over, at most
``FLUSH_SECONDS`` later while the engine steps (``IDLE_SECONDS`` while it is
idle), and replaced; after
``MAX_DEATHS`` deaths within ``DEATHS_WINDOW_SECONDS`` the engine stops
starting helpers, says so once, and counts what it would have sent.

The helper is started through a tiny launcher that forks it and exits at
once: the helper is no child of the EngineCore, in a session of its own, so
vLLM's shutdown, which SIGKILLs the EngineCore's process tree, leaves it to
export what it was handed (``helper.py``).
"""

from __future__ import annotations

import atexit
import collections
import fcntl
import io
import json
import logging
import marshal
import os
import select
import struct
import subprocess
import sys
import threading
import time
from itertools import count as serial_numbers, repeat
from typing import Any, Iterator, NamedTuple

from otel_kvcache import names
from otel_kvcache.engine.tally import COLD_TOKENS, LOOKUP_SERIAL, Tally
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.export.drain import shared_lock
from otel_kvcache.export.spans import Finding, RequestEnded
from otel_kvcache.vllm_compat.layouts import PrefixLayout
from otel_kvcache.wiring.resource import PROCESS_ENVIRONMENT_VARIABLE

_logger = logging.getLogger(__name__)

# Well inside the SDK's own batching (the batch span processor exports every 5 s);
# each write wakes the helper, tens of microseconds of the engine thread.
FLUSH_SECONDS = 1.0
# A second of a busy engine's records is a few hundred kB; the default pipe holds 64 kB.
PIPE_BYTES = 1 << 20
RETRY_SECONDS = 0.05
IDLE_SECONDS = 0.5
"""While the engine is idle with records outstanding: how often the pipe is looked after."""
MAX_BUFFERED_BYTES = 8 << 20
MOST_BUFFERED_FOR_PREFIX_EVENTS = 2 << 20
"""Past this many bytes not yet written, a hand-over's prefix events are dropped (an error
counted) and its records still go: a block hash costs 37 bytes, a record a few hundred,
so the events would fill the 8 MB long before the records do. The helper's history then
misses them, and the misses there lean cold."""
MAX_DEATHS = 3
DEATHS_WINDOW_SECONDS = 60.0
CLOSE_SECONDS = 5.0
"""At the engine's exit, the most time spent handing the helper what is left."""
# Version 2 writes no back-references, so it builds no hash table per call: half
# the time of the default (measured a record at a time: 1.9 against 4.1 us).
MARSHAL_VERSION = 2
# A frame: its length, then marshalled: the prefix events as a dict (``PrefixEvents``'s
# fields), finished requests' ``RequestEnded`` fields, one after another in a list, then
# each ``Finding``'s as a tuple.
_FRAME_HEADER = struct.Struct("<I")
_FIELDS = len(RequestEnded._fields)
HOOK = "exporter_process"
"""The name our errors in the channel are counted under."""

# Runs with ``-I -S`` (no site, no sitecustomize: a few milliseconds): forks the helper,
# which the exec gives the whole environment back, and exits, so that the helper is
# reparented away from the EngineCore's process tree.
_LAUNCHER = """\
import os, sys
if os.fork() == 0:
    os.execv(sys.executable, [sys.executable, "-m", "otel_kvcache.export.helper", *sys.argv[1:]])
os._exit(0)
"""


FREED, MISSED, ENTRIES = -1, -2, -3
"""The kinds of the prefix events: ``FREED, count, *hashes`` (a request gave back its
blocks, whose units' hashes these are), ``MISSED, lookup serial, present, count, *keys``
(a lookup's units that missed, the first ``present`` of them with their attention blocks
in the cache) and ``ENTRIES, count, *keys`` (a hybrid model's checked groups' entries
that reached the free queue: ``layouts.PrefixLayout``)."""


class PrefixEvents(NamedTuple):
    """A frame's prefix events, as the helper reads them (``miss_reasons.py``)."""

    pool_blocks: int
    layout: tuple
    """The engine's ``PrefixLayout``'s fields."""
    events: list


class _HandedOverMisses:
    """``whatif.MissReasons``'s two calls, handed over to the helper, which keeps the history
    and finds each request's reasons (``miss_reasons.py``). A request's missed lookups are
    known there by its lookup serial, which its tally carries."""

    __slots__ = ("events", "_serials", "unit")

    def __init__(self, events: list) -> None:
        self.unit = 1
        """Tokens per prefix hash (``PrefixLayout.unit``), set with the engine's layout."""
        self.events = events
        """The prefix events since the last hand-over (``ExporterProcess`` takes the list)."""
        self._serials = serial_numbers(1)

    def freed(self, hashes: list) -> None:
        """A request gave back its blocks, whose units' hashes these are (perhaps vLLM's own
        list: copied now, as it grows again when a preempted request resumes)."""
        events = self.events
        events.extend((FREED, len(hashes)))
        events.extend(hashes)

    def entries_freed(self, keys: list) -> None:
        """vLLM gave back blocks holding these entries of a hybrid model's checked groups."""
        events = self.events
        events.extend((ENTRIES, len(keys)))
        events.extend(keys)

    def missed(self, tally: Tally, keys: list, present: int) -> None:
        """These looked-up units of the request missed: cold, until the helper finds
        which of them it remembers (a helper that never saw the lookup leaves them so)."""
        tally[COLD_TOKENS] += self.unit * len(keys)
        serial = tally[LOOKUP_SERIAL]
        if not serial:
            serial = tally[LOOKUP_SERIAL] = next(self._serials)
        events = self.events
        events.extend((MISSED, serial, present, len(keys)))
        events.extend(keys)


class TelemetryLost(RuntimeError):
    """Records lost between the engine and the exporter (counted by stage)."""


class _Frame:
    """A frame not yet wholly written to the helper: its bytes left and its records."""

    __slots__ = ("unwritten", "records", "started")

    def __init__(self, size: int, records: int) -> None:
        self.unwritten = size
        self.records = records
        self.started = False
        """Written in part: a helper that dies now has half of it, the next would get garbage."""


class ExporterProcess:
    """The engine's side of the pipe to its helper process."""

    def __init__(self, handed_down: dict[str, Any], errors: InstrumentationErrors, dropped: Any) -> None:
        self.errors = errors
        self._dropped_counter = dropped
        self._environment = dict(os.environ)
        self._environment[PROCESS_ENVIRONMENT_VARIABLE] = json.dumps(handed_down)
        # The helper runs our exporter only: it must not instrument itself.
        disabled = self._environment.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
        self._environment["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = ",".join(
            filter(None, [disabled, "vllm_kvcache", "vllm_gpu"])
        )
        self._pending: list = []
        """Finished requests' ``RequestEnded`` fields, one after another (flat)."""
        self.request_ended = self._pending.extend
        """Takes a finished request's ``RequestEnded`` fields until the next hand-over:
        one C call on the engine's hot path (see the module's docstring); bound anew
        to each fresh list (``queue_pending``)."""
        self._findings: list[tuple] = []
        self._misses = _HandedOverMisses([])
        self._pool_blocks = 0
        self._layout = PrefixLayout(unit=1)
        self._queued: collections.deque[tuple[list, list, list]] = collections.deque()
        """What the engine thread handed over, as lists it no longer touches: records' fields,
        findings, prefix events. For the pipe's thread to marshal."""
        self._outgoing = bytearray()  # frames, not yet all written
        self._frames: collections.deque[_Frame] = collections.deque()
        self._deaths: list[float] = []
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
        lock = shared_lock()  # vLLM's first process waits, at its exit, while the helper holds it
        try:
            self._launcher = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=self._environment,
                close_fds=True,
                pass_fds=() if lock is None else (lock,),
                start_new_session=True,  # not in the engine's process group: a Ctrl-C is not for it
            )
        finally:
            if lock is not None:
                os.close(lock)  # the helper's copy keeps the lock
        self._fd = self._launcher.stdin.fileno()
        self._acks_fd = self._launcher.stdout.fileno()
        os.set_blocking(self._fd, False)
        os.set_blocking(self._acks_fd, False)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (AttributeError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size
            pass
        self._acks = b""
        self.helper_pid: int | None = None
        """The helper's process id, once it has said it (its first acknowledgement)."""
        self._sent = 0  # records in frames wholly written to this helper
        self._done = 0  # records it acknowledged: exported, or counted as failed
        self._failed = 0  # spans its exporter failed to send, as acknowledged
        self._failed_counted = 0
        self._helper_holds = 0  # spans it holds now, for a collector that takes nothing

    def _read_acknowledgements(self) -> bool:
        """Takes what the helper said; False once its stdout closed (it exited)."""
        alive = True
        try:
            while chunk := os.read(self._acks_fd, 4096):
                self._acks += chunk
            alive = False  # end of file
        except BlockingIOError:
            pass
        *lines, self._acks = self._acks.split(b"\n")
        if lines:
            self.helper_pid, self._done, self._failed, self._helper_holds = map(int, lines[-1].split())
            if self._failed > self._failed_counted:
                self._drop(self._failed - self._failed_counted, names.STAGE_EXPORT)
                self._failed_counted = self._failed
        if self._launcher.returncode is None:
            self._launcher.poll()  # reaps the launcher, which exits once it has forked
        return alive

    @property
    def unwritten(self) -> int:
        """Bytes handed over that the pipe has not taken yet."""
        return len(self._outgoing)

    @property
    def in_flight(self) -> int:
        """Records written to the helper that it has not yet acknowledged as done."""
        return self._sent - self._done

    def _helper_died(self) -> None:
        """Counts what the dead helper took with it, reaps the launcher, starts a new
        helper (unless too many died lately) for the frames not yet written."""
        self._read_acknowledgements()  # its last words
        lost = self._sent - self._done
        if self._frames and self._frames[0].started:
            partial = self._frames.popleft()
            del self._outgoing[: partial.unwritten]
            lost += partial.records
        if lost:
            self._drop(lost, names.STAGE_HELPER_DIED)
        for stream in (self._launcher.stdin, self._launcher.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self._launcher.wait()  # the launcher exits at once: the helper is not our child
        now = time.monotonic()
        self._deaths = [t for t in self._deaths if now - t < DEATHS_WINDOW_SECONDS] + [now]
        if len(self._deaths) >= MAX_DEATHS:
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

    def miss_reasons(self, pool_blocks: int, layout: PrefixLayout) -> _HandedOverMisses:
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
        handed over since, to the pipe's thread, which marshals and writes it."""
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
        if self.in_flight or self._helper_holds:
            self._wake.set()

    def _look_after_the_pipe(self) -> None:
        """The pipe's thread: marshals and writes what the engine queued, reads the
        helper's acknowledgements, and replaces a helper that died."""
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
        return IDLE_SECONDS if self._engine_idle and (self.in_flight or self._helper_holds) else None

    def flush(self) -> None:
        """Hands over, on the calling thread, whatever the engine handed over and the pipe's
        thread has not (an engine going idle, a finding, a test)."""
        with self._lock:
            self.queue_pending()
            if self._closed:  # records handed over after the exit's hand-over: never sent
                while self._queued:
                    pending, findings, _ = self._queued.popleft()
                    self._drop(_records(pending, findings), names.STAGE_PIPE)
                return
            self._take_acknowledgements()
            self._hand_over_queued()
            self._write_outgoing()
        if self._outgoing:  # what the pipe could not take, the pipe's thread writes
            self._wake.set()

    def _take_acknowledgements(self) -> None:
        """Reads what the helper said, replacing it if it died."""
        if not self._gave_up and not self._read_acknowledgements():
            self._helper_died()

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
                self._drop(_records(pending, findings), names.STAGE_HELPER_DIED)
            elif len(self._outgoing) > MAX_BUFFERED_BYTES:  # the helper is that far behind
                self._drop(_records(pending, findings), names.STAGE_PIPE)
            else:
                if prefix_events and len(self._outgoing) > MOST_BUFFERED_FOR_PREFIX_EVENTS:
                    lost = TelemetryLost(f"{len(prefix_events)} entries of prefix events lost at {names.STAGE_PIPE}")
                    self.errors.count(HOOK, lost)
                    prefix_events = []
                frame, count = self._marshalled(pending, findings, prefix_events)
                self._outgoing += _FRAME_HEADER.pack(len(frame))
                self._outgoing += frame
                self._frames.append(_Frame(_FRAME_HEADER.size + len(frame), count))

    def _marshalled(self, ended_fields: list, findings: list[tuple], prefix_events: list) -> tuple[bytes, int]:
        """A frame: the prefix events, then the finished requests' fields as one flat
        list, then the findings, each marshalled in one C call; and how many records it
        holds. A request with a value marshal cannot write is written again with its
        trace headers as plain strings, or else dropped (and counted), not the frame."""
        written = len(ended_fields) // _FIELDS
        frame = []
        if prefix_events:  # first: a request's lookups come before its release
            try:
                events = PrefixEvents(self._pool_blocks, tuple(self._layout), prefix_events)._asdict()
                frame.append(marshal.dumps(events, MARSHAL_VERSION))
            except ValueError as exc:  # a block hash marshal cannot write: a vLLM we do not know
                self.errors.count(HOOK, exc)
        try:
            if ended_fields:
                frame.append(marshal.dumps(ended_fields, MARSHAL_VERSION))
        except ValueError:  # e.g. a trace header in a str subclass
            for start in range(0, len(ended_fields), _FIELDS):
                try:
                    fields = _with_plain_headers(ended_fields[start : start + _FIELDS])
                    frame.append(marshal.dumps(fields, MARSHAL_VERSION))
                except ValueError:
                    self._drop(1, names.STAGE_PIPE)
                    written -= 1
        frame.extend(map(marshal.dumps, findings, repeat(MARSHAL_VERSION)))
        return b"".join(frame), written + len(findings)

    def _write_what_fits(self) -> int:
        """Bytes of ``_outgoing`` the pipe took, until it is full; -1 if the helper is gone."""
        written = 0
        with memoryview(self._outgoing) as pending:
            try:
                while written < len(pending):
                    written += os.write(self._fd, pending[written:])
            except BlockingIOError:
                pass
            except OSError:
                written = -1
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
            stdin = self._launcher.stdin
            if stdin is None or stdin.closed or self._gave_up:
                return False
            self._take_acknowledgements()
            self._hand_over_queued()
            self._write_outgoing()
            deadline = time.monotonic() + CLOSE_SECONDS
            while self._outgoing and time.monotonic() < deadline:
                select.select([], [self._fd], [], max(0.0, deadline - time.monotonic()))
                if self._write_what_fits() < 0:
                    break
            if self._outgoing:
                self._drop(sum(frame.records for frame in self._frames), names.STAGE_PIPE)
            try:
                stdin.close()
            except OSError:
                pass
            self._launcher.wait()
        if wait:
            return self.wait_for_helper(wait)
        self._read_acknowledgements()
        self._launcher.stdout.close()  # the helper's next acknowledgement finds the pipe broken
        return False

    def wait_for_helper(self, timeout: float) -> bool:
        """Whether the helper exited (its stdout closed) within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._read_acknowledgements():
                return True
            select.select([self._acks_fd], [], [], max(0.0, deadline - time.monotonic()))
        return False


def _records(ended_fields: list, findings: list) -> int:
    """How many records one hand-over holds: finished requests (their fields flat) and findings."""
    return len(ended_fields) // _FIELDS + len(findings)


def _with_plain_headers(fields: list) -> list:
    """A ``RequestEnded`` record's fields with its trace headers as a dict of plain strings."""
    if fields[1]:
        fields[1] = {str(name): str(value) for name, value in fields[1].items()}
    return fields


def read_batches(fd: int) -> Iterator[list[RequestEnded | Finding | PrefixEvents]]:
    """The records (``RequestEnded`` or ``Finding``), each frame's prefix events before them, of every whole frame the engine has written by now, a batch at a time,
    until the pipe closes (``helper.py``). An engine that goes idle after each request
    hands over a frame per request: read together, they make one export, not one each,
    so that a slow collector costs the helper one export's time per batch, not per request."""
    buffer = bytearray()
    open_ = True
    while open_:
        chunk = os.read(fd, PIPE_BYTES)  # waits for the engine
        open_ = bool(chunk)
        buffer += chunk
        while open_ and select.select([fd], [], [], 0)[0]:  # and whatever else is there already
            chunk = os.read(fd, PIPE_BYTES)
            open_ = bool(chunk)
            buffer += chunk
        records, taken = _whole_frames(buffer)
        del buffer[:taken]
        if records:
            yield records


def _whole_frames(buffer: bytearray) -> tuple[list, int]:
    """The records of the whole frames at the start of ``buffer``, and their bytes."""
    records, position = [], 0
    while len(buffer) - position >= _FRAME_HEADER.size:
        (length,) = _FRAME_HEADER.unpack_from(buffer, position)
        end = position + _FRAME_HEADER.size + length
        if end > len(buffer):
            break
        frame = io.BytesIO(buffer[position + _FRAME_HEADER.size : end])
        while frame.tell() < length:
            fields = marshal.load(frame)
            if type(fields) is list:  # finished requests' fields, one after another
                records.extend(
                    RequestEnded._make(fields[start : start + _FIELDS]) for start in range(0, len(fields), _FIELDS)
                )
            elif type(fields) is dict:  # the prefix events
                records.append(PrefixEvents(**fields))
            else:  # a finding's fields
                records.append(Finding._make(fields))
        position = end
    return records, position
