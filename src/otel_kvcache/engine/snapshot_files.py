"""Where the live snapshots lie, and how they are written and read: one JSON file per
engine, in a directory only its user can open.

No port and no socket: a file in a per-user directory (mode 0700, the files 0600) is
reachable by that user and root only. The directory is ``OTEL_KVCACHE_TOP_DIR``, else
``$XDG_RUNTIME_DIR/otel-kvcache`` (the tmpfs systemd gives each logged-in user), else
``/tmp/otel-kvcache-$UID``; the reader looks in both of the last two, since vLLM may run
without the session's ``XDG_RUNTIME_DIR``. A directory that is another user's, a link, or
open to others is refused: nothing is written there, nor read.

A snapshot is replaced whole (written beside, then renamed over), so a reader never
sees half of one. Its holders and requests, the costly part, are written only while a
reader is watching: each read touches ``watching`` in the directory, and the engines
publish in full for ``WATCHED_SECONDS`` after (``detailed`` in the snapshot). An engine that stopped publishing leaves its last snapshot behind: the
reader shows it as stale, and deletes it once its process is gone and it is older than
``forget_after``. A process that is alive but silent stays on show, stale: that is a
finding (an engine thread stuck), not a leftover.

The writing half runs in vLLM's engine processes (``live_snapshot.py``), the reading
half in ``otel-kvcache top``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_kvcache import config

_logger = logging.getLogger(__name__)

FORMAT = 1
"""The snapshot's format; a reader skips the others."""
STALE_AFTER_SECONDS = 5.0
"""A snapshot older than this, or than three of its engine's intervals, is stale."""
FORGET_AFTER_SECONDS = 60.0
"""A stale snapshot whose process is gone is deleted once it is this old."""
WATCHING = "watching"
"""The file a reader touches at each read: while it is fresh, the engines publish in full."""
WATCHED_SECONDS = 10.0
"""How long after a reader's last touch the engines still publish in full."""


class UnsafeDirectory(Exception):
    """The snapshot directory is not this user's alone."""


def candidate_directories() -> list[Path]:
    """Where snapshots may lie, the one a writer uses first."""
    configured = config.top_dir()
    if configured is not None:
        return [Path(configured)]
    directories = []
    runtime = os.environ.get("XDG_RUNTIME_DIR", "").strip()
    if runtime and os.path.isabs(runtime):
        directories.append(Path(runtime) / "otel-kvcache")
    directories.append(Path(tempfile.gettempdir()) / f"otel-kvcache-{os.getuid()}")
    return directories


def private_directory(path: Path, create: bool) -> Path | None:
    """``path``, made if missing and ``create`` (mode 0700), once checked to be a
    directory of this user's that others cannot open; None if it does not exist."""
    if create:
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass
    try:
        status = path.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(status.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a link, or a file)")
    if status.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {status.st_uid}, not to this user ({os.getuid()})")
    if status.st_mode & 0o077:
        raise UnsafeDirectory(f"{path} is open to other users (mode {stat.S_IMODE(status.st_mode):o}, not 700)")
    return path


def watched(directory: Path, now: float) -> bool:
    """Whether a reader touched ``directory`` within ``WATCHED_SECONDS``."""
    try:
        return now - (directory / WATCHING).stat().st_mtime < WATCHED_SECONDS
    except OSError:
        return False


def snapshot_path(directory: Path, pid: int, engine_index: int, serial: int) -> Path:
    """One engine's file: ``serial`` tells apart the engines one process makes in turn
    (an engine rebuilt in-process keeps its index; the old one's file goes with it)."""
    return directory / f"engine-{pid}-{engine_index}-{serial}.json"


def encode_snapshot(snapshot: dict[str, Any]) -> bytes:
    return json.dumps(snapshot, separators=(",", ":")).encode()


def write_snapshot(path: Path, data: bytes) -> None:
    """Replaces ``path`` with the encoded snapshot ``data`` whole, readable by this user only."""
    temporary = path.with_name(f".{path.name}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data)
    os.replace(temporary, path)


@dataclass
class Published:
    """One engine's last snapshot, as a reader found it."""

    snapshot: dict[str, Any]
    age: float
    """Seconds since it was written."""
    stale: bool
    """Its engine stopped publishing (or its process is stuck)."""


def stale_after(snapshot: dict[str, Any]) -> float:
    return max(3 * float(snapshot.get("interval", 1.0)), STALE_AFTER_SECONDS)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has that pid now
        return True
    return True


def read_snapshots(forget_after: float = FORGET_AFTER_SECONDS, now: float | None = None) -> list[Published]:
    """Every engine's last snapshot on this host, live and stale ones; the leftovers of
    engines whose process is gone deleted once they are ``forget_after`` seconds old."""
    now = time.time() if now is None else now
    found = []
    for candidate in candidate_directories():
        try:
            directory = private_directory(candidate, create=False)
        except UnsafeDirectory as exc:
            _logger.warning("otel-kvcache top: not reading snapshots from an unsafe directory: %s", exc)
            continue
        if directory is None:
            continue
        watching = directory / WATCHING
        watching.touch(mode=0o600)
        os.utime(watching)  # the engines publish their holders and requests while this is fresh
        for path in sorted(directory.glob(".engine-*.tmp")):  # a writer killed mid-write
            _forget_if_old(path, now, forget_after)
        for path in sorted(directory.glob("engine-*.json")):
            try:
                snapshot = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue  # gone since the listing, or not ours
            if not isinstance(snapshot, dict) or snapshot.get("format") != FORMAT:
                continue
            age = max(now - float(snapshot["time"]), 0.0)
            stale = age > stale_after(snapshot)
            if stale and age > forget_after and not process_alive(int(snapshot["pid"])):
                path.unlink(missing_ok=True)
                continue
            found.append(Published(snapshot, age, stale))
    return found


def _forget_if_old(path: Path, now: float, forget_after: float) -> None:
    try:
        if now - path.stat().st_mtime > forget_after:
            path.unlink(missing_ok=True)
    except OSError:
        pass
