"""Worker processes for ``mars bench --sim``: each runs simulated points one after another
(``python -m mars.cli.sim_worker``, whose docstring says why and the protocol), so that a
grid pays vLLM's import once per worker instead of once per point. A bench holds at most
``--jobs`` of them: a point takes an idle one or starts one."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

#: the worker's module (run by name: nothing here imports a command)
WORKER_MODULE = "mars.cli.sim_worker"


class PointWorker:
    """One worker process. :meth:`run` is called from one thread at a time (the pool hands a
    worker to one point); ``proc`` is what the bench signals on Ctrl-C (its own session, as
    a point's process was)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     text=True, bufsize=1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, argv: list[str], log: Path) -> int:
        """Run ``mars ARGV`` with its output in ``log``; its exit status. A worker that died
        (killed, crashed) answers with its own status, as a point's process would have."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError, ValueError):
            line = ""
        if line:
            try:
                return int(json.loads(line)["rc"])
            except (ValueError, KeyError, TypeError):
                self.proc.kill()  # an answer it cannot have written: not to be trusted again
        rc = self.proc.wait()
        return rc if rc != 0 else 1  # (it ended without answering: not a success)

    def close(self, timeout_s: float = 10.0) -> None:
        """End of input: the worker exits; killed if it does not within ``timeout_s``."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class WorkerPool:
    """Idle workers, handed out one per point; a worker that ended (a point interrupted or
    crashed it) is not handed out again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[PointWorker] = []
        self._all: list[PointWorker] = []
        self._closed = False

    def take(self) -> PointWorker:
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker pool is closed")
            while self._idle:
                w = self._idle.pop()
                if w.alive:
                    return w
            w = PointWorker()
            self._all.append(w)
            return w

    def give_back(self, w: PointWorker) -> None:
        with self._lock:
            if w.alive and not self._closed:
                self._idle.append(w)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all, self._idle = self._all, [], []
        for w in workers:
            w.close()
