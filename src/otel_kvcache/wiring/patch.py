"""Wrapper factories, one per role in ``vllm_compat.hook_points``.

Every wrapper calls vLLM's original exactly once, lets vLLM's exceptions
through unchanged, and runs our code in guarded blocks whose failures are
counted and logged once per kind. Objects built before ``instrument()`` carry
no telemetry and pass straight through.

Two shapes, by the hook point's ``hot`` flag:

- hot (the engine loop's, a few calls a step): the factory returns a
  *method builder*, ``build(original) -> method``; the method replaces vLLM's
  on the class and calls ``original`` itself, a plain function that takes the
  instance first (``hooks.as_vllm_calls_it``). Each factory is written as the
  closure it builds, taking ``(self, *args, **kwargs)``, and ``_method_builder``
  gives it vLLM's exact parameters (``signatures.method_like``), so that vLLM's
  call sites stay specialized;
- cold (start-up, the API server): a wrapt wrapper,
  ``wrapper(wrapped, instance, args, kwargs)``.

Our functions get vLLM's arguments as vLLM passed them, so their parameters
carry vLLM's names.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import MethodType
from typing import Any

from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_kvcache.engine.connectors import ConnectorTelemetry
from otel_kvcache.engine.instruments import KVCacheInstruments
from otel_kvcache.engine.live_snapshot import SnapshotPublisher
from otel_kvcache.engine.pool import PoolTracker
from otel_kvcache.engine.telemetry import EngineTelemetry
from otel_kvcache.errors import InstrumentationErrors
from otel_kvcache.handover.record import RecordSink
from otel_kvcache.version import __version__
from otel_kvcache.vllm_compat.blocks import free_queue
from otel_kvcache.vllm_compat.hook_points import CONNECTOR_HOOK_POINTS, OFFLOAD_TIER_HOOK_POINTS
from otel_kvcache.vllm_compat.kv_transfer import kv_connector
from otel_kvcache.vllm_compat.offload_tier import remember_tier_bytes
from otel_kvcache.vllm_compat.readers import engine_index
from otel_kvcache.vllm_compat.survey import start_up
from otel_kvcache.wiring.hooks import Wrapper, as_vllm_calls_it
from otel_kvcache.wiring.propagation import (
    attach_trace_context_wrapper,
    recover_trace_headers_wrapper,
    remember_trace_headers_wrapper,
)
from otel_kvcache.wiring.resource import name_child_process_wrapper
from otel_kvcache.wiring.signatures import method_like

_vllm_log = logging.getLogger("vllm.otel_kvcache")

ENGINE_ATTRIBUTE = "_otel_kvcache_engine"
"""Set on each Scheduler built while instrumented, its KVCacheManager, BlockPool and free
queue: its ``EngineTelemetry``, or None where instrumentation was suppressed. The hot
wrappers read it as a plain attribute, ``self._otel_kvcache_engine``, which CPython
specializes, as it cannot a call of ``getattr(self, ENGINE_ATTRIBUTE, None)``
(``docs/overhead.md#hot-wrappers``). An object that has none (built
before ``instrument()``, on a release the start-up survey found not ready, or a second block
pool such as hisparse's host pool) makes each read raise AttributeError, dearer than a
generic call, and the wrapper passes vLLM's call straight through, outside the
handler. A class-level default of None would spare those calls the exception."""

RecordSinkFactory = Callable[[], RecordSink]
"""Returns where a new engine hands its released requests (``handover.record.RecordSink``)."""
Method = Callable[..., Any]
"""vLLM's method, or ours in its place."""
MethodBuilder = Callable[[Method], Method]
EngineMethod = Callable[..., Any]
"""An ``EngineTelemetry`` function, called with the engine first."""


def _method_builder(make_method: Callable[..., Callable[..., Any]]) -> Callable[..., MethodBuilder]:
    """``make_method(original, *setup)``, a closure calling ``original``, made a factory:
    ``factory(*setup)`` is a ``MethodBuilder``, and the method it builds is the closure
    compiled again with ``original``'s parameters (``signatures.method_like``)."""

    @functools.wraps(make_method)
    def factory(*setup: Any, **named_setup: Any) -> MethodBuilder:
        return lambda original: method_like(original, make_method(original, *setup, **named_setup))

    return factory


@_method_builder
def _after(
    original: Method,
    hook: str,
    errors: InstrumentationErrors,
    on_call: EngineMethod,
    *,
    given_result: bool = False,
) -> Method:
    """After vLLM's call, ``on_call(engine, <vLLM's arguments>)``, or with ``given_result``,
    ``on_call(engine, <vLLM's result>)``."""

    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            engine = self._otel_kvcache_engine  # ENGINE_ATTRIBUTE, as a name CPython specializes
        except AttributeError:  # built before instrument()
            return result
        if engine is None:  # a scheduler left uninstrumented
            return result
        try:
            if given_result:
                on_call(engine, result)
            else:
                on_call(engine, *args, **kwargs)
        except Exception as exc:  # ours, never vLLM's
            errors.count(hook, exc)
        return result

    return method


@_method_builder
def _tracking_pool(original: Method, hook: str, errors: InstrumentationErrors, before: Callable[..., None]) -> Method:
    """Block-pool and free-queue hooks, with nothing to do after vLLM's call:
    ``before(engine.pool, <vLLM's arguments>)``, a ``PoolTracker`` method."""

    def method(self, *args, **kwargs):
        try:
            pool = self._otel_kvcache_engine.pool
        except AttributeError:  # built before instrument(), or its engine left uninstrumented (None)
            pool = None
        if pool is not None:
            try:
                before(pool, *args, **kwargs)
            except Exception as exc:  # ours, never vLLM's
                errors.count(hook, exc)
        return original(self, *args, **kwargs)  # outside the handlers: vLLM's exceptions chain none of ours

    return method


@_method_builder
def _around(
    original: Method, hook: str, errors: InstrumentationErrors, before: EngineMethod, after: EngineMethod
) -> Method:
    """``state = before(engine, request)`` and ``after(engine, request, state)`` around
    vLLM's call, given vLLM's request (the argument after the instance)."""

    def method(self, *args, **kwargs):
        try:
            engine = self._otel_kvcache_engine
        except AttributeError:
            engine = None
        if engine is not None:
            try:
                state = before(engine, args[0])
            except Exception as exc:  # ours, never vLLM's
                errors.count(hook, exc)
                engine = None  # and nothing after
        result = original(self, *args, **kwargs)  # outside the handlers: vLLM's exceptions chain none of ours
        if engine is not None:
            try:
                after(engine, args[0], state)
            except Exception as exc:  # ours, never vLLM's
                errors.count(hook, exc)
        return result

    return method


# --- per engine: the KV connector's hook points -------------------------------------
#
# Patched on one scheduler and its connector object (``CONNECTOR_HOOK_POINTS``) by
# ``patch_connector_hooks``, each bound to that engine's ``ConnectorTelemetry``: no
# lookup of the engine, and nothing at all on an engine without a connector. Each
# calls what the class had when the engine started: a wrapper another tool puts on
# the class later reaches engines started after it.


@_method_builder
def _bound_around(
    original: Method,
    hook: str,
    errors: InstrumentationErrors,
    before: Callable[..., Any],
    after: Callable[[Any], None] | None = None,
) -> Method:
    """``state = before(<vLLM's arguments>)``, vLLM's call, then ``after(state)`` where
    there is an ``after`` and the state is not None."""

    def method(self, *args, **kwargs):
        try:
            state = before(*args, **kwargs)
        except Exception as exc:  # ours, never vLLM's
            errors.count(hook, exc)
            state = None
        result = original(self, *args, **kwargs)
        if after is not None and state is not None:
            try:
                after(state)
            except Exception as exc:  # ours, never vLLM's
                errors.count(hook, exc)
        return result

    return method


@_method_builder
def _bound_after(original: Method, hook: str, errors: InstrumentationErrors, after: Callable[..., None]) -> Method:
    """vLLM's call, then ``after(<vLLM's result>, <vLLM's arguments>)``."""

    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            after(result, *args, **kwargs)
        except Exception as exc:  # ours, never vLLM's
            errors.count(hook, exc)
        return result

    return method


@_method_builder
def _bound_result(
    original: Method, hook: str, errors: InstrumentationErrors, on_result: Callable[[Any, Any], Any]
) -> Method:
    """vLLM's call, then ``on_result(<vLLM's first argument>, result)``, which returns the
    result vLLM gets (vLLM's own when ours fails)."""

    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            return on_result(args[0], result)
        except Exception as exc:  # ours, never vLLM's
            errors.count(hook, exc)
            return result

    return method


def patch_connector_hooks(scheduler: Any, connectors: ConnectorTelemetry, errors: InstrumentationErrors) -> None:
    """Binds the connector's hook points to this scheduler and its connector object, and
    those of its offload tier to the tier's manager. A point the installed vLLM lacks is
    reported once by name, as the class-level ones are; one we fail to bind is counted and
    left as vLLM's."""
    builders = {
        "connector_output": lambda hook: _bound_around(hook, errors, connectors.before_output, connectors.after_output),
        "finished": lambda hook: _bound_after(hook, errors, connectors.on_finished),
        "connector_allocated": lambda hook: _bound_around(hook, errors, connectors.on_allocated),
        "connector_finished": lambda hook: _bound_result(hook, errors, connectors.on_request_finished),
    }
    points, targets = CONNECTOR_HOOK_POINTS, {"Scheduler": scheduler}
    tier = connectors.tier
    if tier is not None:
        builders.update({
            "tier_store_prepared": lambda hook: _bound_after(hook, errors, tier.on_store_prepared),
            "tier_load_prepared": lambda hook: _bound_after(hook, errors, tier.on_load_prepared),
            "tier_store_completed": lambda hook: _bound_after(hook, errors, tier.on_store_completed),
            "tier_reset": lambda hook: _bound_after(hook, errors, tier.on_reset),
        })  # fmt: skip
        points, targets["OffloadingManager"] = points + OFFLOAD_TIER_HOOK_POINTS, tier.manager
    connector = kv_connector(scheduler)
    for point in points:
        target = targets.get(point.owner, connector)
        original = getattr(type(target), point.method, None)
        if original is None:  # a connector without several KV-cache groups has no request_finished_all_groups
            if point.owner != "SupportsHMA":
                _vllm_log.warning("otel-kvcache: vLLM has no %s; not recorded: %s", point.qualname, point.feeds)
            continue
        try:
            method = builders[point.role](point.qualname)(as_vllm_calls_it(original))
            bound = MethodType(functools.wraps(original)(method), target)
            setattr(target, point.method, bound)
        except Exception as exc:  # noqa: BLE001 - e.g. a connector whose parameters we cannot copy
            errors.count(point.qualname, exc)
            continue
        connectors.patched.append((target, point.method, bound))


def unpatch_connector_hooks(connectors: ConnectorTelemetry) -> None:
    """Takes our bound methods off the scheduler and its connector (``uninstrument()``)."""
    for target, method, bound in connectors.patched:
        if vars(target).get(method) is bound:
            delattr(target, method)
    connectors.patched.clear()


def _feeds(scheduler: Any, engine: EngineTelemetry | None) -> None:
    """Sets which engine the hot wrappers feed on the scheduler's objects (``ENGINE_ATTRIBUTE``)."""
    manager = scheduler.kv_cache_manager
    for owner in (scheduler, manager, manager.block_pool, free_queue(manager.block_pool)):
        setattr(owner, ENGINE_ATTRIBUTE, engine)


def offload_tier_init_wrapper(hook: str, errors: InstrumentationErrors) -> Wrapper:
    """Keeps the tier's bytes per block, from the spec the connector's scheduler side is built from."""

    def wrapper(wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        try:
            remember_tier_bytes(instance, args[0] if args else kwargs["spec"])
        except Exception as exc:  # noqa: BLE001
            errors.count(hook, exc)

    return wrapper


def scheduler_init_wrapper(
    hook: str,
    record_sink_for: RecordSinkFactory,
    instruments: KVCacheInstruments,
    errors: InstrumentationErrors,
    publisher: SnapshotPublisher | None,
) -> Wrapper:
    def wrapper(wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        if not is_instrumentation_enabled():
            try:
                _feeds(instance, None)  # the hot wrappers pass straight through, without an AttributeError a call
            except Exception as exc:  # noqa: BLE001
                errors.count(hook, exc)
            return
        engine = None
        try:
            # In vLLM's own log (its logger's handler), where an operator looks at start-up:
            # on an unverified release, or with anything missing, a warning naming each gap.
            start = start_up(engine_index(instance.vllm_config))
            (_vllm_log.warning if start.warn else _vllm_log.info)("otel-kvcache %s: %s", __version__, start.line)
            if not start.ready:  # what is missing is named in that line, with what it costs
                return
            engine = EngineTelemetry(instance, record_sink_for(), errors)
            if kv_connector(instance) is not None:
                engine.connectors = ConnectorTelemetry(engine, instance)
                try:
                    engine.connectors.watch_offload_tier(instance)
                except Exception as exc:  # noqa: BLE001 - a tier we cannot read: the rest goes on
                    errors.count(f"{hook} (offload tier)", exc)
                patch_connector_hooks(instance, engine.connectors, errors)
            _feeds(instance, engine)
            instruments.engines.add(engine)  # its gauges are read once its hooks feed it
            if publisher is not None:
                publisher.add(engine)
        except Exception as exc:  # noqa: BLE001
            errors.count(hook, exc)
            if engine is not None and engine.connectors is not None:  # leave vLLM's methods as they were
                unpatch_connector_hooks(engine.connectors)

    return wrapper


def build_wrappers(
    record_sink_for: RecordSinkFactory,
    instruments: KVCacheInstruments,
    errors: InstrumentationErrors,
    publisher: SnapshotPublisher | None = None,
) -> dict[str, Callable[[str], Wrapper | MethodBuilder]]:
    """Role -> a factory taking the hook's name; factories run only once vLLM is imported
    (the engine's and the pool's functions are looked up then: replacing one later has no effect)."""
    Engine, Pool = EngineTelemetry, PoolTracker  # noqa: N806 - short names for the table
    return {
        "scheduler_init": lambda hook: scheduler_init_wrapper(hook, record_sink_for, instruments, errors, publisher),
        "preempt": lambda hook: _around(hook, errors, Engine.before_preempt, Engine.on_preempted),
        "release": lambda hook: _around(hook, errors, Engine.before_release, Engine.on_released),
        "scheduled": lambda hook: _after(hook, errors, Engine.on_scheduled, given_result=True),
        "admission_attempt": lambda hook: _after(hook, errors, Engine.on_admission_attempt),
        "prefix_lookup": lambda hook: _after(hook, errors, Engine.on_prefix_cache_lookup),
        "evict_blocks": lambda hook: _tracking_pool(hook, errors, Pool.before_evicting),
        "queue_prepend": lambda hook: _tracking_pool(hook, errors, Pool.before_prepending),
        "queue_append": lambda hook: _tracking_pool(hook, errors, Pool.on_appending),
        "touch": lambda hook: _tracking_pool(hook, errors, Pool.on_touching),
        "unpin": lambda hook: _tracking_pool(hook, errors, Pool.before_unpinning),
        "reset_prefix_cache": lambda hook: _after(hook, errors, Engine.on_prefix_cache_reset, given_result=True),
        "remember_trace_headers": lambda hook: remember_trace_headers_wrapper(),
        "attach_trace_context": lambda hook: attach_trace_context_wrapper(hook, errors),
        "recover_trace_headers": lambda hook: recover_trace_headers_wrapper(hook, errors),
        "name_child_process": lambda hook: name_child_process_wrapper(hook, errors),
        "offload_tier_init": lambda hook: offload_tier_init_wrapper(hook, errors),
    }
