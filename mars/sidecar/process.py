"""Run ``mars sidecar`` as a subprocess (tests, benchmarks): the counterpart of
:class:`mars.launch.ServerProcess` for a sidecar in front of an engine that already runs."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from mars.launch import clean_environ, free_port, stop_process_group, tail_file


@dataclass
class SidecarProcess:
    """``python -m mars.cli.sidecar --upstream URL ...`` on 127.0.0.1. Use as a context manager."""

    upstream: str
    args: list[str] = field(default_factory=list)
    port: int = 0
    log_path: str | None = None
    startup_timeout_s: float = 60.0
    #: extra environment (keys, as ``mars-vllm serve`` passes them)
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "SidecarProcess":
        if self.proc is not None and self.proc.poll() is None:
            # a second process on the same port would fail to bind while the health check
            # answers from the first, which would then never be stopped
            raise RuntimeError("this sidecar is already started (use start() or `with`, "
                               "not both)")
        self.port = self.port or free_port()
        if self.log_path is None:
            self.log_path = os.path.join(tempfile.mkdtemp(prefix="mars-sidecar-"), "sidecar.log")
        cmd = [sys.executable, "-m", "mars.cli.sidecar", "--upstream", self.upstream,
               "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env=dict(clean_environ(), **(self.env or {})))
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mars sidecar exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/v1/mars/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"mars sidecar not ready in {self.startup_timeout_s}s:\n{self.tail()}")

    def state(self) -> dict:
        return httpx.get(self.url + "/v1/mars/state", timeout=10).json()

    def tail(self, n: int = 40) -> str:
        return tail_file(self.log_path, n)

    def stop(self) -> None:
        stop_process_group(self.proc, 15.0)

    def __enter__(self) -> "SidecarProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
