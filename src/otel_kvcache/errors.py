"""Errors inside otel-kvcache are counted and logged once per kind; vLLM never sees them.
Telemetry we lose is counted too, in one counter each process makes here."""

from __future__ import annotations

import logging

from opentelemetry.metrics import Counter, Meter

from otel_kvcache import names

_logger = logging.getLogger(__name__)


class InstrumentationErrors:
    """Counts our own failures by hook and exception type, logging each kind once."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._logged: set[tuple[str, str]] = set()

    def count(self, hook: str, exc: BaseException, amount: int = 1) -> None:
        """``amount``: how many things the error cost (records dropped, for the exporter)."""
        kind = (hook, type(exc).__qualname__)
        try:
            self._counter.add(amount, {names.ERROR_TYPE_ATTRIBUTE: kind[1], names.HOOK: hook})
            if kind not in self._logged:
                self._logged.add(kind)
                _logger.warning(
                    "otel-kvcache: %s failed in %s; vLLM is unaffected, telemetry for it may be "
                    "incomplete (logged once per kind)",
                    kind[1],
                    hook,
                    exc_info=exc,
                )
        except Exception:  # pragma: no cover - a broken logger or SDK must not reach vLLM either
            pass


def telemetry_dropped_counter(meter: Meter) -> Counter:
    """``otel_kvcache.telemetry.dropped``, by ``otel_kvcache.stage``: the same instrument
    wherever a process makes it (the engine's instruments, the helper, the span exports)."""
    return meter.create_counter(
        names.TELEMETRY_DROPPED,
        unit="{record}",
        description="Request records, findings and spans lost on their way to the backend, by stage.",
    )


def count_dropped(count: int, stage: str) -> None:
    """Counts lost telemetry in this process's global meter: where no engine instruments are
    at hand (the helper, the span exports of any process)."""
    from opentelemetry import metrics

    from otel_kvcache.version import __version__

    telemetry_dropped_counter(metrics.get_meter(names.METER_SCOPE, __version__)).add(count, {names.STAGE: stage})
