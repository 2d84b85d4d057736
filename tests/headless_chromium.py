"""Drive the system Chromium over the DevTools protocol (``--remote-debugging-pipe``), no extra package.

One :class:`Chromium` is one browser process. It loads a page at a fixed window width,
collects what the page logs (console errors, uncaught exceptions, failed loads),
evaluates JavaScript in the page and takes a full-page screenshot. The protocol runs
over the two pipes Chromium opens on fds 3 (commands in) and 4 (messages out), each
message a JSON text ended by a NUL byte.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> Optional[str]:
    """Path of a Chromium/Chrome binary on PATH (``$QC_CHROMIUM`` wins), or None."""
    forced = os.environ.get("QC_CHROMIUM")
    if forced:
        return shutil.which(forced) or (forced if Path(forced).is_file() else None)
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _as_fds_3_and_4(commands: int, messages: int) -> None:
    """In the child: the command pipe on fd 3, the message pipe on fd 4 (via fds >= 10, so neither clobbers)."""
    high_c, high_m = fcntl.fcntl(commands, fcntl.F_DUPFD, 10), fcntl.fcntl(messages, fcntl.F_DUPFD, 10)
    os.dup2(high_c, 3)
    os.dup2(high_m, 4)


class Chromium:
    """A headless browser; use as a context manager."""

    def __init__(self, binary: str, *, width: int = 1400, height: int = 900, timeout: float = 60.0) -> None:
        self.width, self.height, self.timeout = width, height, timeout
        self.events: list[dict] = []
        self._next_id = 0
        self._buffer = b""
        self._log = tempfile.TemporaryFile()  # the browser's stderr (a pipe nobody reads could fill up)
        cmd_r, self._cmd_w = os.pipe()
        self._msg_r, msg_w = os.pipe()
        # the child sees the pipe ends as fds 3 and 4
        self._proc = subprocess.Popen(
            [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--hide-scrollbars",
             "--disable-dev-shm-usage", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
            pass_fds=(3, 4), preexec_fn=lambda: _as_fds_3_and_4(cmd_r, msg_w),
        )
        os.close(cmd_r)
        os.close(msg_w)
        self.session: Optional[str] = None

    # ------------------------------------------------------------------ protocol

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message from Chromium in time")
            ready, _, _ = select.select([self._msg_r], [], [], left)
            if ready:
                chunk = os.read(self._msg_r, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the DevTools pipe; stderr: {self.stderr()[-2000:]}")
                self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(raw)

    def send(self, method: str, params: Optional[dict] = None, *, session: bool = True) -> dict:
        """Send one command and return its result; events read meanwhile are kept in :attr:`events`."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        for i, ev in enumerate(self.events):
            if ev.get("method") == method:
                return self.events.pop(i)
        while True:
            ev = self._read_message(deadline)
            if ev.get("method") == method:
                return ev
            self.events.append(ev)

    # ------------------------------------------------------------------ page

    def open(self, url: str) -> None:
        """Open ``url`` in a new tab of ``width`` x ``height`` and wait for its load event."""
        target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": self.width, "height": self.height, "deviceScaleFactor": 1, "mobile": False})
        self.send("Page.navigate", {"url": url})
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        """The JSON value of a JavaScript expression in the page; an exception there is a RuntimeError."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def problems(self) -> list[str]:
        """Console errors/warnings, uncaught exceptions and error log entries seen so far."""
        out = []
        for ev in self.events:
            method, p = ev.get("method"), ev.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "warning", "assert"):
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value", a.get("description")))
                                                               for a in p.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                out.append(f"exception: {p.get('exceptionDetails', {}).get('text')}")
            elif method == "Log.entryAdded" and p.get("entry", {}).get("level") in ("error", "warning"):
                e = p["entry"]
                out.append(f"log {e['level']} ({e.get('source')}): {e.get('text')} {e.get('url', '')}".strip())
        return out

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page (its full height, the window's width)."""
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        data = self.send("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": self.width, "height": height, "scale": 1},
        })["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def stderr(self) -> str:
        """What the browser wrote to stderr so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        try:
            if self._proc.poll() is None:
                self.session = None
                self.send("Browser.close", session=False)
        except (RuntimeError, TimeoutError, OSError):
            pass
        finally:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            for fd in (self._cmd_w, self._msg_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._log.close()

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
