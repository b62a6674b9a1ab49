"""A terminal program run as a person runs it: in a tmux pane of a fixed size, read back by
capturing the pane, driven by key presses (for ``mars top``)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest


class Pane:
    def __init__(self, argv: list[str], workdir: Path, width: int = 200, height: int = 60) -> None:
        if shutil.which("tmux") is None:
            pytest.skip("tmux is not installed")
        self.name = f"mars-test-{uuid.uuid4().hex[:8]}"
        self.rc_file = workdir / f"{self.name}.rc"
        self.err_file = workdir / f"{self.name}.err"
        self.stty = (workdir / f"{self.name}.stty-before", workdir / f"{self.name}.stty-after")
        q = shlex.quote
        # the pane's size, whatever COLUMNS / LINES the test runner's environment carries; the
        # terminal's settings before and after, to see that the program gave them back
        # (a Ctrl-C reaches the whole pane: the shell traps it, so that it lives on to record
        # the program's status; a trap, unlike an ignored signal, is not inherited)
        cmd = (f"trap true INT; stty -g > {q(str(self.stty[0]))}; "
               f"COLUMNS={width} LINES={height} {shlex.join(argv)} 2>{q(str(self.err_file))}; "
               f"rc=$?; stty -g > {q(str(self.stty[1]))}; echo $rc > {q(str(self.rc_file))}; "
               "sleep 30")
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", str(width),
                        "-y", str(height), "sh", "-c", cmd], check=True, timeout=30)

    def capture(self) -> str:
        r = subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True,
                           text=True, timeout=30)
        return r.stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True, timeout=30)

    def wait_for(self, needle: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        screen = ""
        while time.monotonic() < deadline:
            screen = self.capture()
            if needle in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{needle!r} not on screen after {timeout_s:g}s:\n{screen}")

    def exit_code(self, timeout_s: float = 30.0) -> int:
        """The program's exit status, once it has exited."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.rc_file.exists() and self.rc_file.read_text().strip():
                return int(self.rc_file.read_text())
            time.sleep(0.1)
        raise AssertionError(f"still running after {timeout_s:g}s:\n{self.capture()}")

    def terminal_restored(self) -> bool:
        """The terminal's settings after the program are those before it (echo, line mode),
        and the cursor it hid is shown again."""
        before, after = (p.read_text().strip() for p in self.stty)
        cursor = subprocess.run(["tmux", "display-message", "-p", "-t", self.name,
                                 "#{cursor_flag}"], capture_output=True, text=True, timeout=30)
        return before == after and cursor.stdout.strip() == "1"

    def stderr(self) -> str:
        return self.err_file.read_text() if self.err_file.exists() else ""

    def close(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True, timeout=30)

    def __enter__(self) -> Pane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def mars_top(url: str, workdir: Path, *extra: str) -> Pane:
    return Pane([sys.executable, "-m", "mars.cli", "top", "--url", url, *extra], workdir)
