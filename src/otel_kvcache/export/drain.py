"""At its exit, vLLM's first process waits for the span helpers of the engines it started.

The helpers outlive vLLM's shutdown, which kills the EngineCores' process trees,
so that they can export what they were handed (``helper.py``). In a container
whose main process is vLLM's API server, though, its exit ends the container and
kills every process left in it. So the first process (the API server, or the
script that built an ``LLM``) makes a lock file and names it to its children in
``OTEL_KVCACHE_HELPERS_LOCK``; each engine takes a shared lock on it before it
starts a helper, which inherits the lock and holds it until it exits (a lock
belongs to the open file, not to the process that took it). The first process,
at exit, waits until it can take the lock exclusively, at most ``WAIT_SECONDS``:
as long as a helper may take to drain.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import tempfile
import time

LOCK_VARIABLE = "OTEL_KVCACHE_HELPERS_LOCK"
"""The lock file's path, set by the first process for the helpers of its engines."""
WAIT_SECONDS = 22.0
"""A helper's deadline after its engine's exit (``helper.SHUTDOWN_SECONDS``), and a little."""


def wait_for_helpers_at_exit() -> None:
    """In vLLM's first process: make the lock file, name it to the children, wait at exit."""
    path = os.path.join(tempfile.gettempdir(), f"otel-kvcache-helpers-{os.getpid()}.lock")
    if os.environ.get(LOCK_VARIABLE) == path:  # instrumented again: one wait is enough
        return
    open(path, "a").close()
    os.environ[LOCK_VARIABLE] = path
    atexit.register(_wait_for_helpers, path)


def _wait_for_helpers(path: str, timeout: float = WAIT_SECONDS) -> None:
    try:
        with open(path) as lock:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        return
                    time.sleep(0.1)
    except OSError:
        pass
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def shared_lock() -> int | None:
    """In an engine: a descriptor holding a shared lock on the first process's lock file,
    for the helper it starts to inherit (and hold until it exits); None if there is none."""
    path = os.environ.get(LOCK_VARIABLE)
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # the first process is exiting already
        os.close(fd)
        return None
    return fd
