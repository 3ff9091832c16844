"""``otel-kvcache top`` during the main job's load: the frame at its busiest moment."""

from __future__ import annotations

import threading
import time

from otel_kvcache.commands.top.frame import json_frame
from otel_kvcache.engine.snapshot_files import read_snapshots

READY_SECONDS = 15.0
"""How long the load may wait for the engine to publish in full, as ``top`` sees it."""


class BusiestFrame:
    """Reads the live snapshots twice a second, as ``otel-kvcache top`` does, and keeps the
    frame in which the most requests of the served model held blocks (then the most blocks).

    An engine publishes once a second, and in full (its requests) only once a reader has
    shown up: entering waits for such a snapshot, so that a load of a few seconds, started
    as soon as the server answers, is watched from its first request."""

    def __init__(self, model: str, every: float = 0.2) -> None:
        self.model = model
        self.every = every
        self.frame: dict | None = None
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

    def _read(self) -> dict:
        """A frame of the served model's engines publishing in full now (reading marks them watched)."""
        frame = json_frame(read_snapshots(), [], "snapshots")
        frame["engines"] = [
            e for e in frame["engines"] if e.get("model") == self.model and not e["stale"] and e.get("detailed")
        ]
        return frame

    def _watch(self) -> None:
        while not self._stop.wait(self.every):
            frame = self._read()
            if frame["engines"] and busy(frame) > (busy(self.frame) if self.frame else (-1, -1)):
                self.frame = frame


def busy(frame: dict) -> tuple[int, int]:
    """Requests holding blocks, then blocks used."""
    engines = frame["engines"]
    return sum(e["holding_requests"] or 0 for e in engines), sum(e["pool"]["used"] for e in engines)
