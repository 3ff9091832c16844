"""KV connectors: what a request moved through its engine's connector, and the blocks
finished requests leave held for a transfer.

Built only for an engine whose scheduler has a KV connector (offloading, LMCache,
prefill/decode disaggregation); its hooks are patched on that scheduler and its
connector object (``vllm_compat.hook_points.CONNECTOR_HOOK_POINTS``), so an engine without one
pays nothing. Everything runs on the engine thread, per request touched:

- an admission from the waiting queue tells the connector vLLM's external computed
  tokens (``update_state_after_alloc``): the request's connector hits, and its role
  in a prefill/decode hand-off, read before NIXL rewrites its parameters;
- after ``schedule()``, an admitted request vLLM parked in ``WAITING_FOR_REMOTE_KVS``
  starts waiting; the workers' ``finished_recving`` ends the wait;
- ``invalid_block_ids`` and ``failed_recving`` are failed loads: the request's blocks
  among them count before vLLM acts on them, the tokens it recomputes after;
- a finished request whose blocks vLLM did not free (``_free_request``) is held for
  the connector until ``finished_sending`` (or ``finished_recving``) frees them.

A producer's span context travels to the consumer in the ``kv_transfer_params`` the
producer returns (``names.PRODUCER_SPAN_PARAMETER``), as vLLM's proxy pattern
passes them on; the producer's span is later built with that span id (``export/spans.py``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from otel_kvcache import config, names
from otel_kvcache.engine.offload_tier import OffloadTier
from otel_kvcache.engine.sampling import default_sample_rate
from otel_kvcache.trace_context import remote_span_context, traceparent_for
from otel_kvcache.vllm_compat.kv_transfer import (
    block_ids_of,
    connector_kv_role,
    connector_timeout_seconds,
    hands_kv_on_in_parameters,
    kv_connector,
    kv_connector_output,
    request_connector_role,
    statuses_handing_kv_on,
    waiting_for_remote_kvs_status,
)
from otel_kvcache.vllm_compat.offload_tier import offload_tier_manager, tier_bytes_per_block, tier_capacity_blocks


class Engine(Protocol):
    """What the connector accounting reads and calls of its engine (``telemetry.EngineTelemetry``);
    read-only here, so that the engine's own, narrower types match."""

    @property
    def step(self) -> int: ...
    @property
    def value_limit(self) -> int: ...
    @property
    def scheduler_requests(self) -> Mapping[str, Any]: ...
    @property
    def held_blocks(self) -> Callable[[str], int]: ...
    @property
    def trace_headers_of(self) -> Callable[[Any], Mapping[str, str] | None]: ...
    @property
    def attribution(self) -> Any: ...

    def event(self, request_id: str, name: str, blocks: int, detail: Any) -> None: ...


class ConnectorTally:
    """A request's connector counts while it lives."""

    __slots__ = (
        "request", "role", "hit_tokens", "wait_started_ns", "wait_started_step", "wait_ns",
        "failed_blocks", "recomputed_tokens", "producer_traceparent", "span_id",
    )  # fmt: skip

    def __init__(self, request: Any, role: str | None) -> None:
        self.request = request
        self.role = role
        self.hit_tokens = self.wait_started_ns = self.wait_started_step = self.wait_ns = 0
        self.failed_blocks = self.recomputed_tokens = self.span_id = 0
        self.producer_traceparent: str | None = None


class Held(NamedTuple):
    """A finished request whose blocks the connector still holds."""

    since: float
    """``time.monotonic()`` at its finish."""
    blocks: int


class ConnectorTelemetry:
    """One engine's KV-connector accounting; its counts are read by the metric reader."""

    def __init__(self, engine: Engine, scheduler: Any) -> None:
        self.engine = engine
        self.name = type(kv_connector(scheduler)).__name__
        self.engine_role = connector_kv_role(scheduler)
        configured = config.connector_timeout_seconds()
        self.timeout = connector_timeout_seconds(scheduler) if configured is None else configured
        """Seconds a transfer may take before the blocks it holds are a finding."""
        self.manager = scheduler.kv_cache_manager
        self.requests: dict[str, ConnectorTally] = {}
        self.held: dict[str, Held] = {}
        self.hit_tokens = 0
        self.load_failure_blocks = 0
        self._admitted: list[ConnectorTally] = []  # this step's, until schedule() returns
        self.patched: list[tuple[Any, str, Any]] = []
        """(scheduler or connector, method, our bound method), for ``uninstrument()``."""
        self._waiting = waiting_for_remote_kvs_status()
        self._handing_kv_on = statuses_handing_kv_on()
        self._hands_on_in_parameters = hands_kv_on_in_parameters(kv_connector(scheduler))
        self.tier: OffloadTier | None = None
        """The connector's offload tier, where it keeps one we can read (``watch_offload_tier``)."""

    def watch_offload_tier(self, scheduler: Any) -> None:
        """Where the connector keeps an offload tier we can read, its telemetry; apart from the
        connector's, so that a tier we cannot read costs the tier's view only."""
        manager = offload_tier_manager(scheduler)
        if manager is not None:
            reuse = self.engine.reuse
            tier = OffloadTier(manager, tier_bytes_per_block(scheduler), self._attribution_series, reuse.on_tier_reset)
            rate = config.whatif_sample_rate()
            capacity = tier_capacity_blocks(scheduler, manager)
            reuse.measure_tier(capacity, default_sample_rate(capacity) if rate is None else rate)
            self.tier = tier

    def _attribution_series(self, request_id: str) -> Any:
        attribution = self.engine.attribution
        return attribution.series_of(attribution.key_of_live(self.engine.scheduler_requests.get(request_id)))

    # --- hooks -------------------------------------------------------------------

    def on_allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Before the connector's ``update_state_after_alloc``: an admission's external tokens."""
        tally = self.requests.get(request.request_id)
        if tally is None:
            role = request_connector_role(request.kv_transfer_params) or self.engine_role
            tally = self.requests[request.request_id] = ConnectorTally(request, role)
            if role == names.ROLE_CONSUMER and request.kv_transfer_params:
                traceparent = request.kv_transfer_params.get(names.PRODUCER_SPAN_PARAMETER)
                # A client may send anything there (bounds.py): nothing longer is a traceparent.
                if isinstance(traceparent, str) and len(traceparent) <= self.engine.value_limit:
                    tally.producer_traceparent = traceparent
        tally.hit_tokens += num_external_tokens
        self.hit_tokens += num_external_tokens
        if self.tier is not None:  # the admission's lookup, recorded next, reads it (tier_whatif.py)
            self.tier.admitted_tokens[request.request_id] = num_external_tokens
        self._admitted.append(tally)

    def after_schedule(self) -> None:
        """The step's admissions that vLLM parked for an asynchronous load start waiting."""
        if not self._admitted:
            return
        now = time.monotonic_ns()
        for tally in self._admitted:
            if tally.request.status is self._waiting and not tally.wait_started_ns:
                tally.wait_started_ns, tally.wait_started_step = now, self.engine.step
        self._admitted.clear()

    def before_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[str, int] | None:
        """Before ``update_from_output`` acts on the workers' connector output: waits that
        end, sends that end, and failed loads' blocks. Returns, for the failed loads, the
        tokens each request had computed (vLLM truncates them)."""
        output = kv_connector_output(model_runner_output)
        if output is None:
            return None
        engine, now = self.engine, time.monotonic_ns()
        for request_id in output.finished_recving or ():
            tally = self.requests.get(request_id)
            if tally is not None and tally.wait_started_ns:
                waited = now - tally.wait_started_ns
                tally.wait_ns += waited
                tally.wait_started_ns = 0
                engine.event(request_id, names.EVENT_REMOTE_KV_READY, engine.held_blocks(request_id), waited / 1e9)
        for request_id in output.finished_sending or ():
            held = self.held.get(request_id)
            if held is not None:
                engine.event(request_id, names.EVENT_SEND_DONE, held.blocks, time.monotonic() - held.since)
        if not (output.invalid_block_ids or output.failed_recving):
            return None
        return self._failed_loads(output, scheduler_output.num_scheduled_tokens)

    def _failed_loads(self, output: Any, num_scheduled_tokens: dict[str, int]) -> dict[str, int]:
        """Rare: a scan of the connector's live requests' block ids."""
        invalid, failed_requests = output.invalid_block_ids or set(), output.failed_recving or set()
        computed = {}
        for request_id, tally in self.requests.items():
            request = tally.request
            if request.is_finished():
                continue
            if request_id in failed_requests and request.status is self._waiting:
                failed = self.engine.held_blocks(request_id)  # the whole load
            else:
                failed = sum(1 for block_id in block_ids_of(self.manager, request_id) if block_id in invalid)
            if failed:
                tally.failed_blocks += failed
                self.load_failure_blocks += failed
                computed[request_id] = request.num_computed_tokens - num_scheduled_tokens.get(request_id, 0)
                self.engine.event(request_id, names.EVENT_LOAD_FAILED, self.engine.held_blocks(request_id), failed)
        return computed

    def after_output(self, computed_before: dict[str, int]) -> None:
        """The tokens vLLM will recompute: those a failed load took back from a request
        that goes on (one that failed instead recomputes nothing)."""
        for request_id, computed in computed_before.items():
            tally = self.requests.get(request_id)
            if tally is not None and not tally.request.is_finished():
                tally.recomputed_tokens += max(computed - tally.request.num_computed_tokens, 0)

    def on_finished(self, kv_transfer_params: Any, request: Any, *_later: Any, **_named: Any) -> None:
        """After ``_free_request`` (given what it returned, and vLLM's arguments): blocks vLLM
        did not free are held for the connector."""
        request_id = request.request_id
        if request_id in self.engine.scheduler_requests:  # freed ones are gone from it
            self.held[request_id] = Held(time.monotonic(), self.engine.held_blocks(request_id))

    def on_request_finished(self, request: Any, result: tuple[bool, dict | None]) -> tuple[bool, dict | None]:
        """After the connector's ``request_finished``: a producer in a hand-off (the proxy
        sent it ``kv_transfer_params``) adds its span's context to those it returns. The
        only hook that changes vLLM's answer, and only by that key: where the connector
        hands nothing on (a NIXL-like one answering None, or a request that did not finish
        normally), it stays nothing."""
        tally = self.requests.get(request.request_id)
        if tally is None or tally.role != names.ROLE_PRODUCER or request.kv_transfer_params is None:
            return result
        delay_free, params = result
        if params is None and (self._hands_on_in_parameters or request.status not in self._handing_kv_on):
            return result
        headers = self.engine.trace_headers_of(request)
        caller = remote_span_context(headers.get("traceparent") if headers else None)
        if caller is None:
            return result
        tally.span_id = random.getrandbits(64) or 1
        traceparent = traceparent_for(caller.trace_id, tally.span_id, caller.trace_flags)
        return delay_free, {**(params or {}), names.PRODUCER_SPAN_PARAMETER: traceparent}

    def on_released(self, request_id: str) -> tuple | None:
        """The request's blocks went back to the pool: its ``handover.record.ConnectorSummary``'s fields,
        in order, as a plain tuple (``marshal`` takes no named tuple)."""
        held = self.held.pop(request_id, None)
        tally = self.requests.pop(request_id, None)
        if tally is None:
            return None
        if tally.wait_started_ns:  # released while waiting (aborted)
            tally.wait_ns += time.monotonic_ns() - tally.wait_started_ns
        delayed = int((time.monotonic() - held.since) * 1e9) if held is not None else -1
        stored = self.tier.stored_blocks(request_id) if self.tier is not None else -1
        return (
            self.name, tally.role, tally.hit_tokens, tally.wait_ns, tally.failed_blocks,
            tally.recomputed_tokens, delayed, tally.producer_traceparent, tally.span_id, stored,
        )  # fmt: skip

    def forget_departed(self, live: dict[str, Any]) -> None:
        for request_id in [rid for rid in self.requests if rid not in live]:
            del self.requests[request_id]
        for request_id in [rid for rid in self.held if rid not in live]:
            del self.held[request_id]
        if self.tier is not None:
            self.tier.forget_departed(live)

    # --- findings and readings ------------------------------------------------------

    def overdue_waits(self) -> list[tuple[str, float, int]]:
        """Requests waiting for remote KV past the connector's timeout: (id, seconds, steps)."""
        now, step, timeout_ns = time.monotonic_ns(), self.engine.step, self.timeout * 1e9
        return [
            (rid, (now - tally.wait_started_ns) / 1e9, step - tally.wait_started_step)
            for rid, tally in self.requests.items()
            if tally.wait_started_ns and now - tally.wait_started_ns >= timeout_ns and not tally.request.is_finished()
        ]

    def held_readings(self) -> tuple[int, int, float]:
        """Blocks held for finished requests, those requests, the oldest one's age (s)."""
        holds = list(self.held.values())  # one C call: safe against the engine thread
        if not holds:
            return 0, 0, 0.0
        return sum(h.blocks for h in holds), len(holds), time.monotonic() - min(h.since for h in holds)
