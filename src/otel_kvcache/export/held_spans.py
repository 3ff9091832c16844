"""Spans held through a collector's outage, bounded in bytes and in time.

The OTLP exporter retries a failed export for its timeout (10 s by default), then
gives up on the batch: a collector that restarts, or is redeployed, is often gone
for longer, and every span made meanwhile was lost. The Collector's own exporters keep
a sending queue and retry for five minutes before they drop anything
(``exporterhelper``'s ``sending_queue`` and ``retry_on_failure``).
``HoldingSpanExporter`` does the same in front of the byte-bounded exporter
(``bounded_export.py``):

- Spans go out on the caller's thread while the collector takes them. What was
  not sent because the collector takes nothing (it cannot be reached, or it fails
  even an empty export: ``bounded_export.py``) is held, in order, and so is
  whatever comes while anything is held, so that it goes out after.
- A thread of its own sends the oldest held spans again after a pause that grows
  from 5 s by half each try, up to 30 s, each randomized by half: the Collector's
  defaults, so that a host's processes do not all come back at once.
- Held spans are bounded per exporter in bytes, as OTLP encodes them
  (``OTEL_KVCACHE_EXPORT_HOLD_BYTES``, 64 MiB), and in time
  (``OTEL_KVCACHE_EXPORT_HOLD_SECONDS``, 300 s): a batch that would overflow the
  bytes is dropped whole, as the Collector's queue refuses what it cannot take,
  and a batch held longer than the time is dropped.
- ``shutdown`` gives what is held until its deadline, then drops the rest.
- Every span dropped passes ``on_lost`` once (``otel_kvcache.telemetry.dropped``,
  stage ``export``, unless the caller counts them itself); the first hold, and the
  first loss of each kind, is logged once per process. ``on_settled`` tells the
  caller when the sender's thread sent or dropped what it held (the helper tells
  its engine).
- A forked child holds nothing of its parent's: the parent sends its own.

The helper's span pipeline uses it (``helper.py``), and so does every process the
configurator sets up, behind the SDK's batch span processor (``distro.py``):
FastAPI's spans in the API server, the KV spans' parents, are held too. Nothing is
held or sent on vLLM's engine thread.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from otel_kvcache import config, names
from otel_kvcache.errors import count_dropped
from otel_kvcache.export.bounded_export import ByteBoundedSpanExporter, encoded_size, warn_once

_logger = logging.getLogger(__name__)

FIRST_INTERVAL = 5.0
MOST_INTERVAL = 30.0
INTERVAL_MULTIPLIER = 1.5
INTERVAL_RANDOMIZATION = 0.5
"""The Collector's ``retry_on_failure`` defaults: seconds between tries of the held spans."""
SHUTDOWN_SECONDS = 5.0
"""At a process's exit (its tracer provider's shutdown): the most time given to what is held."""
SHUTDOWN_RETRY_SECONDS = 1.0
"""Between tries once shutting down."""


class _Held(NamedTuple):
    spans: list[ReadableSpan]
    size: int
    since: float


def count_lost(count: int) -> None:
    try:
        count_dropped(count, names.STAGE_EXPORT)
    except Exception:  # noqa: BLE001 - an export thread must not fail because of us
        _logger.debug("otel-kvcache: could not count dropped spans", exc_info=True)


class HoldingSpanExporter(SpanExporter):
    """Exports through a ``ByteBoundedSpanExporter``, holding what it could not send while
    the collector takes nothing, and sending it when the collector takes spans again."""

    def __init__(
        self,
        exporter: SpanExporter,
        on_lost: Callable[[int], None] = count_lost,
        *,
        on_settled: Callable[[], None] = lambda: None,
        hold_bytes: int | None = None,
        hold_seconds: float | None = None,
        first_interval: float = FIRST_INTERVAL,
        most_interval: float = MOST_INTERVAL,
    ) -> None:
        self.bounded = ByteBoundedSpanExporter(exporter)
        self.on_lost = on_lost
        self.on_settled = on_settled
        """Called on the sender's thread after each of its tries, and each drop of what outlived the time."""
        self.hold_bytes = config.export_hold_bytes() if hold_bytes is None else hold_bytes
        self.hold_seconds = config.export_hold_seconds() if hold_seconds is None else hold_seconds
        self.first_interval = first_interval
        self.most_interval = most_interval
        self._start_afresh()

    def _start_afresh(self) -> None:
        self._pid = os.getpid()
        self._changed = threading.Condition()
        self._held: deque[_Held] = deque()
        """Batches waiting for the sender, oldest first."""
        self._sending: _Held | None = None
        """The batch the sender is sending (held still: it goes back first if it is not sent)."""
        self._held_bytes = 0
        self._sender: threading.Thread | None = None
        self._deadline: float | None = None
        """Set by ``shutdown``: when what is still held is dropped."""

    @property
    def held(self) -> int:
        """Spans held now."""
        with self._changed:
            return sum(len(held.spans) for held in self._all_held())

    def _all_held(self) -> list[_Held]:
        return [*([self._sending] if self._sending is not None else []), *self._held]

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if os.getpid() != self._pid:
            self._start_afresh()
        spans = list(spans)
        if self._held or self._sending is not None:  # keep the order: these go after what is held
            lost = self._hold(spans, encoded_size(spans), time.monotonic())
        else:
            lost, unsent = self.bounded.send(spans)
            if unsent:
                warn_once("held", self._describe_hold, counted=False)
                lost += self._hold(unsent, encoded_size(unsent), time.monotonic())
        self._lose(lost)
        return SpanExportResult.FAILURE if lost else SpanExportResult.SUCCESS

    def _describe_hold(self) -> str:
        return (
            f"{self.bounded.why_not_taken}; spans are held, up to {config.EXPORT_HOLD_BYTES}={self.hold_bytes} "
            f"bytes for up to {config.EXPORT_HOLD_SECONDS}={self.hold_seconds:g} s, and sent when it takes them again"
        )

    def _hold(self, spans: list[ReadableSpan], size: int, since: float) -> int:
        """Holds ``spans`` behind what is held; how many were dropped instead (with any
        that outlived the time)."""
        with self._changed:
            lost = self._drop_outlived()
            if self._held_bytes + size > self.hold_bytes:
                warn_once("overflowed", lambda: f"spans beyond {config.EXPORT_HOLD_BYTES}={self.hold_bytes} "
                          "bytes held are dropped")  # fmt: skip
                return lost + len(spans)
            self._held.append(_Held(spans, size, since))
            self._held_bytes += size
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_held, name="otel-kvcache-held-spans", daemon=True)
                self._sender.start()
            self._changed.notify_all()
            return lost

    def _drop_outlived(self) -> int:
        """Drops the batches held longer than ``hold_seconds`` (with the lock held)."""
        lost, now = 0, time.monotonic()
        while self._held and now - self._held[0].since > self.hold_seconds:
            outlived = self._held.popleft()
            self._held_bytes -= outlived.size
            lost += len(outlived.spans)
        if lost:
            warn_once("outlived", lambda: f"spans held longer than {config.EXPORT_HOLD_SECONDS}="
                      f"{self.hold_seconds:g} s are dropped")  # fmt: skip
        return lost

    def _send_held(self) -> None:
        """The sender's thread: sends the oldest held batch after a pause (its caller has
        just failed to), again after a growing pause while the collector takes nothing,
        until shutdown."""
        interval, pause = self.first_interval, True
        while True:
            if pause:
                if not self._pause(interval):
                    return
                interval, pause = min(interval * INTERVAL_MULTIPLIER, self.most_interval), False
            with self._changed:
                if not self._held and self._deadline is None:
                    self._changed.wait_for(lambda: self._held or self._deadline is not None)
                    interval, pause = self.first_interval, True  # what comes, its caller just failed to send
                    continue
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    return
                lost = self._drop_outlived()
                head = self._sending = self._held.popleft() if self._held else None
            self._lose(lost)
            if lost:
                self.on_settled()
            if head is None:
                if self._deadline is not None:
                    return
                continue
            lost, unsent = self.bounded.send(head.spans)
            with self._changed:
                if self._sending is not head:  # abandoned meanwhile, and counted by who abandoned it
                    return
                self._sending = None
                self._held_bytes -= head.size
                if unsent:
                    size = head.size if len(unsent) == len(head.spans) else encoded_size(unsent)
                    self._held.appendleft(_Held(unsent, size, head.since))
                    self._held_bytes += size
                elif not self._held:
                    _logger.info("otel-kvcache: the collector takes spans again; what was held is sent")
                self._changed.notify_all()
            self._lose(lost)
            self.on_settled()
            pause = bool(unsent)
            if not unsent:
                interval = self.first_interval

    def _pause(self, interval: float) -> bool:
        """Waits ``interval`` randomized by half, or less once shutting down; False once the
        shutdown's deadline has passed."""
        with self._changed:
            if self._deadline is None:
                wait = interval * random.uniform(1 - INTERVAL_RANDOMIZATION, 1 + INTERVAL_RANDOMIZATION)
                self._changed.wait_for(lambda: self._deadline is not None, timeout=wait)
            if self._deadline is not None:
                if time.monotonic() >= self._deadline:
                    return False
                self._changed.wait(min(SHUTDOWN_RETRY_SECONDS, self._deadline - time.monotonic()))
            return True

    def _lose(self, count: int) -> None:
        if count:
            self.on_lost(count)

    def abandon(self) -> int:
        """Drops what is held, uncounted: how many spans (for a caller that counts them itself)."""
        with self._changed:
            dropped = sum(len(held.spans) for held in self._all_held())
            self._held.clear()
            self._sending = None
            self._held_bytes = 0
            self._deadline = time.monotonic()
            self._changed.notify_all()
            return dropped

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._changed:
            flushed = self._changed.wait_for(lambda: not self._all_held(), timeout=timeout_millis / 1000)
        return self.bounded.force_flush(timeout_millis) and flushed

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> None:
        """Gives what is held ``timeout`` seconds to go out; drops and counts the rest."""
        with self._changed:
            self._deadline = time.monotonic() + timeout
            self._changed.notify_all()
            sender = self._sender
        if sender is not None and os.getpid() == self._pid:
            sender.join(timeout)
        left = self.abandon()
        if left:
            warn_once("at exit", lambda: f"{left} held spans could not be sent before the exit; they are dropped")
            self._lose(left)
        self.bounded.shutdown()


def holding_batch_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    """The SDK's batch span processor, exporting through ``HoldingSpanExporter``: the
    configurator's ``export_span_processor`` (``distro.py``)."""
    return BatchSpanProcessor(HoldingSpanExporter(exporter))
