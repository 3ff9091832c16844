"""Reading ``Scheduler.schedule()``'s own frame: what its locals say that no hook is given.

A preemption is made inside ``schedule()`` to make room for the request its running
loop is allocating for; whether a step's waiting loop ended on an allocation failure
is its last ``allocate_slots`` result. Both are locals of vLLM's method (``internals``
checks that the installed release has them), read from the frame of the call running
now, or of the one that just returned.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from otel_kvcache.vllm_compat import internals

SCHEDULE_REQUEST_LOCAL = "request"
"""The local of ``Scheduler.schedule``'s running loop holding the request it is
giving blocks to, when it preempts another (or that one) to make room (0.30-0.34)."""


def request_being_scheduled() -> Any | None:
    """The request whose allocation failed when ``schedule()`` preempts to make room.

    Read only on a preemption; None when called from elsewhere (``reset_prefix_cache``
    preempts too), or where vLLM's ``schedule`` has no such local (``internals``).
    """
    if not internals.has("schedule_request_local"):
        return None
    frame = _schedule_frame()
    return None if frame is None else frame.f_locals.get(SCHEDULE_REQUEST_LOCAL)


def _schedule_frame() -> FrameType | None:
    """The frame of the ``Scheduler.schedule`` call running now (under ours), or None."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != "schedule":
        frame = frame.f_back
    return frame


SCHEDULE_ALLOCATION_LOCAL = "new_blocks"
"""The local of ``Scheduler.schedule`` holding its latest ``allocate_slots`` result: None
when the waiting loop's last allocation failed, after which vLLM admits no more (0.30-0.34;
its running loop leaves it None only when it preempted, and then skips the waiting loop)."""


def allocation_watch(vllm_config: Any) -> Callable[[], Any] | None:
    """Called at an admission attempt: returns what tells, once ``schedule()`` returned,
    whether that step ended on an allocation failure (``allocation_failed``).

    None where nothing but a failed allocation leaves the step's last attempt waiting,
    so that the engine thread pays nothing for it (a frame read at every admission attempt,
    ``docs/overhead.md#allocation-stalls``): vLLM holds a request back only
    with ``--max-num-inflight-kv-loads`` (0.34) and skips one under encoder-cache
    pressure only for multimodal input. None too where ``schedule`` has no such local."""
    holds_back = getattr(vllm_config.scheduler_config, "max_num_inflight_kv_loads", None) is not None
    model = vllm_config.model_config
    multimodal = model is not None and getattr(model, "is_multimodal_model", False)
    if not (holds_back or multimodal) or not internals.has("schedule_allocation_local"):
        return None
    return _schedule_frame


def allocation_failed(schedule_frame: FrameType | None) -> bool:
    """Whether the step whose ``schedule()`` frame this is (returned: its locals stay
    readable) ended its waiting loop on an allocation failure. A request that vLLM
    skipped (0.34's encoder-cache pressure, a connector not ready) or held back (0.34's
    ``--max-num-inflight-kv-loads``) stays waiting with no failure: no stall."""
    if schedule_frame is None:
        return True
    return schedule_frame.f_locals.get(SCHEDULE_ALLOCATION_LOCAL, ()) is None
