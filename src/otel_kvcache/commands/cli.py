"""The ``otel-kvcache`` command."""

from __future__ import annotations

import sys

from otel_kvcache.commands.command_line import CommandLine
from otel_kvcache.commands.report import command as report
from otel_kvcache.commands.top import command as top


def main(argv: list[str] | None = None) -> int:
    parser = CommandLine(prog="otel-kvcache", description="OpenTelemetry for vLLM's KV cache.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("doctor", help="what the installed vLLM offers the instrumentation, and what it would export")
    report.add_arguments(
        commands.add_parser("report", help="one HTML file: what the KV cache did, from OTLP JSON files")
    )
    top.add_arguments(
        commands.add_parser("top", help="the KV cache of every instrumented engine on this host, live (or a fleet's)")
    )
    arguments = parser.parse_args(argv)
    if arguments.command == "doctor":
        from otel_kvcache.commands.doctor import main as doctor

        return doctor()
    if arguments.command == "report":
        return report.run(arguments)
    if arguments.command == "top":
        return top.run(arguments)
    return 2


if __name__ == "__main__":
    sys.exit(main())
