"""Settings from the environment; a bad value is named in a warning with the value used instead."""

from __future__ import annotations

import logging
import os

_logger = logging.getLogger(__name__)

RECONCILE_SECONDS = "OTEL_KVCACHE_RECONCILE_SECONDS"
"""Seconds between two reconciliations of the pool against its owners (default 5)."""
ZOMBIE_GRACE_SECONDS = "OTEL_KVCACHE_ZOMBIE_GRACE_SECONDS"
"""How long a finished request may still hold blocks before it is a zombie (default 30)."""
STUCK_STEPS = "OTEL_KVCACHE_STUCK_STEPS"
"""Engine steps a running request may go without computing a token before it is stuck (default 1024)."""

EXPORTER_PROCESS = "OTEL_KVCACHE_EXPORTER_PROCESS"
"""Build request spans in a helper process: ``auto`` (default: when the SDK is
configured from the environment, as by ``opentelemetry-instrument``), ``on``, ``off``."""
EXPORTER_PROCESS_CHOICES = ("auto", "on", "off")


def env_choice(variable: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (the first is the default)."""
    raw = os.environ.get(variable)
    if raw is None or raw.strip() == "":
        return choices[0]
    value = raw.strip().lower()
    if value not in choices:
        _logger.warning("otel-kvcache: %s=%r is not one of %s; using %r", variable, raw, ", ".join(choices), choices[0])
        return choices[0]
    return value


def _number(variable: str, default: float, cast, minimum: float) -> float:
    raw = os.environ.get(variable)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = cast(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        _logger.warning("otel-kvcache: %s=%r is not a number >= %s; using %s", variable, raw, minimum, default)
        return default
    return value


def env_int(variable: str, default: int, minimum: int = 1) -> int:
    return int(_number(variable, default, int, minimum))


def env_float(variable: str, default: float, minimum: float = 0.0) -> float:
    return float(_number(variable, default, float, minimum))
