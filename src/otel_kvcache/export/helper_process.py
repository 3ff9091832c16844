"""One span helper process, as the engine's end of the pipe starts and watches it.

The helper is started through a tiny launcher that forks it and exits at once: the
helper is no child of the EngineCore, in a session of its own, so vLLM's shutdown,
which SIGKILLs the EngineCore's process tree, leaves it to export what it was handed
(``helper.py``). Its stdin takes frames, never blocking (``PIPE_BYTES``: as large as
Linux lets a pipe be made); its stdout brings back acknowledgements
(``wire_format.Acknowledgement``), read never blocking either.

A helper that dies is replaced by the pipe (``helper_pipe.py``); after ``MAX_DEATHS``
deaths within ``DEATHS_WINDOW_SECONDS`` (``Deaths``) none is started again.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import sys
import time
from typing import Any

from otel_kvcache.export.drain import shared_lock
from otel_kvcache.export.wire_format import Acknowledgement
from otel_kvcache.process_identity import PROCESS_ENVIRONMENT_VARIABLE

PIPE_BYTES = 1 << 20
"""A second of a busy engine's records is a few hundred kB; the default pipe holds 64 kB."""
MAX_DEATHS = 3
DEATHS_WINDOW_SECONDS = 60.0

# Runs with ``-I -S`` (no site, no sitecustomize): forks the helper, which the exec gives
# the whole environment back, and exits, so that the helper is reparented away from the
# EngineCore's process tree.
_LAUNCHER = """\
import os, sys
if os.fork() == 0:
    os.execv(sys.executable, [sys.executable, "-m", "otel_kvcache.export.helper", *sys.argv[1:]])
os._exit(0)
"""


def helper_environment(handed_down: dict[str, Any]) -> dict[str, str]:
    """The engine's environment, with its identity for the helper's resource, and our own
    instrumentation off (the helper runs our exporter only: it must not instrument itself)."""
    environment = dict(os.environ)
    environment[PROCESS_ENVIRONMENT_VARIABLE] = json.dumps(handed_down)
    disabled = environment.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    environment["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = ",".join(
        filter(None, [disabled, "vllm_kvcache", "vllm_gpu"])
    )
    return environment


class HelperProcess:
    """A started helper: its stdin for frames, and what it last acknowledged."""

    def __init__(self, environment: dict[str, str]) -> None:
        lock = shared_lock()  # vLLM's first process waits, at its exit, while the helper holds it
        try:
            self._launcher = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=environment,
                close_fds=True,
                pass_fds=() if lock is None else (lock,),
                start_new_session=True,  # not in the engine's process group: a Ctrl-C is not for it
            )
        finally:
            if lock is not None:
                os.close(lock)  # the helper's copy keeps the lock
        self.fd = self._launcher.stdin.fileno()
        self._acks_fd = self._launcher.stdout.fileno()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._acks_fd, False)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (AttributeError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size
            pass
        self._unread = b""
        self.said = Acknowledgement(pid=0, done=0, failed=0, held=0)
        """Its last acknowledgement (its pid is 0 until it said one)."""

    @property
    def pid(self) -> int | None:
        return self.said.pid or None

    def read_acknowledgements(self) -> bool:
        """Takes what the helper said; False once its stdout closed (it exited)."""
        alive = True
        try:
            while chunk := os.read(self._acks_fd, 4096):
                self._unread += chunk
            alive = False  # end of file
        except BlockingIOError:
            pass
        *lines, self._unread = self._unread.split(b"\n")
        if lines:
            self.said = Acknowledgement.decode(lines[-1])
        if self._launcher.returncode is None:
            self._launcher.poll()  # reaps the launcher, which exits once it has forked
        return alive

    def write(self, data: memoryview) -> int:
        """Bytes of ``data`` the pipe took, until it is full; -1 if the helper is gone."""
        written = 0
        try:
            while written < len(data):
                written += os.write(self.fd, data[written:])
        except BlockingIOError:
            pass
        except OSError:
            return -1
        return written

    def wait_writable(self, timeout: float) -> None:
        select.select([], [self.fd], [], max(0.0, timeout))

    @property
    def stdin_open(self) -> bool:
        stdin = self._launcher.stdin
        return stdin is not None and not stdin.closed

    def close_stdin(self) -> None:
        """No more frames: the helper exports what it has and exits on its own."""
        try:
            self._launcher.stdin.close()
        except OSError:
            pass
        self._launcher.wait()  # the launcher exits at once: the helper is not our child

    def stop_reading(self) -> None:
        """The helper's next acknowledgement finds the pipe broken: it counts its failures itself."""
        self._launcher.stdout.close()

    def close(self) -> None:
        """Both pipes closed (the helper died, or is given up)."""
        for stream in (self._launcher.stdin, self._launcher.stdout):
            try:
                stream.close()
            except OSError:
                pass
        self._launcher.wait()

    def wait_for_exit(self, timeout: float) -> bool:
        """Whether the helper exited (its stdout closed) within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.read_acknowledgements():
                return True
            select.select([self._acks_fd], [], [], max(0.0, deadline - time.monotonic()))
        return False


class Deaths:
    """Helpers that died lately: too many, and none is started again."""

    def __init__(self) -> None:
        self._times: list[float] = []

    def one_more(self) -> bool:
        """Counts a death; whether a helper may be started in its place."""
        now = time.monotonic()
        self._times = [t for t in self._times if now - t < DEATHS_WINDOW_SECONDS] + [now]
        return len(self._times) < MAX_DEATHS

    def __len__(self) -> int:
        return len(self._times)
