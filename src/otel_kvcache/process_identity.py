"""Which of vLLM's processes this is, as the process that started it handed down.

vLLM's parent processes name each child they start in its environment
(``OTEL_KVCACHE_VLLM_PROCESS``, written by ``wiring.resource``): the resource detector,
the GPU instrumentor and the EngineCore's span helper all read it here.
multiprocessing's own processes (its resource tracker, its forkserver) inherit that
environment without being vLLM's, and take none of it.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from opentelemetry.sdk.resources import PROCESS_PID, SERVICE_INSTANCE_ID

from otel_kvcache import names

_logger = logging.getLogger(__name__)

PROCESS_ENVIRONMENT_VARIABLE = "OTEL_KVCACHE_VLLM_PROCESS"
"""JSON object of resource attributes a vLLM parent process hands its child."""


def _is_api_server(argv: list[str]) -> bool:
    """``python -m vllm.entrypoints...`` or ``vllm serve``, as the interpreter was started."""
    for index, arg in enumerate(argv):
        if arg.startswith("vllm.entrypoints") or (
            os.path.basename(arg) == "vllm" and argv[index + 1 : index + 2] == ["serve"]
        ):
            return True
    return False


# The modules multiprocessing runs its own processes from (``python -c "from <module> import main; ..."``).
_MULTIPROCESSING_OWN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _is_multiprocessings_own(argv: list[str]) -> bool:
    return any(module in arg for arg in argv for module in _MULTIPROCESSING_OWN)


def handed_down_attributes() -> dict[str, str | int]:
    """What the vLLM parent put in this process's environment ({} in a process vLLM did not start)."""
    handed_down = os.environ.get(PROCESS_ENVIRONMENT_VARIABLE)
    if not handed_down or _is_multiprocessings_own(sys.orig_argv):
        return {}
    try:
        return dict(json.loads(handed_down))
    except (ValueError, TypeError):
        _logger.warning("otel-kvcache: ignoring %s=%r: not a JSON object", PROCESS_ENVIRONMENT_VARIABLE, handed_down)
        return {}


def is_vllms_first_process() -> bool:
    """Started by no instrumented vLLM process (an API server, an ``LLM`` script), and none of
    multiprocessing's own processes (its resource tracker or forkserver, which vLLM's first
    process starts, and which inherit what it handed down to another child)."""
    return not handed_down_attributes() and not _is_multiprocessings_own(sys.orig_argv)


def process_attributes() -> dict[str, str | int]:
    """This process's vLLM role attributes: handed down, or the API server's own."""
    attributes = handed_down_attributes()
    # sys.argv is not final yet while the SDK starts; orig_argv is.
    if not attributes and _is_api_server(sys.orig_argv):
        attributes[names.PROCESS_ROLE] = names.ROLE_API_SERVER
    return attributes


def engine_identity() -> dict[str, str | int]:
    """What an EngineCore hands its span helper, so that the helper's spans and metrics
    are the engine's resource: its role attributes, its pid and its ``service.instance.id``
    (the SDK's, one random id per process, where it makes one)."""
    from opentelemetry import trace

    resource = getattr(trace.get_tracer_provider(), "resource", None)
    instance = resource.attributes.get(SERVICE_INSTANCE_ID) if resource is not None else None
    identity = {**process_attributes(), PROCESS_PID: os.getpid()}
    if isinstance(instance, str):
        identity[SERVICE_INSTANCE_ID] = instance
    return identity
