"""Tells vLLM's processes apart in every exported resource.

vLLM runs an API server, one EngineCore per data-parallel rank and worker
processes. A spawned child initializes the OpenTelemetry SDK at interpreter
start, before it knows what it will become, so its parent names it: when vLLM
starts one of its processes, the child's environment gets ``vllm.process.role``
and ``vllm.engine.index`` (``vllm.worker.rank`` for workers, ``vllm.api_server.index``
for the API servers it starts beside its first process) in
``OTEL_KVCACHE_VLLM_PROCESS``. ``VLLMResourceDetector`` reads them back, typed,
and adds ``process.pid`` and the default ``service.name`` of ``vllm``;
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` still win.

multiprocessing starts processes of its own with the environment of the
moment: the first spawn of an EngineCore starts the resource tracker while the
EngineCore's attributes are in the environment. Those processes are not vLLM's
and take none of them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys

from opentelemetry.sdk.resources import PROCESS_PID, SERVICE_INSTANCE_ID, SERVICE_NAME, Resource, ResourceDetector

from otel_kvcache import names
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.vllm_compat.processes import PROCESS_ROLES

_logger = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "vllm"
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


class VLLMResourceDetector(ResourceDetector):
    """``service.name`` (default), ``process.pid``, and the vLLM role of this process."""

    def detect(self) -> Resource:
        attributes = {SERVICE_NAME: DEFAULT_SERVICE_NAME, PROCESS_PID: os.getpid(), **process_attributes()}
        return Resource(attributes)


def role_of_process(process_name: str) -> dict[str, str | int] | None:
    """Resource attributes for a vLLM child process, from the name vLLM gives it."""
    for pattern, role, rank_attribute in PROCESS_ROLES:
        match = re.fullmatch(pattern, process_name)
        if match:
            attributes: dict[str, str | int] = {names.PROCESS_ROLE: role}
            if rank_attribute is not None:
                attributes[rank_attribute] = int(match.group(1) or 0)
            return attributes
    return None


def name_child_process_wrapper(hook: str, errors: InstrumentationErrors):
    """``multiprocessing``'s ``BaseProcess.start``: name vLLM's children in their environment."""

    def wrapper(wrapped, instance, args, kwargs):
        saved = os.environ.get(PROCESS_ENVIRONMENT_VARIABLE)
        try:
            attributes = role_of_process(instance.name)
            # A worker inherits its engine's attributes (its engine index) and adds its own.
            handed_down = attributes and json.dumps({**json.loads(saved or "{}"), **attributes})
        except Exception as exc:  # noqa: BLE001
            errors.count(hook, exc)
            handed_down = None
        if not handed_down:
            return wrapped(*args, **kwargs)
        # The spawned child copies the environment at start(); vLLM sets its
        # own per-child variables around start() the same way.
        os.environ[PROCESS_ENVIRONMENT_VARIABLE] = handed_down
        try:
            return wrapped(*args, **kwargs)
        finally:
            if saved is None:
                os.environ.pop(PROCESS_ENVIRONMENT_VARIABLE, None)
            else:
                os.environ[PROCESS_ENVIRONMENT_VARIABLE] = saved

    return wrapper
