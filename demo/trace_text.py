"""One trace as an indented tree of text, from the spans an OTLP receiver got.

For the README and a test's output: each span with its service, its duration,
the KV attributes that tell the story, and its links.
"""

from __future__ import annotations

from collections.abc import Iterable

from demo.otlp_sink import attributes_of
from otel_kvcache import names

SHOWN = (
    names.CONNECTOR_ROLE, names.CONNECTOR_NAME, names.INPUT_TOKENS, names.OUTPUT_TOKENS,
    names.CACHE_READ_INPUT_TOKENS, names.CONNECTOR_HIT_TOKENS, names.CONNECTOR_WAIT_SECONDS,
    names.CONNECTOR_DELAYED_FREE_SECONDS, names.BLOCKS_PEAK, names.FINISH_REASON,
)  # fmt: skip
"""The span attributes shown, in this order, where a span has them."""


def render_trace(spans: Iterable[tuple[dict, object]]) -> str:
    """``spans``: (resource attributes, OTLP span) of one trace, as ``OTLPSink.spans()`` gives them."""
    spans = list(spans)
    by_id = {span.span_id: (resource, span) for resource, span in spans}
    children: dict[bytes, list] = {}
    for resource, span in sorted(spans, key=lambda pair: pair[1].start_time_unix_nano):
        parent = span.parent_span_id if span.parent_span_id in by_id else b""
        children.setdefault(parent, []).append((resource, span))
    names_by_id = {span.span_id: f"{resource.get('service.name')} {span.name}" for resource, span in spans}
    lines = [f"trace {spans[0][1].trace_id.hex()}" if spans else "no spans"]

    def walk(parent: bytes, depth: int) -> None:
        for resource, span in children.get(parent, ()):
            milliseconds = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
            lines.append(f"{'  ' * depth}{resource.get('service.name')}: {span.name} ({milliseconds:.0f} ms)")
            attributes = attributes_of(span.attributes)
            shown = [f"{key}={_value(attributes[key])}" for key in SHOWN if key in attributes]
            for key_values in _chunks(shown, 3):
                lines.append(f"{'  ' * (depth + 2)}{'  '.join(key_values)}")
            for link in span.links:
                lines.append(f"{'  ' * (depth + 2)}link -> {names_by_id.get(link.span_id, link.span_id.hex())}")
            walk(span.span_id, depth + 1)

    walk(b"", 1)
    return "\n".join(lines)


def _value(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]
