"""A helper process that builds the engine's spans, so the engine thread doesn't.

``ExporterProcess`` lives in the EngineCore process: it holds each finished
request (``RequestEnded`` fields) and each ``Finding`` as the engine hands it
over, and every ``FLUSH_SECONDS`` (or when the engine goes idle) marshals what
it holds, in one C loop, into one frame for the stdin of ``python -m
otel_kvcache.exporter_process``. Taking a record is one ``list.extend`` on
the engine thread (marshalling each at release ran ``marshal``'s code cold:
4-5 us of a release on wide). The records' fields are kept one after
another in one list, not as a tuple each: a second's worth of tuples, each
counted by the garbage collector until freed, pushed CPython's young
generation past its threshold (700 objects more allocated than freed) about
once a second on churn, where vLLM alone, as many allocated as freed, goes
many seconds without; each such collection walks vLLM's young requests and
their token lists, a few milliseconds. (Records held as objects with their
events and dicts had done it several times a second: 15-20 us a step.)
The pipe is non-blocking and as large as Linux lets it be made
(``PIPE_BYTES``); what it cannot take at once is written again
``RETRY_SECONDS`` later. If the helper falls behind by more than
``MAX_BUFFERED_BYTES``, a frame's records are dropped and counted, never
waited for.

The helper configures the OpenTelemetry SDK from the inherited ``OTEL_*``
environment (by ``opentelemetry-instrument``'s sitecustomize, or here if it
did not run) with the EngineCore's resource attributes handed down, runs
``RequestExporter`` on every message, and flushes and exits when the pipe
closes, i.e. when the EngineCore exits.
"""

from __future__ import annotations

import atexit
import fcntl
import io
import json
import logging
import marshal
import os
import struct
import subprocess
import sys
import time
from itertools import repeat
from typing import Any

from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.export import Finding, RequestEnded
from otel_kvcache.resource import PROCESS_ENVIRONMENT_VARIABLE

_logger = logging.getLogger(__name__)

# Well inside the SDK's own batching (the batch span processor exports every 5 s);
# each write wakes the helper, tens of microseconds of the engine thread.
FLUSH_SECONDS = 1.0
# A second of a busy engine's records is a few hundred kB; the default pipe holds 64 kB.
PIPE_BYTES = 1 << 20
RETRY_SECONDS = 0.05
MAX_BUFFERED_BYTES = 8 << 20
# Version 2 writes no back-references, so it builds no hash table per call: half
# the time of the default (measured a record at a time: 1.9 against 4.1 us).
MARSHAL_VERSION = 2
# A frame: its length, then marshalled records: finished requests' ``RequestEnded`` fields,
# one after another in a list, then each ``Finding``'s as a tuple.
_FRAME_HEADER = struct.Struct("<I")
_FIELDS = len(RequestEnded._fields)
HOOK = "exporter_process"
"""The name our errors in the channel are counted under."""


class HelperFellBehind(RuntimeError):
    """Records dropped because the helper process did not keep up (or exited)."""


class ExporterProcess:
    """The engine's side of the pipe to its helper process."""

    def __init__(self, handed_down: dict[str, Any], errors: InstrumentationErrors) -> None:
        self.errors = errors
        environment = dict(os.environ)
        environment[PROCESS_ENVIRONMENT_VARIABLE] = json.dumps(handed_down)
        # The helper runs our exporter only: it must not instrument itself.
        disabled = environment.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
        environment["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = ",".join(
            filter(None, [disabled, "vllm_kvcache", "vllm_gpu"])
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "otel_kvcache.exporter_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            env=environment,
            close_fds=True,
        )
        self._fd = self.process.stdin.fileno()
        os.set_blocking(self._fd, False)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (AttributeError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size
            pass
        self._pending: list = []
        """Finished requests' ``RequestEnded`` fields, one after another (flat)."""
        self.request_ended = self._pending.extend
        """Takes a finished request's ``RequestEnded`` fields until the next ``flush``:
        one C call on the engine's hot path (see the module's docstring)."""
        self._findings: list[tuple] = []
        self._outgoing = bytearray()  # frames, not yet all written
        self._outgoing_records = 0
        self._helper_gone = False
        self.due = time.monotonic() + FLUSH_SECONDS
        self.dropped = 0
        atexit.register(self.close)

    def finding(self, finding: Finding) -> None:
        self._findings.append(tuple(finding))
        self.flush()

    def flush_if_due(self, now: float) -> None:
        """Sends what is pending every ``FLUSH_SECONDS``, and what the pipe could not
        take every ``RETRY_SECONDS`` (the engine calls when ``due``)."""
        if now >= self.due:
            self.flush()
            self.due = now + (RETRY_SECONDS if self._outgoing else FLUSH_SECONDS)

    def flush(self) -> None:
        pending, findings = self._pending, self._findings
        if pending or findings:
            # Past MAX_BUFFERED_BYTES of frames the helper has not read, a frame is dropped.
            if self._helper_gone or len(self._outgoing) > MAX_BUFFERED_BYTES:
                self._drop(len(pending) // _FIELDS + len(findings))
            else:
                frame, count = self._marshalled(pending, findings)
                self._outgoing += _FRAME_HEADER.pack(len(frame))
                self._outgoing += frame
                self._outgoing_records += count
            pending.clear()
            findings.clear()
        written = self._write_what_fits()
        if written < 0:  # the helper exited
            self._helper_gone = True
            self._outgoing.clear()
            self._drop(self._outgoing_records)
            self._outgoing_records = 0
            return
        del self._outgoing[:written]
        if not self._outgoing:
            self._outgoing_records = 0

    def _marshalled(self, ended_fields: list, findings: list[tuple]) -> tuple[bytes, int]:
        """A frame: the finished requests' fields as one flat list, then the findings,
        each marshalled in one C call; and how many records it holds. A request with
        a value marshal cannot write is written again with its trace headers as
        plain strings, or else dropped (and counted), not the frame."""
        written = len(ended_fields) // _FIELDS
        try:
            frame = [marshal.dumps(ended_fields, MARSHAL_VERSION)] if ended_fields else []
        except ValueError:  # e.g. a trace header in a str subclass
            frame = []
            for start in range(0, len(ended_fields), _FIELDS):
                try:
                    fields = _with_plain_headers(ended_fields[start : start + _FIELDS])
                    frame.append(marshal.dumps(fields, MARSHAL_VERSION))
                except ValueError:
                    self._drop(1)
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
                return -1
        return written

    def _drop(self, count: int) -> None:
        self.dropped += count
        self.errors.record(HOOK, HelperFellBehind(f"{self.dropped} records dropped so far"))

    def close(self, timeout: float = 10.0) -> None:
        """At exit: hand over everything pending, then let the helper export and exit."""
        stdin = self.process.stdin
        if stdin is None or stdin.closed or self._helper_gone:
            return
        try:
            self.flush()
            os.set_blocking(self._fd, True)
            while self._outgoing:
                del self._outgoing[: os.write(self._fd, self._outgoing)]
            stdin.close()
            self.process.wait(timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            _logger.warning("otel-kvcache: the exporter process did not finish cleanly: %s", exc)


def _with_plain_headers(fields: list) -> list:
    """A ``RequestEnded`` record's fields with its trace headers as a dict of plain strings."""
    if fields[1]:
        fields[1] = {str(name): str(value) for name, value in fields[1].items()}
    return fields


# --- the helper process ---------------------------------------------------------


def _configured_exporter():
    from opentelemetry import metrics, trace
    from opentelemetry.trace import ProxyTracerProvider

    from otel_kvcache.export import RequestExporter, RequestHistograms
    from otel_kvcache.names import METER_SCOPE
    from otel_kvcache.version import __version__

    if isinstance(trace.get_tracer_provider(), ProxyTracerProvider):
        # Not started under opentelemetry-instrument: configure the SDK the way it would.
        from opentelemetry.instrumentation.auto_instrumentation import initialize

        initialize()
    tracer = trace.get_tracer(METER_SCOPE, __version__)
    histograms = RequestHistograms(metrics.get_meter(METER_SCOPE, __version__))
    return RequestExporter(tracer, histograms)


def _records(stream):
    """The records of each frame from the engine, until the pipe closes."""
    while True:
        header = stream.read(_FRAME_HEADER.size)
        if len(header) < _FRAME_HEADER.size:
            return
        (length,) = _FRAME_HEADER.unpack(header)
        frame = stream.read(length)
        if len(frame) < length:
            return
        records = io.BytesIO(frame)
        while records.tell() < length:
            record = marshal.load(records)
            if type(record) is list:  # finished requests' fields, one after another
                for start in range(0, len(record), _FIELDS):
                    yield record[start : start + _FIELDS]
            else:  # a finding
                yield record


def main() -> int:
    exporter = _configured_exporter()
    for record in _records(sys.stdin.buffer):
        try:
            if len(record) == len(Finding._fields):
                exporter.finding(Finding._make(record))
            else:
                exporter.request_ended(record)
        except Exception:  # noqa: BLE001 - one bad record must not stop the others
            _logger.exception("otel-kvcache: could not export a record")
    # The SDK's providers flush and shut down at exit.
    return 0


if __name__ == "__main__":
    sys.exit(main())
