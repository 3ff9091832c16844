"""What every chart of the report shares: one time axis, one width, one palette.

The time charts are drawn one above the other on the same seconds-since-start
axis, so a preemption burst in the pool lines up with the requests it hit.
Red means preemption everywhere; the finish reasons' colours avoid it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

WIDTH = 960
"""Pixels of plot area of the time charts."""
Y_AXIS_EXTENT = 200
"""Pixels every time chart gives its y axis (the request ids need them), so that
their plot areas start at the same x and their time axes line up."""

STATE_COLOURS = {"used": "#1f5f99", "cached": "#54a24b", "free": "#dcdcdc"}
MARK_COLOURS = {"preemptions": "#d62728", "allocation stalls": "#ff9d00", "leak findings": "#7b2cbf"}
FINISH_COLOURS = {
    "stop": "#4c78a8",
    "length": "#72b7b2",
    "abort": "#f58518",
    "error": "#7b2cbf",
    "repetition": "#9d755d",
    "ignored": "#bab0ac",
}
OTHER_FINISH = "#888888"


@dataclass(frozen=True)
class TimeBase:
    """Nanosecond timestamps as seconds since the first one in the files."""

    origin: int
    end: int

    def seconds(self, time_ns: int) -> float:
        return round((time_ns - self.origin) / 1e9, 4)

    @property
    def domain(self) -> list[float]:
        return [0.0, max(self.seconds(self.end), 0.001)]


def y_axis(**properties) -> dict:
    """Axis properties of a time chart's y axis: the common extent, and any others."""
    return {"minExtent": Y_AXIS_EXTENT, "maxExtent": Y_AXIS_EXTENT, **properties}


def time_title(base: TimeBase) -> str:
    started = datetime.fromtimestamp(base.origin / 1e9, tz=timezone.utc)
    return f"seconds since {started:%Y-%m-%d %H:%M:%S} UTC"


def finish_scale(reasons) -> tuple[list[str], list[str]]:
    """Colour scale domain and range for the finish reasons present."""
    domain = sorted(set(reasons))
    return domain, [FINISH_COLOURS.get(reason, OTHER_FINISH) for reason in domain]


@dataclass
class Figure:
    """One chart of the report: its Altair chart, and the data it reads by name.

    The data sits in the spec's top-level ``datasets``, under stable names, so
    the page can be read back (the tests do) without knowing Altair's hashes.
    """

    key: str
    title: str
    note: str
    chart: object
    datasets: dict[str, list[dict]] = field(default_factory=dict)

    def spec(self) -> dict:
        spec = self.chart.to_dict()
        spec["datasets"] = self.datasets
        return spec
