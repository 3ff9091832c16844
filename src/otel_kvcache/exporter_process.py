"""A helper process that builds the engine's spans, so the engine thread doesn't.

``ExporterProcess`` lives in the EngineCore process: it serializes each
finished request (``RequestEnded`` fields) and each ``Finding`` with
``marshal`` as it comes, and every ``FLUSH_SECONDS`` (or when the engine goes
idle) writes what it has as one frame to the stdin of ``python -m
otel_kvcache.exporter_process``. Serialized at once, a record is a few hundred
bytes the garbage collector does not track, read while still in the CPU's
caches: a second's worth kept as objects (their tuples, their events) pushed
CPython's young generation past its threshold several times a second, and each
collection walked vLLM's young objects, its live requests among them (churn:
15-20 us a step); pickling them in one batch read them back from memory (about
3 us a record). The pipe is non-blocking and as large as Linux lets it be made
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
# the time of the default (measured in the engine loop: 1.9 against 4.1 us a record).
MARSHAL_VERSION = 2
# A frame: its length, then marshalled records (``RequestEnded`` or ``Finding`` fields, as tuples).
_FRAME_HEADER = struct.Struct("<I")
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
        self._records = bytearray()  # marshalled, for the next frame
        self._record_count = 0
        self._outgoing = bytearray()  # frames, not yet all written
        self._outgoing_records = 0
        self._helper_gone = False
        self.due = time.monotonic() + FLUSH_SECONDS
        self.dropped = 0
        atexit.register(self.close)

    def _add(self, fields: tuple) -> None:
        """A record (``RequestEnded`` or ``Finding`` fields, as a plain tuple),
        serialized for the next frame (``flush`` bounds what waits)."""
        try:
            record = marshal.dumps(fields, MARSHAL_VERSION)
        except ValueError:  # a request's trace headers in a mapping that is not a dict
            fields = tuple(RequestEnded._make(fields)._replace(trace_headers=dict(fields[1])))
            record = marshal.dumps(fields, MARSHAL_VERSION)
        self._records += record
        self._record_count += 1

    request_ended = _add  # the engine's hot path: no frame in between

    def finding(self, finding: Finding) -> None:
        self._add(tuple(finding))
        self.flush()

    def flush_if_due(self, now: float) -> None:
        """Sends what is pending every ``FLUSH_SECONDS``, and what the pipe could not
        take every ``RETRY_SECONDS`` (the engine calls when ``due``)."""
        if now >= self.due:
            self.flush()
            self.due = now + (RETRY_SECONDS if self._outgoing else FLUSH_SECONDS)

    def flush(self) -> None:
        if self._record_count:
            # Past MAX_BUFFERED_BYTES of frames the helper has not read, a frame is dropped.
            if self._helper_gone or len(self._outgoing) > MAX_BUFFERED_BYTES:
                self._drop(self._record_count)
            else:
                self._outgoing += _FRAME_HEADER.pack(len(self._records))
                self._outgoing += self._records
                self._outgoing_records += self._record_count
            self._records.clear()
            self._record_count = 0
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
            yield marshal.load(records)


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
