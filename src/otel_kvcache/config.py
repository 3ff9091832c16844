"""Settings from the environment; a bad value is named in a warning with the value used instead.

Each setting is declared once, below, as a ``Setting``: its variable, its kind
(the default, the bounds or choices, and how a value is read), and what it sets.
The declaration is the setting's reader (``config.stuck_steps()``), and
``check_all``, ``otel-kvcache doctor`` and the README's configuration table
(``python -m otel_kvcache.config``) all come from ``SETTINGS``.

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
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from opentelemetry.sdk import environment_variables as sdk_variables

from otel_kvcache import names

_logger = logging.getLogger(__name__)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Kind(Protocol[T_co]):
    """How one setting's raw value is read, and how the README describes it."""

    def read(self, raw: str | None) -> tuple[T_co, str | None]:
        """The value to use, and what is wrong with ``raw`` (None: nothing) for the warning."""
        ...

    def default_cell(self) -> str:
        """The default, as the README's table writes it."""
        ...

    def bad_value_cell(self) -> str:
        """What a bad value is, and what is used instead, as the README's table writes it."""
        ...


def _unset(raw: str | None) -> bool:
    return raw is None or raw.strip() == ""


N = TypeVar("N", int, float)


@dataclass(frozen=True)
class Number(Generic[N]):
    """A finite number of at least ``minimum``; whole if the default is an int."""

    default: N
    minimum: N
    capped_by: str | None = None
    """A variable of the SDK's whose whole number wins where it is lower (the SDK warns about a bad one)."""

    def read(self, raw: str | None) -> tuple[N, str | None]:
        value = self.default
        complaint = None
        if not _unset(raw):
            value, complaint = self._parse(raw)
        if self.capped_by is not None:
            cap = os.environ.get(self.capped_by, "").strip()
            if cap.isdigit():
                value = min(value, max(int(cap), 1))
        return value, complaint

    def _parse(self, raw: str) -> tuple[N, str | None]:
        cast = type(self.default)
        try:
            value = cast(raw)
        except ValueError:
            value = None
        # nan compares false with everything and inf never comes: either would turn a check off.
        if value is None or not math.isfinite(value) or value < self.minimum:
            return self.default, f"is not a finite number >= {self.minimum}; using {self.default}"
        return value, None

    def default_cell(self) -> str:
        return f"`{self.default:g}`" if isinstance(self.default, float) else f"`{self.default}`"

    def bad_value_cell(self) -> str:
        if isinstance(self.default, int):
            return f"not a whole number of at least {self.minimum}: the default"
        below = "negative" if self.minimum == 0 else f"below {self.minimum:g}"
        return f"not a number, {below} or not finite: the default"


@dataclass(frozen=True)
class AutoNumber:
    """``auto`` (the default, read as None: worked out where the value is used), or a finite
    number above ``low`` (or at it, where ``low_included``) and at most ``high``."""

    low: float
    low_included: bool = True
    high: float = math.inf

    def read(self, raw: str | None) -> tuple[float | None, str | None]:
        raw = (raw or "").strip()
        if raw.lower() in ("", "auto"):
            return None, None
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        above_low = value > self.low or (self.low_included and value == self.low)
        if not (above_low and math.isfinite(value) and value <= self.high):
            return None, f"is not auto or {self._expected()}; using auto"
        return value, None

    def _expected(self) -> str:
        if self.high == math.inf and self.low_included:
            return f"a finite number >= {self.low:g}"
        return f"a number in {'[' if self.low_included else '('}{self.low:g}, {self.high:g}]"

    def default_cell(self) -> str:
        return "`auto`"

    def bad_value_cell(self) -> str:
        return f"not `auto` or {self._expected()}: `auto`"


@dataclass(frozen=True)
class Choice:
    """One of ``choices``, in any case; the first is the default."""

    choices: tuple[str, ...]

    def read(self, raw: str | None) -> tuple[str, str | None]:
        default = self.choices[0]
        if _unset(raw):
            return default, None
        value = raw.strip().lower()
        if value not in self.choices:
            return default, f"is not one of {', '.join(self.choices)}; using {default!r}"
        return value, None

    def default_cell(self) -> str:
        return f"`{self.choices[0]}`"

    def bad_value_cell(self) -> str:
        *most, last = (f"`{choice}`" for choice in self.choices)
        return f"not {', '.join(most)} or {last}: the default"


@dataclass(frozen=True)
class Names:
    """Comma-separated names, each kept once, in the order named; a name not allowed is
    left out (and named in the warning). ``default`` where none is named, or none is kept."""

    noun: str
    """What the names are, for the warning: ``spans``."""
    choices: tuple[str, ...] = ()
    """The names allowed."""
    also: Setting[list[str]] | None = None
    """A setting whose names are allowed too."""
    pattern: re.Pattern[str] | None = None
    """The form of a name allowed, instead of choices."""
    pattern_name: str = ""
    """What a name of that form is, for the warning: ``W3C baggage keys``."""
    default: tuple[str, ...] = ()
    lower: bool = False
    """Names are read in lower case."""

    def read(self, raw: str | None) -> tuple[list[str], str | None]:
        parts = (part.strip() for part in (raw or "").split(","))
        named = list(dict.fromkeys(part.lower() if self.lower else part for part in parts if part))
        if not named:
            return list(self.default), None
        if self.pattern is not None:
            kept = [name for name in named if self.pattern.fullmatch(name)]
            refused = f"{self.noun} that are not {self.pattern_name}"
        else:
            allowed = [*self.choices, *(self.also.reading().value if self.also else ())]
            kept = [name for name in named if name in allowed]
            refused = f"{self.noun} other than {', '.join(allowed)}"
        used = kept or list(self.default)
        if len(kept) < len(named):
            return used, f"names {refused}; using {','.join(used) or 'none'}"
        return used, None

    def default_cell(self) -> str:
        return f"`{','.join(self.default)}`" if self.default else "none"

    def bad_value_cell(self) -> str:
        if self.pattern is not None:
            return f"{self.noun} that are not {self.pattern_name}: left out"
        return f"{self.noun} other than those: left out"


@dataclass(frozen=True)
class AutoPath:
    """``auto`` (the default, read as None: worked out where the value is used), or an absolute path."""

    def read(self, raw: str | None) -> tuple[str | None, str | None]:
        raw = (raw or "").strip()
        if raw.lower() in ("", "auto"):
            return None, None
        if not os.path.isabs(raw):
            return None, "is not auto or an absolute path; using auto"
        return raw, None

    def default_cell(self) -> str:
        return "`auto`"

    def bad_value_cell(self) -> str:
        return "not an absolute path: `auto`"


@dataclass(frozen=True)
class Reading(Generic[T]):
    """One setting, as the environment has it now."""

    raw: str | None
    """The variable's value; None where it is not set."""
    value: T
    """The value used."""
    complaint: str | None
    """What is wrong with ``raw``, and what is used instead; None where nothing is."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: calling it reads it, warning once per vLLM instance about a bad value."""

    variable: str
    kind: Kind[T]
    description: str
    """What it sets: the README table's cell (Markdown)."""

    def reading(self) -> Reading[T]:
        """The value, without a warning."""
        raw = os.environ.get(self.variable)
        value, complaint = self.kind.read(raw)
        return Reading(raw, value, complaint)

    def __call__(self) -> T:
        reading = self.reading()
        if reading.complaint is not None:
            _warn_once(self.variable, reading.raw or "", reading.complaint)
        return reading.value


reconcile_seconds: Setting[float] = Setting(
    "OTEL_KVCACHE_RECONCILE_SECONDS",
    Number(5.0, minimum=0.0),
    "seconds between leak reconciliations (a pass waits at least 1,000 times as long as the last one took); "
    "`0`: every engine step",
)
zombie_grace_seconds: Setting[float] = Setting(
    "OTEL_KVCACHE_ZOMBIE_GRACE_SECONDS",
    Number(30.0, minimum=0.0),
    "how long a finished request may hold blocks before it is a zombie (one a KV connector holds for a "
    "transfer: its timeout instead)",
)
stuck_steps: Setting[int] = Setting(
    "OTEL_KVCACHE_STUCK_STEPS",
    Number(1024, minimum=1),
    "engine steps a running request may go without a new token before it is stuck",
)
connector_timeout_seconds: Setting[float | None] = Setting(
    "OTEL_KVCACHE_CONNECTOR_TIMEOUT_SECONDS",
    AutoNumber(low=0.0),
    "how long a KV connector may hold a finished request's blocks, or keep a request waiting for remote KV, "
    "before it is a finding; `auto`: the connector's own (Mooncake's `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`, "
    "NIXL's `decoder_kv_blocks_ttl`, else 480 s)",
)
whatif_sample_rate: Setting[float | None] = Setting(
    "OTEL_KVCACHE_WHATIF_SAMPLE_RATE",
    AutoNumber(low=0.0, low_included=False, high=1.0),
    "the share of block hashes the what-if curve samples, in (0, 1]; `auto`: about 256 blocks per pool's worth "
    "(all of a pool that small)",
)
exporter_process: Setting[str] = Setting(
    "OTEL_KVCACHE_EXPORTER_PROCESS",
    Choice(("auto", "on", "off")),
    "where the request spans are built: `auto` (a helper process, off vLLM's engine thread, when the SDK comes "
    "from the environment, in-process when `instrument()` is given a `tracer_provider`), `on`, `off`",
)
device_metrics: Setting[str] = Setting(
    "OTEL_KVCACHE_GPU_DEVICE_METRICS",
    Choice(("auto", "always", "never")),
    "which processes report `hw.gpu.*`: `auto` (vLLM's first process, or one vLLM did not start), "
    "`always`, `never`",
)
vllm_plugin: Setting[str] = Setting(
    "OTEL_KVCACHE_VLLM_PLUGIN",
    Choice(("auto", "on", "off")),
    "vLLM's plugin entry point: `auto` (sets the SDK up when an `OTEL_*` variable names an exporter or an "
    "endpoint), `on`, `off`",
)
client_value_length_limit: Setting[int] = Setting(
    "OTEL_KVCACHE_CLIENT_VALUE_LENGTH_LIMIT",
    Number(256, minimum=16, capped_by=sdk_variables.OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT),
    "most characters recorded of a value a client chooses ([Reliability](#reliability)); "
    f"the SDK's `{sdk_variables.OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT}` wins where lower",
)
export_max_bytes: Setting[int] = Setting(
    "OTEL_KVCACHE_EXPORT_MAX_BYTES",
    Number(3 << 20, minimum=1 << 16),
    "most bytes in one span export request (3 MiB: under gRPC's and the Collector's 4 MiB)",
)
export_hold_bytes: Setting[int] = Setting(
    "OTEL_KVCACHE_EXPORT_HOLD_BYTES",
    Number(64 << 20, minimum=0),
    "most bytes of spans each process holds, as OTLP encodes them (64 MiB), while the collector takes nothing: "
    "unreachable, or failing every export; `0` holds none",
)
export_hold_seconds: Setting[float] = Setting(
    "OTEL_KVCACHE_EXPORT_HOLD_SECONDS",
    Number(300.0, minimum=0.0),
    "longest a span is held while the collector takes nothing (the Collector's own exporters' retry time)",
)
baggage_keys: Setting[list[str]] = Setting(
    "OTEL_KVCACHE_BAGGAGE_KEYS",
    Names("keys", pattern=re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"), pattern_name="W3C baggage keys"),
    "comma-separated W3C baggage keys (`tenant.id`) carried to the engine and recorded on the span under "
    "their own names; other entries never leave the API server",
)
attribution: Setting[list[str]] = Setting(
    "OTEL_KVCACHE_ATTRIBUTION",
    Names("attributes", choices=names.ATTRIBUTION_CHOICES, also=baggage_keys, default=(names.MODEL,)),
    "what the [attribution metrics](docs/telemetry.md#who-holds-the-kv-cache) are broken down by: "
    f"{', '.join(f'`{name}`' for name in names.ATTRIBUTION_CHOICES)}, baggage keys, comma-separated "
    "(never a session id: a series per conversation)",
)
attribution_limit: Setting[int] = Setting(
    "OTEL_KVCACHE_ATTRIBUTION_LIMIT",
    Number(32, minimum=1),
    "most series per attribution metric, the overflow series besides",
)
session_table_size: Setting[int] = Setting(
    "OTEL_KVCACHE_SESSION_TABLE_SIZE",
    Number(65536, minimum=1),
    "sessions each engine remembers for their turn gaps, least recently seen first out (about 110 bytes each)",
)
top_snapshot: Setting[str] = Setting(
    "OTEL_KVCACHE_TOP_SNAPSHOT",
    Choice(("on", "off")),
    "each engine publishes a live snapshot for [`otel-kvcache top`](#otel-kvcache-top): `on`, `off`",
)
top_dir: Setting[str | None] = Setting(
    "OTEL_KVCACHE_TOP_DIR",
    AutoPath(),
    "where the snapshots lie, an absolute path, made mode 0700; `auto`: `$XDG_RUNTIME_DIR/otel-kvcache`, "
    "else `/tmp/otel-kvcache-$UID`",
)
top_requests: Setting[int] = Setting(
    "OTEL_KVCACHE_TOP_REQUESTS",
    Number(20, minimum=1),
    "requests holding the most blocks each snapshot lists",
)
fastapi_exclude_spans: Setting[list[str]] = Setting(
    "OTEL_PYTHON_FASTAPI_EXCLUDE_SPANS",
    Names("spans", choices=("send", "receive"), lower=True),
    "the ASGI spans FastAPI's instrumentation leaves out (its `exclude_spans` option), passed to it by the "
    "distro and the plugin: `send`, `receive` or both (`send,receive`, to keep a streamed answer from making "
    "a span per chunk)",
)

SETTINGS: tuple[Setting, ...] = (
    reconcile_seconds,
    zombie_grace_seconds,
    stuck_steps,
    connector_timeout_seconds,
    whatif_sample_rate,
    exporter_process,
    device_metrics,
    vllm_plugin,
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
    fastapi_exclude_spans,
)
"""Every setting, in the README's order."""

# The variables' names, as the rest of the package writes them.
RECONCILE_SECONDS = reconcile_seconds.variable
ZOMBIE_GRACE_SECONDS = zombie_grace_seconds.variable
STUCK_STEPS = stuck_steps.variable
CONNECTOR_TIMEOUT_SECONDS = connector_timeout_seconds.variable
WHATIF_SAMPLE_RATE = whatif_sample_rate.variable
EXPORTER_PROCESS = exporter_process.variable
DEVICE_METRICS = device_metrics.variable
VLLM_PLUGIN = vllm_plugin.variable
CLIENT_VALUE_LENGTH_LIMIT = client_value_length_limit.variable
EXPORT_MAX_BYTES = export_max_bytes.variable
EXPORT_HOLD_BYTES = export_hold_bytes.variable
EXPORT_HOLD_SECONDS = export_hold_seconds.variable
BAGGAGE_KEYS = baggage_keys.variable
ATTRIBUTION = attribution.variable
ATTRIBUTION_LIMIT = attribution_limit.variable
SESSION_TABLE_SIZE = session_table_size.variable
TOP_SNAPSHOT = top_snapshot.variable
TOP_DIR = top_dir.variable
TOP_REQUESTS = top_requests.variable
FASTAPI_EXCLUDE_SPANS = fastapi_exclude_spans.variable

WARNED_SETTINGS = "OTEL_KVCACHE_WARNED_SETTINGS"
"""JSON list of ``VARIABLE=value`` already warned about in this vLLM instance: not a setting."""


def check_all() -> None:
    """Reads every setting, warning (once per vLLM instance) about each bad one."""
    for setting in SETTINGS:
        setting()


def markdown_table() -> str:
    """The README's configuration table, one row per setting."""
    rows = ["| variable | default | what it sets | a bad value |", "| --- | --- | --- | --- |"]
    for setting in SETTINGS:
        cells = (f"`{setting.variable}`", setting.kind.default_cell(), setting.description,
                 setting.kind.bad_value_cell())  # fmt: skip
        rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows)


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


if __name__ == "__main__":
    # python -m otel_kvcache.config: the table to paste into the README's "Configuration".
    print(markdown_table())
