"""Reconciles the block pool against its owners: orphaned blocks, zombie and stuck requests, waste.

Runs on the engine thread once ``schedule()`` returns, in the first step after
``OTEL_KVCACHE_RECONCILE_SECONDS`` (the scheduler's state is whole then: in
vLLM the model runs next), and when the engine runs out of requests, since an
idle engine takes no steps. One pass is O(live requests + blocks
marked as hit) in Python and O(blocks) in C (the pool's reference sum). The next
pass waits at least 1,000 times as long as the last took (``RECONCILE_BUDGET``), so
whatever the pool size and step rate it takes at most 0.1 % of the engine thread
(what a pass takes by pool size: ``docs/overhead.md#reconciliation``).

- orphaned blocks: references (``ref_cnt``, summed over the pool) that no live
  request's block list and no deferred free accounts for;
- zombie requests: request ids that still hold blocks while finished or gone
  from the scheduler, for longer than ``OTEL_KVCACHE_ZOMBIE_GRACE_SECONDS``, or,
  when a KV connector holds them for a transfer, than the connector's timeout
  (``connectors.py``; reason ``connector_timeout``);
- stuck requests: running requests that computed no token for
  ``OTEL_KVCACHE_STUCK_STEPS`` steps, and requests waiting for remote KV past
  the connector's timeout (reason ``remote_kv_wait``);
- tail slack: token slots allocated but not yet filled, per request's blocks.

Blocks vLLM keeps on purpose (evictable prefix-cache blocks with no
reference, deferred frees) are never findings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from otel_kvcache import config, names
from otel_kvcache.handover.record import Finding, RecordSink, event_attributes
from otel_kvcache.handover.tally import PROGRESS_STEP, PROGRESS_TOKENS, Tally
from otel_kvcache.trace_context import log_in_trace
from otel_kvcache.vllm_compat.blocks import blocks_held_by_request, deferred_frees, real_blocks
from otel_kvcache.vllm_compat.readers import running_status

if TYPE_CHECKING:
    from otel_kvcache.engine.connectors import ConnectorTelemetry
    from otel_kvcache.engine.pool import PoolTracker


class Engine(Protocol):
    """What reconciliation reads and calls of its engine (``telemetry.EngineTelemetry``);
    read-only here, so that the engine's own, narrower types match."""

    @property
    def attributes(self) -> Mapping[str, Any]: ...
    @property
    def block_size(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def pool(self) -> PoolTracker: ...
    @property
    def connectors(self) -> ConnectorTelemetry | None: ...
    @property
    def record_sink(self) -> RecordSink: ...
    @property
    def requests(self) -> dict[str, Tally]: ...
    @property
    def scheduler_requests(self) -> Mapping[str, Any]: ...
    @property
    def type_managers(self) -> Any: ...
    @property
    def held_blocks(self) -> Callable[[str], int]: ...

    def event(self, request_id: str, name: str, blocks: int, detail: Any) -> None: ...
    def reported_id(self, request_id: str) -> str: ...
    def forget_departed(self) -> None: ...


# The share of the engine thread reconciliation may take: after a pass that
# took t, the next waits at least t / RECONCILE_BUDGET (a large pool's passes
# come further apart than OTEL_KVCACHE_RECONCILE_SECONDS; 0 still means every step).
RECONCILE_BUDGET = 0.001


@dataclass
class LeakReport:
    """The last reconciliation's findings, read by the gauges."""

    orphaned_blocks: int = 0
    zombie_requests: int = 0
    zombie_blocks: int = 0
    stuck_requests: int = 0
    tail_slack_tokens: int = 0
    tail_slack_ratio: float = 0.0
    cached_blocks_hit_again: int = 0


class Reconciler:
    def __init__(self, engine: Engine, scheduler: Any) -> None:
        self.engine = engine
        self.interval = config.reconcile_seconds()
        self.due = time.monotonic() + self.interval
        self.grace_seconds = config.zombie_grace_seconds()
        self.stuck_steps = config.stuck_steps()
        self.report = LeakReport()
        self._deferred_frees = deferred_frees(scheduler)
        self._running = running_status()
        self._holding_since: dict[str, float] = {}
        """Requests holding blocks while finished or gone, since they were first seen so."""
        self._reported: set[tuple[str, str]] = set()  # (kind, request id) already told

    def maybe_run(self, now: float) -> None:
        if now >= self.due:
            self.run()

    def run(self) -> None:
        now = time.monotonic()
        self.report = self._reconcile(now)
        finished = time.monotonic()
        self.due = finished + (max(self.interval, (finished - now) / RECONCILE_BUDGET) if self.interval else 0.0)

    def _reconcile(self, now: float) -> LeakReport:
        engine = self.engine
        live = engine.scheduler_requests
        holding, accounted = self._holdings()
        zombie_requests, zombie_blocks = self._find_zombies(holding, live, now)
        engine.forget_departed()
        orphaned = max(engine.pool.references() - accounted, 0)
        if orphaned:
            self._tell_orphaned(orphaned)
        slack = self._tail_slack(holding, live)
        used = engine.pool.used_blocks()
        return LeakReport(
            orphaned_blocks=orphaned,
            zombie_requests=zombie_requests,
            zombie_blocks=zombie_blocks,
            stuck_requests=self._find_stuck(live),
            tail_slack_tokens=slack,
            tail_slack_ratio=slack / (used * engine.block_size) if used else 0.0,
            cached_blocks_hit_again=engine.pool.cached_blocks_hit_again(),
        )

    def _holdings(self) -> tuple[dict[str, int], int]:
        """Blocks held per request id, as vLLM's KV managers list them, and the block
        references that requests and deferred frees account for."""
        holding = blocks_held_by_request(self.engine.type_managers)
        accounted = sum(holding.values()) + sum(real_blocks(blocks) for _, blocks in self._deferred_frees)
        return holding, accounted

    def zombie_ids(self) -> set[str]:
        """The requests the last passes found to be zombies (read off the engine thread)."""
        return {request_id for kind, request_id in list(self._reported) if kind == names.EVENT_ZOMBIE}

    def _find_zombies(self, holding: dict[str, int], live: dict[str, Any], now: float) -> tuple[int, int]:
        """Requests holding blocks while finished or gone for longer than the grace
        period: how many, and their blocks. Those that let go are forgotten."""
        zombies = zombie_blocks = 0
        connectors = self.engine.connectors
        for request_id, held in holding.items():
            request = live.get(request_id)
            if request is not None and not request.is_finished():
                continue
            since = self._holding_since.setdefault(request_id, now)
            if connectors is not None and request_id in connectors.held:  # held for a transfer
                since, limit, reason = connectors.held[request_id].since, connectors.timeout, names.ZOMBIE_CONNECTOR_TIMEOUT
            else:
                limit, reason = self.grace_seconds, names.ZOMBIE_FINISHED
            if now - since >= limit:
                zombies += 1
                zombie_blocks += held
                message = f"still holds {held} KV blocks {now - since:.0f} s after it finished ({reason})"
                detail = (self.engine.reported_id(request_id), reason)
                self._tell(names.EVENT_ZOMBIE, request_id, held, detail, message)
        for request_id in [rid for rid in self._holding_since if rid not in holding]:
            del self._holding_since[request_id]
            self._reported.discard((names.EVENT_ZOMBIE, request_id))
        return zombies, zombie_blocks

    def _tail_slack(self, holding: dict[str, int], live: dict[str, Any]) -> int:
        """Token slots allocated to running requests and not yet filled."""
        block_size, slack = self.engine.block_size, 0
        for request_id, held in holding.items():
            request = live.get(request_id)
            if request is not None and not request.is_finished():
                slack += max(held * block_size - request.num_computed_tokens, 0)
        return slack

    def _tell_orphaned(self, orphaned: int) -> None:
        """Once per engine: orphaned blocks are a bug in vLLM or in us, not a request's."""
        if ("orphaned", "") in self._reported:
            return
        self._reported.add(("orphaned", ""))
        log_in_trace(
            None,
            "otel-kvcache: %d KV blocks on engine %s are referenced by no live request",
            orphaned,
            self.engine.attributes[names.ENGINE_INDEX],
        )

    def _find_stuck(self, live: dict[str, Any]) -> int:
        """Running requests that computed no token for ``stuck_steps`` steps: how many."""
        engine, running = self.engine, self._running
        stuck = 0
        for request_id, tally in engine.requests.items():
            request = live.get(request_id)
            if request is None or request.status is not running:
                tally[PROGRESS_STEP] = engine.step
                continue
            if request.num_computed_tokens != tally[PROGRESS_TOKENS]:
                tally[PROGRESS_TOKENS], tally[PROGRESS_STEP] = request.num_computed_tokens, engine.step
            elif engine.step - tally[PROGRESS_STEP] >= self.stuck_steps:
                stuck += 1
                idle = engine.step - tally[PROGRESS_STEP]
                held = engine.held_blocks(request_id)
                detail = (idle, names.STUCK_NO_PROGRESS)
                self._tell(names.EVENT_STUCK, request_id, held, detail, f"has computed no token for {idle} steps")
        if engine.connectors is not None:
            for request_id, seconds, steps in engine.connectors.overdue_waits():
                stuck += 1
                held = engine.held_blocks(request_id)
                message = f"has waited {seconds:.0f} s for remote KV"
                self._tell(names.EVENT_STUCK, request_id, held, (steps, names.STUCK_REMOTE_KV_WAIT), message)
        return stuck

    def _tell(self, event: str, request_id: str, blocks: int, detail: Any, message: str) -> None:
        """Once per request and event: the event on its span (or a finding span in its
        trace, if its span has ended), and a log record (in its trace's context
        once the span has ended)."""
        if (event, request_id) in self._reported:
            return
        self._reported.add((event, request_id))
        engine = self.engine
        reported_id = engine.reported_id(request_id)
        if request_id in engine.requests:  # on the span to come
            engine.event(request_id, event, blocks, detail)
            log_in_trace(None, "otel-kvcache: request %s %s", reported_id, message)
        else:  # in the ended span's trace, wherever the span was built
            attributes = {names.REQUEST_ID: reported_id, **event_attributes(event, blocks, detail)}
            if reported_id is not request_id:
                attributes[names.REQUEST_ID_ORIGINAL_LENGTH] = len(request_id)
            engine.record_sink.finding(Finding(reported_id, event, attributes, message))
