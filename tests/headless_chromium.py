"""Headless Chromium driven over the DevTools protocol on a pipe, for page tests.

    python tests/headless_chromium.py report.html report.png    # a full-page screenshot

``--remote-debugging-pipe`` makes Chromium read protocol commands on fd 3 and
write answers and events on fd 4, NUL-terminated JSON: no port, no websocket
library. A page is loaded, the test waits for what the page says when it has
rendered, and gets back every console error and uncaught exception, where its
elements are, and a PNG of the whole page.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

FLAGS = [
    # As the machine notes start it: no sandbox as root, no GPU, nothing that
    # reaches for the network (this machine's is closed), a fresh profile.
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--remote-debugging-pipe",
]


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class LoadedPage:
    state: str
    """What the page's ready expression gave: the test's to judge."""
    errors: list[str]
    """Console errors, uncaught exceptions and error log entries, as text."""
    warnings: list[str]
    boxes: list[dict] = field(default_factory=list)
    png: bytes = b""


class Chromium:
    """One headless browser; ``load`` opens a page in a new tab."""

    def __init__(self, binary: str | None = None, timeout: float = 60.0) -> None:
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-profile-")
        commands_read, self._commands = os.pipe()
        self._answers, answers_write = os.pipe()
        # Chromium's ends, above the low fds so that moving them to 3 and 4 clobbers nothing.
        child_read = fcntl.fcntl(commands_read, fcntl.F_DUPFD, 10)
        child_write = fcntl.fcntl(answers_write, fcntl.F_DUPFD, 10)

        def to_fds_3_and_4() -> None:
            os.dup2(child_read, 3)
            os.dup2(child_write, 4)

        self._process = subprocess.Popen(
            [binary or executable() or "chromium", *FLAGS, f"--user-data-dir={self._profile.name}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=to_fds_3_and_4, close_fds=False,
        )  # fmt: skip
        for fd in (commands_read, answers_write, child_read, child_write):
            os.close(fd)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except Exception:
            pass
        try:
            self._process.wait(10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._commands)
        os.close(self._answers)
        self._profile.cleanup()

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                stderr = self._process.stderr.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"Chromium closed its pipe (exit {self._process.poll()}): {stderr}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Sends one command and waits for its answer, keeping the events that come first."""
        self._next_id += 1
        command = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            command["sessionId"] = session
        os.write(self._commands, json.dumps(command).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            message = self._receive(deadline)
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def evaluate(self, session: str, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def load(self, url: str, ready: str, width: int = 1300, boxes: str = "", wait: float = 30.0) -> LoadedPage:
        """Opens ``url``, waits until the JavaScript ``ready`` gives a true value, then
        reads the element boxes ``boxes`` selects and takes a full-page screenshot."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self.call(f"{domain}.enable", session=session)
        metrics = {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False}
        self.call("Emulation.setDeviceMetricsOverride", metrics, session)
        self.call("Page.navigate", {"url": url}, session)
        deadline = time.monotonic() + wait
        state = None
        while time.monotonic() < deadline and not state:
            state = self.evaluate(session, ready)
            time.sleep(0.2)
        page = LoadedPage(str(state), *self._console(session))
        if boxes:
            page.boxes = self.evaluate(session, _BOXES.replace("SELECTOR", json.dumps(boxes)))
        height = self.evaluate(session, "document.documentElement.scrollHeight")
        self.call("Emulation.setDeviceMetricsOverride", {**metrics, "height": int(height)}, session)
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)
        page.png = base64.b64decode(shot["data"])
        return page

    def _console(self, session: str) -> tuple[list[str], list[str]]:
        errors, warnings = [], []
        for event in self.events:
            if event.get("sessionId") != session:
                continue
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled":
                text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                if params.get("type") in ("error", "assert"):
                    errors.append(text)
                elif params.get("type") == "warning":
                    warnings.append(text)
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                errors.append(details.get("exception", {}).get("description") or details.get("text", "exception"))
            elif method == "Log.entryAdded":
                entry = params.get("entry", {})
                if entry.get("level") == "error":
                    errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
        return errors, warnings


_BOXES = """[...document.querySelectorAll(SELECTOR)].map(e => {
  const r = e.getBoundingClientRect();
  return {id: e.id, x: r.x + window.scrollX, y: r.y + window.scrollY, width: r.width, height: r.height};
})"""


def coloured_share(png: bytes, box: dict) -> float:
    """The share of a box's pixels that are coloured: the charts' marks, not their white
    background, grey gridlines, axes or black text (Pillow)."""
    from io import BytesIO

    from PIL import Image

    image = Image.open(BytesIO(png)).convert("RGB")
    left, top = int(box["x"]), int(box["y"])
    area = image.crop((left, top, left + int(box["width"]), top + int(box["height"])))
    data = area.tobytes()
    pixels = len(data) // 3
    coloured = sum(1 for i in range(0, len(data), 3) if max(data[i : i + 3]) - min(data[i : i + 3]) > 40)
    return coloured / max(pixels, 1)


def chromium_or_skip() -> str:
    binary = executable()
    if binary:
        return binary
    message = "Debian's chromium is not installed (scripts/test.sh installs it: apt-get install chromium)"
    if os.environ.get("CI"):
        pytest.fail(f"{message}: the page test must run in CI")
    pytest.skip(message)


def open_and_check(html_path: Path, charts: set[str], optional: frozenset[str] = frozenset()) -> dict:
    """Loads a report in headless Chromium: it renders with no console error, and shows
    the ``charts`` (and perhaps the ``optional`` ones), each at a real size. Returns
    each chart's share of coloured pixels, by chart key."""
    with Chromium(chromium_or_skip()) as browser:
        loaded = browser.load(
            html_path.resolve().as_uri(), "document.body && document.body.dataset.rendered", boxes=".chart"
        )
    assert loaded.state == "true", (loaded.state, loaded.errors)
    assert loaded.errors == [], loaded.errors
    assert not [w for w in loaded.warnings if "WARN" in w], loaded.warnings  # Vega's own warnings
    shares = {box["id"].removeprefix("chart-"): coloured_share(loaded.png, box) for box in loaded.boxes}
    assert charts <= set(shares) <= charts | optional, sorted(shares)
    for box in loaded.boxes:
        assert box["width"] > 200 and box["height"] > 100, box
    return shares


def main(page: str, png: str) -> int:
    with Chromium() as browser:
        loaded = browser.load(Path(page).resolve().as_uri(), "document.body && document.body.dataset.rendered")
    Path(png).write_bytes(loaded.png)
    print(f"{png}: {len(loaded.png)} bytes, page state {loaded.state}, {len(loaded.errors)} console errors")
    for error in loaded.errors:
        print(f"  {error}")
    return 0 if loaded.state == "true" and not loaded.errors else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
