"""The live snapshot each engine publishes for ``otel-kvcache top``.

One daemon thread per engine process, started with its first engine, writes each
engine's snapshot (``engine/snapshot_files.py`` says where, and how it is kept private) at
most once a second, and at most ``BUDGET`` of the time: after two rounds whose snapshots took
at least t of the thread's own time to build, the next waits at least t / ``BUDGET``, so a
huge pool is published less often rather than at a greater cost.

- Building is done under the GIL: time the engine thread may wait for
  (``docs/overhead.md#live-snapshot``).
- The files' writing is not counted: the GIL is free while the kernel opens, writes and
  renames, and on a small pool that is most of a round. Counted, it would hold the next
  snapshot back for time the engine thread never waits for.
- The lesser of the last two rounds, so that one slow round (a garbage collection in this
  thread, say) does not leave ``top`` without a snapshot for seconds.

Its costly part, the holders' fair share over every held block and the requests holding
the most, is published only while ``otel-kvcache top`` is watching (``snapshot_files``):
nobody watching, a round reads a few counters and writes a small file.

It never runs on the engine thread, and reads what the metric reader's thread reads:
the tracker's counts, the engine's cumulative counters, the reconciler's last findings,
and vLLM's block lists and requests (copied with one C call before walking them). It
lists only the ``OTEL_KVCACHE_TOP_REQUESTS`` requests holding the most blocks and as
many holders, each value a client chose cut as on the span, and never a token or text.
An engine's file goes with its engine, or with its process when it exits.
"""

from __future__ import annotations

import heapq
import itertools
import os
import socket
import threading
import time
import weakref
from collections import deque
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_kvcache import config, names
from otel_kvcache.bounds import cut
from otel_kvcache.engine.snapshot_files import (
    FORMAT,
    UnsafeDirectory,
    candidate_directories,
    encode_snapshot,
    private_directory,
    snapshot_path,
    watched,
    write_snapshot,
)
from otel_kvcache.handover.tally import PREEMPTIONS
from otel_kvcache.trace_context import baggage_entries
from otel_kvcache.vllm_compat.blocks import blocks_held_by_request
from otel_kvcache.vllm_compat.readers import arrival_time_reader, live_states_by_status, session_id_reader
from otel_kvcache.vllm_compat.versions import installed_vllm_version

if TYPE_CHECKING:
    from otel_kvcache.engine.offload_tier import OffloadTier
    from otel_kvcache.engine.telemetry import EngineTelemetry
    from otel_kvcache.errors import InstrumentationErrors

PUBLISH_SECONDS = 1.0
"""The shortest time between two snapshots of an engine."""
BUDGET = 0.001
"""The share of the time the publishing thread may take."""
RATE_WINDOW_SECONDS = 60.0
"""Rates and the prefix-hit ratio are over this long (less while the engine is younger)."""
_SERIALS = itertools.count()
"""Tells apart the engines one process makes in turn, whichever instrumentation made them."""
HOOK = "live_snapshot"
"""Our errors here are counted under this name (``otel_kvcache.instrumentation.errors``)."""


class RateWindow:
    """An engine's cumulative counts at each of its snapshots over the last minute."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, tuple[float, ...]]] = deque()

    def add(self, now: float, counts: tuple[float, ...]) -> tuple[float, tuple[float, ...]]:
        """Records ``counts`` at ``now``; returns the seconds covered and each count's growth."""
        samples = self._samples
        samples.append((now, counts))
        while len(samples) > 2 and samples[1][0] <= now - RATE_WINDOW_SECONDS:
            samples.popleft()
        since, first = samples[0]
        return now - since, tuple(last - before for last, before in zip(counts, first))


class SnapshotPublisher:
    """Publishes the snapshots of this process's engines, from a thread of its own."""

    def __init__(self, errors: InstrumentationErrors) -> None:
        self.errors = errors
        self.top_requests = config.top_requests()
        self.interval = PUBLISH_SECONDS
        self._last_building = 0.0
        """The last round's snapshots' building time, in this thread's own seconds."""
        self._engines: weakref.WeakKeyDictionary[EngineTelemetry, tuple[Path, RateWindow]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_pid = 0
        self._host = socket.gethostname()
        self._vllm = installed_vllm_version()
        self._readers: tuple[dict[Any, str], Any, Any] | None = None
        """vLLM's request statuses as states, and readers of a request's session and arrival:
        made with the first engine, once vLLM is imported."""

    def add(self, engine: EngineTelemetry) -> None:
        """Publishes ``engine`` from now on (``scheduler_init_wrapper``, on the engine thread)."""
        try:
            directory = private_directory(candidate_directories()[0], create=True)
        except (OSError, UnsafeDirectory) as exc:
            self.errors.count(HOOK, exc)  # logged once: which directory, and why
            return
        if self._readers is None:
            self._readers = (live_states_by_status(), session_id_reader(), arrival_time_reader())
        path = snapshot_path(directory, os.getpid(), engine.attributes[names.ENGINE_INDEX], next(_SERIALS))
        weakref.finalize(engine, _remove, path, os.getpid())  # with the engine, or at the process's exit
        with self._lock:
            self._engines[engine] = (path, RateWindow())
            if self._thread is None or self._thread_pid != os.getpid():  # none yet, or forked
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="otel-kvcache-top", daemon=True)
                self._thread_pid = os.getpid()
                self._thread.start()

    def stop(self) -> None:
        """No more snapshots (``uninstrument()``); the files go."""
        self._stop.set()
        with self._lock:
            for path, _ in list(self._engines.values()):
                _remove(path, os.getpid())
            self._engines.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish()

    def publish(self) -> None:
        """One round: every engine's snapshot, written whole.

        The what-if curves catch up first, outside the round's budget: that work is the
        curve's (``whatif.PrefixReuse.catch_up``), done wherever it is read. Charged to
        the budget, it stretched the interval, which left more of it for the next round:
        25 s between snapshots within a minute on the terminal tests' engines."""
        with self._lock:
            engines = list(self._engines)
        for engine in engines:
            try:
                engine.reuse.catch_up()
            except Exception as exc:  # noqa: BLE001 - ours: counted; the snapshot goes out without it
                self.errors.count(HOOK, exc)
        building = 0.0  # this thread's own time (not its waits for the GIL) building the snapshots
        detailed: dict[Path, bool] = {}
        with self._lock:  # ``stop()`` waits for the round: no file written after it removed them
            if self._stop.is_set():
                return
            for engine, (path, rates) in list(self._engines.items()):
                try:
                    if path.parent not in detailed:
                        detailed[path.parent] = watched(path.parent, time.time())
                    started = time.thread_time()
                    data = encode_snapshot(self.snapshot_of(engine, rates, detailed[path.parent]))
                    building += time.thread_time() - started
                    write_snapshot(path, data)
                except Exception as exc:  # noqa: BLE001 - ours: counted, and the next round tries again
                    self.errors.count(HOOK, exc)
        self.interval = max(PUBLISH_SECONDS, min(building, self._last_building) / BUDGET)
        self._last_building = building

    def snapshot_of(self, engine: EngineTelemetry, rates: RateWindow, detailed: bool = True) -> dict[str, Any]:
        """The engine now, in the format ``docs/top.md`` describes; its holders and
        requests (a walk over every held block) only if ``detailed``: while someone watches."""
        now = time.time()
        pool = engine.pool
        seconds, (queries, hits, preemptions, evictions, stalls, evicted_age) = rates.add(
            time.monotonic(),
            (
                engine.prefix_cache_queries,
                engine.prefix_cache_hits,
                engine.preemptions,
                pool.evictions,
                engine.allocation_stalls,
                pool.eviction_age_sum,
            ),
        )
        state = engine.pool_counts
        report = engine.reconciler.report
        holders = engine.attribution.holders_now(engine.type_managers, engine.scheduler_requests) if detailed else []
        shown = holders[: self.top_requests]
        connectors, tier = engine.connectors, engine.offload_tier
        tier_ratios = {f"{scale:g}": ratio for scale, ratio in engine.reuse.projected_tier_hit_ratios().items()}
        return {
            "format": FORMAT,
            "time": now,
            "interval": self.interval,
            "host": self._host,
            "pid": os.getpid(),
            "engine": engine.attributes[names.ENGINE_INDEX],
            "model": engine.attribution.served_model,
            "vllm": self._vllm,
            "pool": {
                "used": state.used,
                "cached": state.cached,
                "free": state.free,
                "limit": state.limit,
                "block_size": engine.block_size,
                "bytes_per_block": engine.bytes_per_block,
            },
            "last_minute": {
                "seconds": seconds,
                "prefix_hit_ratio": hits / queries if queries else None,
                "preemptions_per_s": preemptions / seconds if seconds else 0.0,
                "evictions_per_s": evictions / seconds if seconds else 0.0,
                "stalls_per_s": stalls / seconds if seconds else 0.0,
                "evicted_age_mean_s": evicted_age / evictions if evictions else None,
            },
            "leaks": {
                "orphaned_blocks": report.orphaned_blocks,
                "zombie_requests": report.zombie_requests,
                "zombie_blocks": report.zombie_blocks,
                "stuck_requests": report.stuck_requests,
            },
            "connector": None if connectors is None else dict(
                zip(("held_blocks", "held_requests", "held_age_max_s"), connectors.held_readings())
            ),
            "offload": None if tier is None else {**_tier(tier), "projected_hit_ratio": tier_ratios},
            "whatif": {
                "hit_ratio": {f"{scale:g}": ratio for scale, ratio in engine.reuse.projected_hit_ratios().items()},
                "preemption_free_scale": engine.reuse.preemption_free_scale(),
                # Where the engine has no tier: a first one's, by multiples of the pool.
                "first_tier_hit_ratio": tier_ratios if tier is None else None,
            },
            "holders": [{"attributes": attributes, "blocks": blocks} for attributes, blocks in shown],
            "holders_other": sum(blocks for _, blocks in holders[len(shown):]),
            "detailed": detailed,
            **(self._requests(engine, now) if detailed else {"holding_requests": None, "requests": []}),
        }  # fmt: skip

    def _requests(self, engine: EngineTelemetry, now: float) -> dict[str, Any]:
        """The requests holding the most blocks, then the preempted ones (which hold none),
        as ``requests``; and how many hold any."""
        holding = blocks_held_by_request(engine.type_managers)
        holders = len(holding)
        for request_id in list(engine.preempted_blocks):  # they wait to get blocks back
            holding.setdefault(request_id, 0)
        largest = heapq.nlargest(self.top_requests, holding.items(), key=itemgetter(1))
        zombies = engine.reconciler.zombie_ids()
        return {"holding_requests": holders, "requests": [self._row(engine, *item, now, zombies) for item in largest]}

    def _row(self, engine: EngineTelemetry, request_id: str, blocks: int, now: float, zombies: set[str]) -> dict[str, Any]:
        request = engine.scheduler_requests.get(request_id)
        if request is None:  # vLLM no longer knows it, and its blocks are still listed: a leak
            return {"id": engine.reported_id(request_id), "blocks": blocks, "state": names.LIVE_STATE_ZOMBIE}
        states, session_of, arrival_of = self._readers
        state = states[request.status]
        if state == names.LIVE_STATE_FINISHED:
            connectors = engine.connectors
            if request_id in zombies:
                state = names.LIVE_STATE_ZOMBIE
            elif connectors is not None and request_id in connectors.held:
                state = names.LIVE_STATE_HELD_FOR_SEND
        tally = engine.requests.get(request_id)
        session = session_of(request)
        attribution = engine.attribution
        return {
            "id": engine.reported_id(request_id),
            "blocks": blocks,
            "state": state,
            "age_s": max(now - arrival_of(request), 0.0),
            "preemptions": tally[PREEMPTIONS] if tally is not None else 0,
            "session": None if session is None else cut(session, engine.value_limit),
            "model": attribution.model_of(request),
            "baggage": baggage_entries(engine.trace_headers_of(request), attribution.baggage_keys, engine.value_limit),
        }


def _tier(tier: OffloadTier) -> dict[str, Any]:
    """An engine's offload tier (``docs/top.md``)."""
    used, free = tier.blocks()
    return {
        "medium": tier.medium, "used": used, "free": free, "bytes_per_block": tier.bytes_per_block,
        "stores": tier.stores, "loads": tier.loads, "evictions": tier.evictions, "evicted_unused": tier.evicted_unused,
    }  # fmt: skip


def _remove(path: Path, owner: int) -> None:
    """Deletes an engine's snapshot, in the process that wrote it only (a forked child
    inherits the finalizer, not the engine)."""
    if os.getpid() != owner:
        return
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass

