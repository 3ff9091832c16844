"""The OTLP endpoint spans go to, and whether anything answers there.

An exporter that fails says only that it failed. When a receiver takes nothing, the
words for it depend on why: nothing listening (refused, unknown host, no answer) is
the collector being unreachable; a receiver that answers and refuses is an error of
its own, which the OpenTelemetry exporter logs. ``unreachable`` tells them apart by
connecting, as ``doctor`` does to check the endpoint it reports.
"""

from __future__ import annotations

import os
import socket
import urllib.parse

from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)

DEFAULT_ENDPOINTS = {"grpc": "http://localhost:4317", "http/protobuf": "http://localhost:4318/v1/traces"}
"""The OTLP exporters' defaults, by protocol (the specification's)."""
CONNECT_SECONDS = 2.0


def span_endpoint() -> tuple[str, str]:
    """``(endpoint, protocol)`` of the OTLP span exporter this environment configures, as the
    SDK resolves them (the distro's default protocol, gRPC, where none is set)."""
    protocol = os.environ.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or os.environ.get(OTEL_EXPORTER_OTLP_PROTOCOL, "grpc")
    endpoint = os.environ.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
    if not endpoint:
        endpoint = os.environ.get(OTEL_EXPORTER_OTLP_ENDPOINT)
        if endpoint and protocol != "grpc":
            endpoint = endpoint.rstrip("/") + "/v1/traces"
    return endpoint or DEFAULT_ENDPOINTS.get(protocol, DEFAULT_ENDPOINTS["grpc"]), protocol


def unreachable(endpoint: str, timeout: float = CONNECT_SECONDS) -> str | None:
    """Why nothing answers at ``endpoint`` (a URL, or gRPC's ``host:port``); None when
    something accepted a connection there."""
    parts = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return f"{endpoint} is not host:port"
    try:
        with socket.create_connection((parts.hostname or "localhost", port), timeout=timeout):
            return None
    except socket.gaierror:
        return f"unknown host {parts.hostname}"
    except TimeoutError:
        return f"no answer in {timeout:g} s"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()
