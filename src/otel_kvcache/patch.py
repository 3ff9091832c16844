"""Wrapper factories, one per role in ``vllm_compat.HOOK_POINTS``.

Every wrapper has the same skeleton (``_observing``): it calls vLLM's original
exactly once, lets vLLM's exceptions through unchanged, and runs our code in
guarded blocks whose failures are counted and logged once per kind. Objects
built before ``instrument()`` carry no telemetry and pass straight through.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry.instrumentation.utils import is_instrumentation_enabled
from opentelemetry.trace import Tracer

from otel_kvcache.engine import EngineTelemetry
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.instruments import KVCacheInstruments
from otel_kvcache.propagation import attach_trace_context_wrapper, remember_trace_headers_wrapper
from otel_kvcache.resource import name_child_process_wrapper
from otel_kvcache.vllm_compat import first_argument, request_being_scheduled

ENGINE_ATTRIBUTE = "_otel_kvcache_engine"
"""Set on each instrumented Scheduler, its KVCacheManager and its BlockPool."""

Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]
Before = Callable[[EngineTelemetry, Any, tuple, dict], Any]
After = Callable[[EngineTelemetry, Any, tuple, dict, Any, Any], None]


def _observing(hook: str, errors: InstrumentationErrors, after: After, before: Before | None = None) -> Wrapper:
    def wrapper(wrapped, instance, args, kwargs):
        engine = getattr(instance, ENGINE_ATTRIBUTE, None)
        if engine is None or not is_instrumentation_enabled():
            return wrapped(*args, **kwargs)
        state = None
        if before is not None:
            try:
                state = before(engine, instance, args, kwargs)
            except Exception as exc:  # noqa: BLE001 - ours, never vLLM's
                errors.record(hook, exc)
                return wrapped(*args, **kwargs)
        result = wrapped(*args, **kwargs)
        try:
            after(engine, instance, args, kwargs, result, state)
        except Exception as exc:  # noqa: BLE001
            errors.record(hook, exc)
        return result

    return wrapper


def scheduler_init_wrapper(
    hook: str, tracer: Tracer, instruments: KVCacheInstruments, errors: InstrumentationErrors
) -> Wrapper:
    def wrapper(wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        if not is_instrumentation_enabled():
            return
        try:
            engine = EngineTelemetry(instance, tracer, instruments, errors)
            manager = instance.kv_cache_manager
            for owner in (instance, manager, manager.block_pool):
                setattr(owner, ENGINE_ATTRIBUTE, engine)
        except Exception as exc:  # noqa: BLE001
            errors.record(hook, exc)

    return wrapper


def _request_added(engine, scheduler, args, kwargs, result, state):
    engine.on_request_added(first_argument(args, kwargs, "request"))


def _scheduled(engine, scheduler, args, kwargs, output, state):
    engine.on_scheduled(output)


def _admission_attempted(engine, scheduler, args, kwargs, result, state):
    engine.on_admission_attempt(first_argument(args, kwargs, "request"))


def _prefix_lookup(engine, manager, args, kwargs, result, state):
    request = first_argument(args, kwargs, "request")
    num_hits = args[1] if len(args) > 1 else kwargs["num_hits"]
    engine.on_prefix_cache_lookup(request, num_hits, counted=manager.prefix_cache_lookup_enabled(request))


def _before_preempt(engine, scheduler, args, kwargs):
    stalled = request_being_scheduled()
    if stalled is not None:
        engine.on_stall(stalled)
    return engine.before_preempt(first_argument(args, kwargs, "request"))


def _preempted(engine, scheduler, args, kwargs, result, held_and_computed):
    engine.on_preempted(first_argument(args, kwargs, "request"), held_and_computed)


def _before_release(engine, scheduler, args, kwargs):
    return engine.before_release(first_argument(args, kwargs, "request"))


def _released(engine, scheduler, args, kwargs, result, freed):
    engine.on_released(first_argument(args, kwargs, "request"), freed)


def _step_end(engine, scheduler, args, kwargs, result, state):
    engine.on_step_end()


def _before_allocating(engine, pool, args, kwargs):
    return engine.pool.before_allocating(first_argument(args, kwargs, "num_blocks"))


def _evicted(engine, pool, args, kwargs, result, evicted):
    engine.pool.on_evicted(evicted)


def _before_evicting(engine, pool, args, kwargs):
    return engine.pool.before_evicting(first_argument(args, kwargs, "block_ids"))


def _before_touch(engine, pool, args, kwargs):
    engine.pool.on_touching(first_argument(args, kwargs, "blocks"))


def _nothing_after(engine, instance, args, kwargs, result, state):
    pass


def _prefix_cache_reset(engine, pool, args, kwargs, succeeded, state):
    if succeeded:
        engine.pool.on_reset()


def _free_blocks_factory(hook: str, errors: InstrumentationErrors) -> Wrapper:
    """``free_blocks`` takes any iterable (vLLM passes ``reversed(...)``): we
    materialize it once so both vLLM and the tracker see every block."""

    def wrapper(wrapped, instance, args, kwargs):
        engine = getattr(instance, ENGINE_ATTRIBUTE, None)
        if engine is None or not is_instrumentation_enabled() or len(args) != 1 or kwargs:
            return wrapped(*args, **kwargs)
        blocks = list(args[0])
        result = wrapped(blocks)
        try:
            engine.pool.on_freed(blocks)
        except Exception as exc:  # noqa: BLE001
            errors.record(hook, exc)
        return result

    return wrapper


def build_wrappers(
    tracer: Tracer, instruments: KVCacheInstruments, errors: InstrumentationErrors
) -> dict[str, Callable[[str], Wrapper]]:
    """Role -> a factory taking the hook's name; factories run only once vLLM is imported."""

    def observing(after: After, before: Before | None = None) -> Callable[[str], Wrapper]:
        return lambda hook: _observing(hook, errors, after, before)

    return {
        "scheduler_init": lambda hook: scheduler_init_wrapper(hook, tracer, instruments, errors),
        "request_added": observing(_request_added),
        "preempt": observing(_preempted, _before_preempt),
        "release": observing(_released, _before_release),
        "step_end": observing(_step_end),
        "scheduled": observing(_scheduled),
        "admission_attempt": observing(_admission_attempted),
        "prefix_lookup": observing(_prefix_lookup),
        "allocate_blocks": observing(_evicted, _before_allocating),
        "evict_blocks": observing(_evicted, _before_evicting),
        "free_blocks": lambda hook: _free_blocks_factory(hook, errors),
        "touch": observing(_nothing_after, _before_touch),
        "reset_prefix_cache": observing(_prefix_cache_reset),
        "remember_trace_headers": lambda hook: remember_trace_headers_wrapper(),
        "attach_trace_context": lambda hook: attach_trace_context_wrapper(hook, errors),
        "name_child_process": lambda hook: name_child_process_wrapper(hook, errors),
    }
