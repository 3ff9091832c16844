"""``otel-kvcache top`` during the main job's load: the frame at its busiest moment."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from otel_kvcache.commands.top.frame import json_frame
from otel_kvcache.engine.snapshot_files import read_snapshots

READY_SECONDS = 15.0
"""How long the load may wait for the engine to publish in full, as ``top`` sees it."""


class BusiestFrame:
    """Reads the live snapshots five times a second, as ``otel-kvcache top`` does, and keeps the
    frame in which the most requests of the served model held blocks (then the most blocks).

    An engine publishes once a second, and in full (its requests) only once a reader has
    shown up: entering waits for such a snapshot, so that a load of a few seconds, started
    as soon as the server answers, is watched from its first request.

    A short load can still fall between two snapshots, or two metric collections: it lasts
    a second or two on a fast host, and both come once a second. ``load_seen`` is set once
    a frame has listed requests and ``exported()`` (if given) is true, and the main job's
    streaming clients stay until then."""

    def __init__(self, model: str, every: float = 0.2, exported: Callable[[], bool] | None = None) -> None:
        self.model = model
        self.every = every
        self.exported = exported
        """Whether the telemetry exported so far shows the load."""
        self.frame: dict | None = None
        self.load_seen = threading.Event()
        self._saw_requests = False
        self.snapshots: set[tuple[int, float]] = set()
        """The engine snapshots read while the load ran, by process and time."""
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="busiest-top-frame", daemon=True)

    def __enter__(self) -> BusiestFrame:
        deadline = time.monotonic() + READY_SECONDS
        while not self._read()["engines"] and time.monotonic() < deadline:
            time.sleep(self.every)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("reading the engines' snapshots failed") from self._error

    def widest_gap(self) -> float:
        """The most seconds between two snapshots read of one engine (a stalled publisher shows here)."""
        gaps = [0.0]
        for pid in {pid for pid, _ in self.snapshots}:
            times = sorted(t for p, t in self.snapshots if p == pid)
            gaps += [later - earlier for earlier, later in zip(times, times[1:])]
        return max(gaps)

    def _read(self) -> dict:
        """A frame of the served model's engines publishing in full now (reading marks them watched)."""
        frame = json_frame(read_snapshots(), [], "snapshots")
        frame["engines"] = [
            e for e in frame["engines"] if e.get("model") == self.model and not e["stale"] and e.get("detailed")
        ]
        return frame

    def _watch(self) -> None:
        try:
            while not self._stop.wait(self.every):
                frame = self._read()
                self.snapshots.update((engine["pid"], engine["time"]) for engine in frame["engines"])
                if frame["engines"] and busy(frame) > (busy(self.frame) if self.frame else (-1, -1)):
                    self.frame = frame
                self._saw_requests = self._saw_requests or any(engine["requests"] for engine in frame["engines"])
                if not self.load_seen.is_set() and self._saw_requests and (self.exported is None or self.exported()):
                    self.load_seen.set()  # from then on, the exported telemetry is not read again
        except Exception as exc:  # noqa: BLE001 - said when the load ends, rather than lost with this thread
            self._error = exc
            self.load_seen.set()  # the streaming clients need not wait for it


def busy(frame: dict) -> tuple[int, int]:
    """Requests holding blocks, then blocks used."""
    engines = frame["engines"]
    return sum(e["holding_requests"] or 0 for e in engines), sum(e["pool"]["used"] for e in engines)
