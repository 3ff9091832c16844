"""``otel-kvcache doctor``: what this vLLM offers the instrumentation, and what it would export.

It prints the installed vLLM and whether it is verified, every hook point and
internal (found, changed or missing, and the telemetry that depends on each),
and how ``opentelemetry-instrument`` (or vLLM's plugin entry point) would
configure the SDK here. It exits 1 when the request span cannot be made.
"""

from __future__ import annotations

import importlib
import inspect
import os
from importlib.metadata import entry_points

from otel_kvcache import config
from otel_kvcache.version import __version__
from otel_kvcache.vllm_compat import (
    CORE_ROLES,
    FEEDS,
    CONNECTOR_HOOK_POINTS,
    HOOK_POINTS,
    PARAMETERS,
    HookPoint,
)
from otel_kvcache.vllm_compat.internals import INTERNALS, is_present
from otel_kvcache.vllm_compat.versions import describe_installed, installed_vllm, installed_vllm_version


def hook_point_status(point: HookPoint) -> tuple[str, str]:
    """``found``, ``changed`` (with how) or ``missing``, for the installed vLLM."""
    try:
        owner = getattr(importlib.import_module(point.module), point.owner)
    except (ImportError, AttributeError):
        return "missing", f"no {point.owner} in {point.module}"
    method = owner.__dict__.get(point.method)
    if method is None:
        inherited = "inherited, not hooked" if callable(getattr(owner, point.method, None)) else "not there"
        return "missing", inherited
    wanted = PARAMETERS.get(point.role)
    if wanted:
        parameters = list(inspect.signature(method).parameters)[1:]  # after the instance
        if tuple(parameters[: len(wanted)]) != wanted:
            return "changed", f"takes ({', '.join(parameters)}), verified with ({', '.join(wanted)}, ...)"
    return "found", ""


def _sdk_lines() -> list[str]:
    lines = []
    for group, what in (("opentelemetry_distro", "distro"), ("opentelemetry_configurator", "configurator")):
        found = sorted(f"{ep.name} ({ep.value})" for ep in entry_points(group=group))
        lines.append(f"  {what}: {', '.join(found) or 'none installed: opentelemetry-instrument configures nothing'}")
    try:
        # The SDK's private functions, as in helper.py: resolving exporters the way
        # opentelemetry-instrument would has no public API.
        from opentelemetry.sdk._configuration import _get_exporter_names, _import_exporters

        for signal in ("traces", "metrics", "logs"):
            # Our distro's default (OTLP) where the variable is unset, as opentelemetry-instrument would set it.
            variable = f"OTEL_{signal.upper()}_EXPORTER"
            saved = os.environ.get(variable)
            os.environ.setdefault(variable, "otlp")
            try:
                names = _get_exporter_names(signal)
                exporters = _import_exporters(*(names if s == signal else [] for s in ("traces", "metrics", "logs")))
                found = [cls.__name__ for group in exporters for cls in group.values()]
                lines.append(f"  {signal}: {os.environ[variable]} -> {', '.join(found) or 'none'}")
            except Exception as exc:  # noqa: BLE001 - that is the finding
                lines.append(f"  {signal}: {os.environ[variable]} -> cannot be loaded: {exc}")
            finally:
                if saved is None:
                    os.environ.pop(variable, None)
    except ImportError as exc:
        lines.append(f"  exporters: the SDK's configuration cannot be read ({exc})")
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317 (the default)")
    lines.append(f"  OTLP endpoint: {endpoint}")
    lines.append(f"  resource detectors: {os.environ.get('OTEL_EXPERIMENTAL_RESOURCE_DETECTORS', 'vllm (the distro default)')}")
    lines.append(f"  vLLM plugin ({config.VLLM_PLUGIN}): {config.vllm_plugin()}")
    return lines


def report() -> tuple[list[str], bool]:
    """The lines to print, and whether the request span can be made."""
    lines = [f"otel-kvcache {__version__}", f"vLLM: {describe_installed()}", "", "hook points:"]
    healthy = installed_vllm() is not None
    installed = installed_vllm_version()
    for point in HOOK_POINTS:
        if not point.applies_to(installed):
            lines.append(f"  {'n/a':8} {point.qualname:48} only before vLLM {point.until}")
            continue
        status, detail = hook_point_status(point)
        healthy &= status == "found" or point.role not in CORE_ROLES
        note = FEEDS[point.role] if status == "found" else f"{detail}; not recorded: {FEEDS[point.role]}"
        lines.append(f"  {status:8} {point.qualname:48} {note}")
    lines += ["", "hook points on an engine with a KV connector (patched on it as it starts):"]
    for point in CONNECTOR_HOOK_POINTS:
        status, detail = hook_point_status(point)
        note = FEEDS[point.role] if status == "found" else f"{detail}; not recorded: {FEEDS[point.role]}"
        lines.append(f"  {status:8} {point.qualname:48} {note}")
    lines += ["", "internals:"]
    for internal in INTERNALS:
        present = is_present(internal)
        healthy &= present or not internal.core
        status = "found" if present else "missing"
        note = internal.feeds if present else f"not recorded: {internal.feeds}"
        lines.append(f"  {status:8} {internal.qualname:48} {note}")
    lines += ["", "OpenTelemetry SDK, as opentelemetry-instrument (or the vLLM plugin) would configure it:", *_sdk_lines()]
    lines += ["", "ready: the request span can be made" if healthy else "NOT READY: the request span cannot be made"]
    return lines, healthy


def main() -> int:
    lines, healthy = report()
    print("\n".join(lines))
    return 0 if healthy else 1
