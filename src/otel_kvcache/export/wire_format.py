"""What travels between the engine's end of the pipe and the helper, byte for byte.

Engine to helper, on the helper's stdin: frames. A frame is its length
(``FRAME_HEADER``), then, each marshalled (``MARSHAL_VERSION``):

- the prefix events, as a dict of ``miss_reasons.PrefixEvents``' fields, first (a
  request's lookups come before its release);
- the finished requests' ``record.RequestEnded`` fields, one after another in one list;
- each ``record.Finding``'s fields, as a tuple.

The fields stay flat, one list a frame, so that a second's worth of records adds no
objects for the garbage collector to count, and is written in one C call.

Helper to engine, on the helper's stdout: ``pid done failed held`` lines
(``Acknowledgement``), each cumulative but ``held``.
"""

from __future__ import annotations

import io
import marshal
import os
import select
import struct
from collections.abc import Iterator
from itertools import repeat
from typing import NamedTuple

from otel_kvcache.handover.miss_reasons import PrefixEvents
from otel_kvcache.handover.record import Finding, RequestEnded

MARSHAL_VERSION = 2
"""Version 2 writes no back-references, so it builds no hash table per call."""
FRAME_HEADER = struct.Struct("<I")
RECORD_FIELDS = len(RequestEnded._fields)
READ_BYTES = 1 << 20


class Frame(NamedTuple):
    """A frame's bytes (its header included) and what went into them."""

    data: bytes
    records: int
    """Finished requests and findings it carries."""
    unwritable: int
    """Finished requests left out: a value ``marshal`` cannot write, even with plain headers."""
    prefix_events_error: ValueError | None
    """Why its prefix events were left out (a block hash ``marshal`` cannot write), if they were."""


def frame(ended_fields: list, findings: list[tuple], prefix_events: PrefixEvents | None) -> Frame:
    """One hand-over as a frame: the prefix events, then the finished requests' fields as one
    flat list, then the findings, each marshalled in one C call. A request with a value
    marshal cannot write is written again with its trace headers as plain strings, or else
    left out, not the frame."""
    written, unwritable, prefix_error = len(ended_fields) // RECORD_FIELDS, 0, None
    parts = [b""]  # the header, once the body's length is known
    if prefix_events is not None:
        try:
            parts.append(marshal.dumps(prefix_events._asdict(), MARSHAL_VERSION))
        except ValueError as exc:  # a block hash marshal cannot write: a vLLM we do not know
            prefix_error = exc
    try:
        if ended_fields:
            parts.append(marshal.dumps(ended_fields, MARSHAL_VERSION))
    except ValueError:  # e.g. a trace header in a str subclass
        for start in range(0, len(ended_fields), RECORD_FIELDS):
            try:
                fields = _with_plain_headers(ended_fields[start : start + RECORD_FIELDS])
                parts.append(marshal.dumps(fields, MARSHAL_VERSION))
            except ValueError:
                unwritable += 1
    parts.extend(map(marshal.dumps, findings, repeat(MARSHAL_VERSION)))
    parts[0] = FRAME_HEADER.pack(sum(map(len, parts)))
    return Frame(b"".join(parts), written - unwritable + len(findings), unwritable, prefix_error)


def records_in(ended_fields: list, findings: list) -> int:
    """How many records one hand-over holds: finished requests (their fields flat) and findings."""
    return len(ended_fields) // RECORD_FIELDS + len(findings)


def _with_plain_headers(fields: list) -> list:
    """A ``RequestEnded`` record's fields with its trace headers as a dict of plain strings."""
    if fields[1]:
        fields[1] = {str(name): str(value) for name, value in fields[1].items()}
    return fields


def read_batches(fd: int) -> Iterator[list[RequestEnded | Finding | PrefixEvents]]:
    """The records of every whole frame the engine has written by now (each frame's prefix
    events before them), a batch at a time, until the pipe closes. An engine that goes
    idle after each request hands over a frame per request: read together, they make one
    export, not one each, so that a slow collector costs the helper one export's time per
    batch, not per request."""
    buffer = bytearray()
    open_ = True
    while open_:
        chunk = os.read(fd, READ_BYTES)  # waits for the engine
        open_ = bool(chunk)
        buffer += chunk
        while open_ and select.select([fd], [], [], 0)[0]:  # and whatever else is there already
            chunk = os.read(fd, READ_BYTES)
            open_ = bool(chunk)
            buffer += chunk
        records, taken = whole_frames(buffer)
        del buffer[:taken]
        if records:
            yield records


def whole_frames(buffer: bytearray) -> tuple[list, int]:
    """The records of the whole frames at the start of ``buffer``, and their bytes."""
    records, position = [], 0
    while len(buffer) - position >= FRAME_HEADER.size:
        (length,) = FRAME_HEADER.unpack_from(buffer, position)
        end = position + FRAME_HEADER.size + length
        if end > len(buffer):
            break
        body = io.BytesIO(buffer[position + FRAME_HEADER.size : end])
        while body.tell() < length:
            fields = marshal.load(body)
            if type(fields) is list:  # finished requests' fields, one after another
                records.extend(
                    RequestEnded._make(fields[start : start + RECORD_FIELDS])
                    for start in range(0, len(fields), RECORD_FIELDS)
                )
            elif type(fields) is dict:  # the prefix events
                records.append(PrefixEvents(**fields))
            else:  # a finding's fields
                records.append(Finding._make(fields))
        position = end
    return records, position


class Acknowledgement(NamedTuple):
    """What the helper tells the engine after each batch (and when held spans settle)."""

    pid: int
    done: int
    """Records it is done with: their spans sent, held, or counted as failed (cumulative)."""
    failed: int
    """Spans its exporter refused or failed to send, or dropped from what it held (cumulative)."""
    held: int
    """Spans it holds now, for a collector that takes nothing."""

    def encode(self) -> bytes:
        return b"%d %d %d %d\n" % self

    @classmethod
    def decode(cls, line: bytes) -> Acknowledgement:
        return cls._make(map(int, line.split()))
