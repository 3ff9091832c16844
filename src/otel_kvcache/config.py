"""Settings from the environment; a bad value is named in a warning with the value used instead.

vLLM's processes inherit the environment, so each of them would read a bad
value and warn about it (up to one process per worker and engine). The first
process to warn records it in ``OTEL_KVCACHE_WARNED_SETTINGS``; the processes
it starts afterwards inherit the record and stay quiet about the same value.
``check_all()`` reads every setting, so that the first process, the API
server, warns about all of them once for the whole vLLM instance.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable

from opentelemetry.sdk import environment_variables as sdk_variables

from otel_kvcache import names

_logger = logging.getLogger(__name__)

RECONCILE_SECONDS = "OTEL_KVCACHE_RECONCILE_SECONDS"
"""Seconds between two reconciliations of the pool against its owners (default 5)."""
ZOMBIE_GRACE_SECONDS = "OTEL_KVCACHE_ZOMBIE_GRACE_SECONDS"
"""How long a finished request may still hold blocks before it is a zombie (default 30)."""
STUCK_STEPS = "OTEL_KVCACHE_STUCK_STEPS"
"""Engine steps a running request may go without computing a token before it is stuck (default 1024)."""

CONNECTOR_TIMEOUT_SECONDS = "OTEL_KVCACHE_CONNECTOR_TIMEOUT_SECONDS"
"""How long a KV connector may hold a finished request's blocks for a send, or keep a
request waiting for remote KV, before it is a finding; ``auto`` (default): the
connector's own timeout (``vllm_compat.kv_transfer.connector_timeout_seconds``, 480 s for most)."""

WHATIF_SAMPLE_RATE = "OTEL_KVCACHE_WHATIF_SAMPLE_RATE"
"""Share of block hashes the what-if curve samples, in (0, 1]; ``auto`` (default): about
256 blocks per pool's worth (``whatif.default_sample_rate``)."""

EXPORTER_PROCESS = "OTEL_KVCACHE_EXPORTER_PROCESS"
"""Build request spans in a helper process: ``auto`` (default: when the SDK is
configured from the environment, as by ``opentelemetry-instrument``), ``on``, ``off``."""
EXPORTER_PROCESS_CHOICES = ("auto", "on", "off")

DEVICE_METRICS = "OTEL_KVCACHE_GPU_DEVICE_METRICS"
"""Which processes report the devices' NVML gauges: ``auto`` (vLLM's first process, or
one vLLM did not start), ``always``, ``never``."""
DEVICE_METRICS_CHOICES = ("auto", "always", "never")

VLLM_PLUGIN = "OTEL_KVCACHE_VLLM_PLUGIN"
"""The ``vllm.general_plugins`` entry point: ``auto`` (default: set up telemetry when an
``OTEL_*`` variable names an exporter or an endpoint), ``on``, ``off``."""
VLLM_PLUGIN_CHOICES = ("auto", "on", "off")

FASTAPI_EXCLUDE_SPANS = "OTEL_PYTHON_FASTAPI_EXCLUDE_SPANS"
"""Comma-separated ASGI spans FastAPI's instrumentation leaves out (``send``, ``receive``;
default none): its ``exclude_spans`` option, which the distro and the plugin pass it.
A streamed response makes one ``http send`` span per chunk without it."""
FASTAPI_EXCLUDE_SPANS_CHOICES = ("send", "receive")

CLIENT_VALUE_LENGTH_LIMIT = "OTEL_KVCACHE_CLIENT_VALUE_LENGTH_LIMIT"
"""Most characters recorded of a value a client chooses (a request id, a trace header), at
least 16 (default 256); longer ones are cut (``bounds.py``)."""
EXPORT_MAX_BYTES = "OTEL_KVCACHE_EXPORT_MAX_BYTES"
"""Most bytes in one span export request (default 3 MiB, under a collector's default 4 MiB)."""
EXPORT_HOLD_BYTES = "OTEL_KVCACHE_EXPORT_HOLD_BYTES"
"""Most bytes of spans held, per exporter, while the collector takes nothing (default 64 MiB;
0 holds none)."""
EXPORT_HOLD_SECONDS = "OTEL_KVCACHE_EXPORT_HOLD_SECONDS"
"""Longest a span is held while the collector takes nothing (default 300, the Collector's
own exporters' retry time)."""

BAGGAGE_KEYS = "OTEL_KVCACHE_BAGGAGE_KEYS"
"""Comma-separated W3C baggage keys (``tenant.id``, say) copied onto each request's span
under their own names, and carried to the engine with the trace headers (default none)."""
ATTRIBUTION = "OTEL_KVCACHE_ATTRIBUTION"
"""Comma-separated attributes the attribution metrics are broken down by: drawn from
``gen_ai.request.model``, ``vllm.request.priority`` and the baggage keys (default
``gen_ai.request.model``)."""
ATTRIBUTION_LIMIT = "OTEL_KVCACHE_ATTRIBUTION_LIMIT"
"""Most series per attribution metric (default 32); the rest fold into one overflow series."""
SESSION_TABLE_SIZE = "OTEL_KVCACHE_SESSION_TABLE_SIZE"
"""Sessions each engine remembers for their turn gaps, least recently seen first out (default 65536)."""

TOP_SNAPSHOT = "OTEL_KVCACHE_TOP_SNAPSHOT"
"""Each engine publishes a live snapshot for ``otel-kvcache top``: ``on`` (default) or ``off``."""
TOP_SNAPSHOT_CHOICES = ("on", "off")
TOP_DIR = "OTEL_KVCACHE_TOP_DIR"
"""Where the live snapshots lie, an absolute path; ``auto`` (default): ``$XDG_RUNTIME_DIR/otel-kvcache``, else
``/tmp/otel-kvcache-$UID``); made readable by its user only."""
TOP_REQUESTS = "OTEL_KVCACHE_TOP_REQUESTS"
"""Requests holding the most blocks each engine's snapshot lists (default 20)."""

WARNED_SETTINGS = "OTEL_KVCACHE_WARNED_SETTINGS"
"""JSON list of ``VARIABLE=value`` already warned about in this vLLM instance."""


def reconcile_seconds() -> float:
    return env_float(RECONCILE_SECONDS, 5.0)


def zombie_grace_seconds() -> float:
    return env_float(ZOMBIE_GRACE_SECONDS, 30.0)


def stuck_steps() -> int:
    return env_int(STUCK_STEPS, 1024)


def connector_timeout_seconds() -> float | None:
    """None for ``auto``."""
    return env_auto_float(CONNECTOR_TIMEOUT_SECONDS, lambda seconds: math.isfinite(seconds) and seconds >= 0,
                          "a finite number >= 0")  # fmt: skip


def whatif_sample_rate() -> float | None:
    """None for ``auto``."""
    return env_auto_float(WHATIF_SAMPLE_RATE, lambda rate: 0.0 < rate <= 1.0, "a number in (0, 1]")


def exporter_process() -> str:
    return env_choice(EXPORTER_PROCESS, EXPORTER_PROCESS_CHOICES)


def device_metrics() -> str:
    return env_choice(DEVICE_METRICS, DEVICE_METRICS_CHOICES)


def vllm_plugin() -> str:
    return env_choice(VLLM_PLUGIN, VLLM_PLUGIN_CHOICES)


def fastapi_exclude_spans() -> list[str]:
    raw = os.environ.get(FASTAPI_EXCLUDE_SPANS, "")
    named = [part.strip().lower() for part in raw.split(",") if part.strip()]
    excluded = [part for part in named if part in FASTAPI_EXCLUDE_SPANS_CHOICES]
    if len(excluded) < len(named):
        used = ",".join(excluded) or "none"
        _warn_once(FASTAPI_EXCLUDE_SPANS, raw, f"names spans other than send, receive; using {used}")
    return excluded


def client_value_length_limit() -> int:
    limit = env_int(CLIENT_VALUE_LENGTH_LIMIT, 256, minimum=16)
    # The SDK's bound on every attribute: where lower, it wins (the SDK warns about a bad value).
    sdk_limit = os.environ.get(sdk_variables.OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT, "").strip()
    if sdk_limit.isdigit():
        limit = min(limit, max(int(sdk_limit), 1))
    return limit


def export_max_bytes() -> int:
    return env_int(EXPORT_MAX_BYTES, 3 << 20, minimum=1 << 16)


def export_hold_bytes() -> int:
    return env_int(EXPORT_HOLD_BYTES, 64 << 20, minimum=0)


def export_hold_seconds() -> float:
    return env_float(EXPORT_HOLD_SECONDS, 300.0)


_BAGGAGE_KEY = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""A W3C baggage key: an HTTP token."""


def baggage_keys() -> list[str]:
    raw = os.environ.get(BAGGAGE_KEYS, "")
    named = list(dict.fromkeys(key.strip() for key in raw.split(",") if key.strip()))
    keys = [key for key in named if _BAGGAGE_KEY.fullmatch(key)]
    if len(keys) < len(named):
        _warn_once(BAGGAGE_KEYS, raw, f"names keys that are not W3C baggage keys; using {','.join(keys) or 'none'}")
    return keys


def attribution() -> list[str]:
    """The attribution attributes, in the order named. A session id is never one: a
    metric series per session would be a series per conversation."""
    default = [names.MODEL]
    raw = os.environ.get(ATTRIBUTION, "")
    named = list(dict.fromkeys(name.strip() for name in raw.split(",") if name.strip()))
    if not named:
        return default
    allowed = [*names.ATTRIBUTION_CHOICES, *baggage_keys()]
    chosen = [name for name in named if name in allowed]
    if len(chosen) < len(named):
        used = ",".join(chosen or default)
        _warn_once(ATTRIBUTION, raw, f"names attributes other than {', '.join(allowed)}; using {used}")
    return chosen or default


def attribution_limit() -> int:
    return env_int(ATTRIBUTION_LIMIT, 32)


def session_table_size() -> int:
    return env_int(SESSION_TABLE_SIZE, 65536)


def top_snapshot() -> str:
    return env_choice(TOP_SNAPSHOT, TOP_SNAPSHOT_CHOICES)


def top_dir() -> str | None:
    """The configured snapshot directory, or None for ``auto`` (``engine.snapshot_files``)."""
    raw = os.environ.get(TOP_DIR, "").strip()
    if raw.lower() in ("", "auto"):
        return None
    if not os.path.isabs(raw):
        _warn_once(TOP_DIR, raw, "is not auto or an absolute path; using auto")
        return None
    return raw


def top_requests() -> int:
    return env_int(TOP_REQUESTS, 20)


def check_all() -> None:
    """Reads every setting, warning (once per vLLM instance) about each bad one."""
    for read in (
        reconcile_seconds,
        zombie_grace_seconds,
        stuck_steps,
        connector_timeout_seconds,
        whatif_sample_rate,
        exporter_process,
        device_metrics,
        vllm_plugin,
        fastapi_exclude_spans,
        client_value_length_limit,
        export_max_bytes,
        export_hold_bytes,
        export_hold_seconds,
        baggage_keys,
        attribution,
        attribution_limit,
        session_table_size,
        top_snapshot,
        top_dir,
        top_requests,
    ):
        read()


def env_auto_float(variable: str, valid: Callable[[float], bool], expected: str) -> float | None:
    """A number ``valid`` accepts, or None for ``auto`` (the default)."""
    raw = os.environ.get(variable, "").strip()
    if raw.lower() in ("", "auto"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if math.isnan(value) or not valid(value):
        _warn_once(variable, raw, f"is not auto or {expected}; using auto")
        return None
    return value


def env_choice(variable: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (the first is the default)."""
    raw = os.environ.get(variable)
    if raw is None or raw.strip() == "":
        return choices[0]
    value = raw.strip().lower()
    if value not in choices:
        _warn_once(variable, raw, f"is not one of {', '.join(choices)}; using {choices[0]!r}")
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
    # nan compares false with everything and inf never comes: either would turn a check off.
    if value is None or not math.isfinite(value) or value < minimum:
        _warn_once(variable, raw, f"is not a finite number >= {minimum}; using {default}")
        return default
    return value


def env_int(variable: str, default: int, minimum: int = 1) -> int:
    return int(_number(variable, default, int, minimum))


def env_float(variable: str, default: float, minimum: float = 0.0) -> float:
    return float(_number(variable, default, float, minimum))


def _warn_once(variable: str, raw: str, what: str) -> None:
    setting = f"{variable}={raw}"
    try:
        warned = list(json.loads(os.environ.get(WARNED_SETTINGS) or "[]"))
    except (ValueError, TypeError):
        warned = []
    if setting in warned:
        return
    _logger.warning("otel-kvcache: %s=%r %s", variable, raw, what)
    os.environ[WARNED_SETTINGS] = json.dumps([*warned, setting])
