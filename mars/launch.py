"""Start and stop a ``mars-vllm serve`` process: shared by the tests, ``mars bench`` and the
demo so that they all run the server exactly as a user would (a real subprocess, real HTTP)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mars.procfs import comm, descendants

log = logging.getLogger(__name__)


def pin_to(cores: list[int] | None) -> set[int] | None:
    """Restrict the calling thread (and the children it starts) to ``cores``; returns the old
    mask, or None when nothing was changed (no cores given, or no affinity on this OS)."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return None
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    return old


@contextlib.contextmanager
def pinned_to(cores: list[int] | None) -> Iterator[None]:
    """Pin the calling thread while a child is started: the child inherits the mask."""
    old = pin_to(cores)
    try:
        yield
    finally:
        if old is not None:
            os.sched_setaffinity(0, old)


#: access keys a child must get explicitly (args or ``env=``), never from the caller's shell:
#: an exported key would silently turn an open test server into a keyed one
KEY_ENV_VARS = ("VLLM_API_KEY", "MARS_SIDECAR_API_KEYS", "MARS_EVENTS_API_KEY")


def clean_environ() -> dict[str, str]:
    """``os.environ`` without the access keys of :data:`KEY_ENV_VARS`."""
    return {k: v for k, v in os.environ.items() if k not in KEY_ENV_VARS}


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux
    ``PR_SET_PDEATHSIG``); returns whether it was armed. If the parent is already gone
    (``expected_parent`` given and no longer our parent), the signal is sent at once.

    Children of ``mars-vllm serve`` use SIGKILL: whatever bounds their shutdown (the drain
    timeout, the sidecar's grace period) is enforced by the parent, so with the parent gone a
    graceful shutdown could hold the GPU or the port for as long as the longest stream.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(1, int(sig)) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def tail_file(path: str | None, n: int = 40) -> str:
    """The last ``n`` lines of a log file ("" if there is none yet)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except (OSError, TypeError):
        return ""


def stop_process_group(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    """SIGTERM the child's process group, SIGKILL it if it does not exit in time."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


#: fresh-port restarts of a server whose picked port was taken before it bound it
PORT_RETRIES = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    """The console script next to the running interpreter (works inside .venv without PATH)."""
    cand = Path(sys.executable).with_name(name)
    return str(cand) if cand.exists() else name


#: the process title vLLM gives its engine's scheduler process (``VLLM::EngineCore``; the
#: kernel keeps 15 characters of a title)
ENGINE_TITLES = ("VLLM::EngineCor",)


def renice_engine(server_pid: int, niceness: int) -> int:
    """Set the niceness of every thread of vLLM's EngineCore process under ``server_pid``
    (threads it starts later inherit it) to ``niceness``; the worker that computes, the
    server's API process and the sidecar keep theirs. Returns the threads changed (0 where
    /proc is not there). Linux keeps a niceness per thread: renicing the process id alone
    changes its main thread only, which is why an earlier try here "changed nothing".

    Why: on a CPU, vLLM's EngineCore waits for its worker in a spin loop (``SpinCondition``,
    vllm/distributed/device_communicators/shm_broadcast.py) while the worker computes on
    the other core, so on a 2-core machine the request path (API server, sidecar, client)
    starved behind the two: a finished call's last chunk reached the client only when the
    engine went idle (0.5-1.2 s late while another call decoded) and a 6 ms tool ended
    1.1 s late, so the rounds of concurrent sessions lined up one after another. On a GPU
    server the host has cores to spare and answers at once, which is what the simulator
    models; with the spinner niced the request path runs first and the worker's compute
    keeps its priority."""
    done: set[int] = set()
    while True:  # again until no new thread: one not yet reniced may have started some
        fresh = False
        for pid in descendants(server_pid):
            if not comm(pid).startswith(ENGINE_TITLES):
                continue
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except (OSError, ValueError):
                continue  # (a process that ended meanwhile)
            for tid in tids:
                if tid in done:
                    continue
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, niceness)
                except OSError:
                    continue  # (a thread that ended meanwhile)
                done.add(tid)
                fresh = True
        if not fresh:
            return len(done)


@dataclass
class ServerProcess:
    """A ``mars-vllm serve`` subprocess. Use as a context manager."""

    args: list[str] = field(default_factory=list)
    port: int = 0
    startup_timeout_s: float = 300.0
    log_path: str | None = None
    events_file: str | None = None
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    #: loopback port of the engine behind the sidecar (0: pick a free one); unused with
    #: ``--no-sidecar`` in ``args``
    engine_port: int = 0
    #: niceness given to vLLM's EngineCore process once the server is up (0: left as
    #: started). On a CPU it spins on a core while the model computes, and the request path
    #: (vLLM's API server, the sidecar, the client) then waits for it: see
    #: :func:`renice_engine`
    engine_nice: int = 0
    #: threads :func:`renice_engine` changed at start
    reniced: int = field(default=0, init=False)
    #: the folder start() made for the server's log, events and sockets
    _workdir: str | None = field(default=None, init=False, repr=False)

    @property
    def headless(self) -> bool:
        """A node of vLLM's data parallelism that runs engines only (``--headless``): no API
        server, no sidecar; :meth:`start` waits only until mars-vllm has handed it over to
        vLLM (the API node's server is up once every engine's handshake is done)."""
        return "--headless" in self.args

    @property
    def sidecar(self) -> bool:
        return "--no-sidecar" not in self.args and not self.headless

    @property
    def url(self) -> str:
        """The public URL: the sidecar, or the engine itself with ``--no-sidecar``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine_url(self) -> str:
        """The vLLM server itself (behind the sidecar unless ``--no-sidecar``)."""
        return f"http://127.0.0.1:{self.engine_port}" if self.sidecar else self.url

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header for a server started with ``--api-key``."""
        if "--api-key" in self.args:
            return {"authorization": f"Bearer {self.args[self.args.index('--api-key') + 1]}"}
        return {}

    def start(self) -> "ServerProcess":
        """Start the server and wait until it answers.

        Ports left at 0 are picked free here and bound by the server a few seconds later;
        a process starting meanwhile (another server's engine, on a machine running several)
        can take one. The server then exits at once saying so (it binds its ports before it
        loads the engine), and it is started again on fresh ports, up to
        :data:`PORT_RETRIES` times; ports given by the caller are never changed.
        """
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("this server is already started (use start() or `with`, "
                               "not both)")
        pick_port, pick_engine = not self.port, not self.engine_port
        workdir = self._workdir = tempfile.mkdtemp(prefix="mars-server-")
        self.log_path = self.log_path or os.path.join(workdir, "server.log")
        self.events_file = self.events_file or os.path.join(workdir, "events.jsonl")
        for attempt in range(PORT_RETRIES + 1):
            if pick_port:
                self.port = free_port()
            cmd = [_bin("mars-vllm"), "serve", *self.args, "--host", "127.0.0.1",
                   "--port", str(self.port), "--mars-events-file", self.events_file]
            if self.sidecar:
                if pick_engine:
                    self.engine_port = free_port()
                cmd += ["--engine-port", str(self.engine_port)]
            # vLLM's ZeroMQ sockets go in the server's own folder, not /tmp: a process that
            # was killed leaves its sockets behind, and stop() removes them with the folder
            env = {**clean_environ(), "VLLM_RPC_BASE_PATH": workdir, **(self.env or {})}
            with open(self.log_path, "ab" if attempt else "wb") as log:
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)
            try:
                self._wait_ready()
                if self.engine_nice:
                    self.reniced = renice_engine(self.proc.pid, self.engine_nice)
                    if not self.reniced:
                        log.warning("engine_nice=%d: no thread of vLLM's EngineCore found "
                                    "under pid %d (process titles %s)", self.engine_nice,
                                    self.proc.pid, ENGINE_TITLES)
                return self
            except RuntimeError:
                tail = self.tail(60).lower()
                # the public port is bound (and named) by mars-vllm itself; any other taken
                # port is the engine's
                public = "cannot listen on" in tail
                retry = "address already in use" in tail and (
                    pick_port if public else pick_engine and self.sidecar)
                if not retry or attempt == PORT_RETRIES:
                    self._tidy_workdir()
                    raise
        raise AssertionError("unreachable")

    def _wait_ready(self) -> None:
        """Until the server answers (a headless node, which has no API server: until
        mars-vllm has checked its flags and handed over to vLLM, its ``mars: policy=``
        line), or has exited (a refused flag, a taken port)."""
        what = "mars-vllm serve" + (" --headless" if self.headless else "")
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}; "
                                   f"last log lines:\n{self.tail()}")
            if self._up():
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{what} not ready in {self.startup_timeout_s}s:\n{self.tail()}")

    def _up(self) -> bool:
        if self.headless:
            return "mars: policy=" in self.tail(10**6)  # (the whole log)
        try:
            return httpx.get(self.url + "/v1/models", headers=self.headers,
                             timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, n: int = 40) -> str:
        return tail_file(self.log_path, n)

    def stop(self) -> None:
        stop_process_group(self.proc, 30.0)
        self._tidy_workdir()

    def _tidy_workdir(self) -> None:
        """Remove the sockets the stopped server left in its folder, and the folder once
        nothing else (its log, its events) is in it."""
        workdir = self._workdir
        if not workdir or not os.path.isdir(workdir):
            return
        for path in Path(workdir).iterdir():
            if path.is_socket():
                with contextlib.suppress(OSError):
                    path.unlink()
        with contextlib.suppress(OSError):
            os.rmdir(workdir)  # fails, as it should, while a log or events file is in it

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
