"""The names this package's metrics and attributes take in a Prometheus exposition.

The OpenTelemetry specification's translation (``compatibility/prometheus_and_openmetrics.md``),
as ``opentelemetry-exporter-prometheus`` applies it: each run of characters a Prometheus
name may not hold becomes ``_``, the unit is spelled out as a suffix (a UCUM
``{annotation}`` and the dimensionless ``1`` add none), and a counter ends in ``_total``.
That exporter is no dependency of this package; a test holds these names to its output.
"""

from __future__ import annotations

import re

_NOT_IN_A_METRIC_NAME = re.compile(r"[^a-zA-Z0-9:]+")
_NOT_IN_A_LABEL_NAME = re.compile(r"[^a-zA-Z0-9]+")
_ANNOTATION = re.compile(r"{.*}")
_UNIT_WORDS = {"s": "seconds", "By": "bytes", "1": ""}
"""The UCUM units of this package's metrics, as the specification spells them out."""


def _sanitized(name: str, invalid: re.Pattern) -> str:
    if name[:1].isdigit():
        name = "_" + name[1:]
    return invalid.sub("_", name)


def metric(name: str, unit: str = "", counter: bool = False) -> str:
    """The exposition's name of a metric: of its samples, or of a counter's ``_total`` samples."""
    exposed = _sanitized(name, _NOT_IN_A_METRIC_NAME)
    if counter:
        exposed = exposed.removesuffix("_total")
    unit = _ANNOTATION.sub("", unit)
    suffix = _UNIT_WORDS.get(unit, _NOT_IN_A_METRIC_NAME.sub("_", unit).strip("_"))
    if suffix and not exposed.endswith(f"_{suffix}"):
        exposed += f"_{suffix}"
    return exposed + "_total" if counter else exposed


def label(attribute: str) -> str:
    """The exposition's label name of an attribute."""
    return _sanitized(attribute, _NOT_IN_A_LABEL_NAME)
