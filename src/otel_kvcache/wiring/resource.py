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
import os
import re

from opentelemetry.sdk.resources import PROCESS_PID, SERVICE_NAME, Resource, ResourceDetector

from otel_kvcache import names
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.process_identity import PROCESS_ENVIRONMENT_VARIABLE, process_attributes
from otel_kvcache.vllm_compat.processes import PROCESS_ROLES

DEFAULT_SERVICE_NAME = "vllm"


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
