"""``otel-kvcache doctor``: what this vLLM offers the instrumentation, and what it would export.

It prints the installed vLLM and whether it is verified, every hook point and
internal (found, read from a fallback, changed or missing, and the telemetry
that depends on each: ``vllm_compat.survey``, as the engine's start-up line),
and how ``opentelemetry-instrument`` (or vLLM's plugin entry point) would
configure the SDK here, and every setting's value in use (``config.SETTINGS``), naming
a bad one. It exits 1 when the request span cannot be made.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

from otel_kvcache import config, names
from otel_kvcache.export.collector import span_endpoint, unreachable
from otel_kvcache.version import __version__
from otel_kvcache.vllm_compat import survey
from otel_kvcache.vllm_compat.versions import describe_installed, installed_vllm, is_verified


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
                exporter_names = _get_exporter_names(signal)
                chosen = (exporter_names if s == signal else [] for s in ("traces", "metrics", "logs"))
                exporters = _import_exporters(*chosen)
                found = [cls.__name__ for group in exporters for cls in group.values()]
                lines.append(f"  {signal}: {os.environ[variable]} -> {', '.join(found) or 'none'}")
            except Exception as exc:  # noqa: BLE001 - that is the finding
                lines.append(f"  {signal}: {os.environ[variable]} -> cannot be loaded: {exc}")
            finally:
                if saved is None:
                    os.environ.pop(variable, None)
    except ImportError as exc:
        lines.append(f"  exporters: the SDK's configuration cannot be read ({exc})")
    lines.append(_endpoint_line())
    lines.append(f"  resource detectors: {os.environ.get('OTEL_EXPERIMENTAL_RESOURCE_DETECTORS', 'vllm (the distro default)')}")
    lines.append(f"  vLLM plugin ({config.VLLM_PLUGIN}): {config.vllm_plugin()}")
    return lines


def _endpoint_line() -> str:
    """Where spans would go, and whether something answers there: a warning, not a reason
    for NOT READY (vLLM serves either way, and lost spans are counted)."""
    endpoint, protocol = span_endpoint()
    if "otlp" not in os.environ.get("OTEL_TRACES_EXPORTER", "otlp"):
        return f"  OTLP endpoint: not used (OTEL_TRACES_EXPORTER={os.environ['OTEL_TRACES_EXPORTER']})"
    reason = unreachable(endpoint)
    if reason is None:
        return f"  OTLP endpoint: {endpoint} ({protocol}): something answered"
    return (
        f"  OTLP endpoint: {endpoint} ({protocol}): WARNING: unreachable ({reason}); vLLM would serve, "
        f"and the spans it could not send would be counted in {names.TELEMETRY_DROPPED}"
    )


def report() -> tuple[list[str], bool]:
    """The lines to print, and whether the request span can be made."""
    lines = [f"otel-kvcache {__version__}", f"vLLM: {describe_installed()}"]
    if installed_vllm() is not None and not is_verified():
        lines.append(
            "  not a release otel-kvcache was verified on: what is found below is hooked and read; "
            "what is changed or missing is switched off, and everything else is recorded"
        )
    engine = survey.survey()
    healthy = installed_vllm() is not None and survey.spans_possible(engine)
    lines += ["", "hook points:", *_finding_lines(f for f in engine if f.kind == "hook point")]
    lines += ["", "hook points on an engine with a KV connector (patched on it as it starts):"]
    lines += _finding_lines(survey.connector_hook_points())
    lines += ["", "internals:", *_finding_lines(f for f in engine if f.kind == "internal")]
    lines += ["", "OpenTelemetry SDK, as opentelemetry-instrument (or the vLLM plugin) would configure it:", *_sdk_lines()]
    lines += ["", "settings (from the environment; README.md, Configuration):", *_setting_lines()]
    lines += ["", "ready: the request span can be made" if healthy else f"NOT READY: {survey.NO_SPANS}"]
    return lines, healthy


def _setting_lines() -> list[str]:
    """Each setting's value in use: the default where it is unset, and where its value is bad,
    what is wrong with it (the warning vLLM's first process would log)."""
    lines = []
    for setting in config.SETTINGS:
        reading = setting.reading()
        value = reading.value
        if value is None:
            shown = "auto"
        elif isinstance(value, list):
            shown = ",".join(value) or "none"
        else:
            shown = f"{value:g}" if isinstance(value, float) else str(value)
        if reading.complaint is not None:
            shown += f"  WARNING: {reading.raw!r} {reading.complaint}"
        elif reading.raw is None or not reading.raw.strip():
            shown += " (not set)"
        lines.append(f"  {setting.variable:40} {shown}")
    return lines


def _finding_lines(findings) -> list[str]:
    lines = []
    for finding in findings:
        if finding.status == "n/a":
            note = finding.detail
        elif finding.status == "found":
            note = f"{finding.feeds} ({finding.detail})" if finding.detail else finding.feeds
        else:
            detail = f"{finding.detail}; " if finding.detail else ""
            note = f"{detail}not recorded: {finding.costs}"
        lines.append(f"  {finding.status:8} {finding.qualname:48} {note}")
    return lines


def main() -> int:
    lines, healthy = report()
    print("\n".join(lines))
    return 0 if healthy else 1
