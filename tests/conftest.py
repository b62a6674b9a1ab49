"""Shared fixtures. Engine tests start real ``mars-vllm serve`` processes on the embedded tiny
model; one server per test module, or one for several modules where they need the same one
(``fcfs_server``). A start costs ~45 s of CPU here, most of it importing vLLM in each of the
server's three processes: the suite's time is mostly server starts, so a new engine test
should use a server its module (or ``fcfs_server``) already has and find its own calls by
session or request id."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

#: a small exact KV cache: 16 MiB = 32,768 tokens of the tiny model (512 B/token)
SMALL_KV = str(16 << 20)
BASE_ARGS = ["--max-model-len", "16384", "--kv-cache-memory-bytes", SMALL_KV,
             "--max-num-seqs", "32", "--seed", "0"]


def read_events(path: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """The complete events of a JSONL file that may still be being written."""
    p = Path(path)
    if not p.exists():
        return []
    text = p.read_text()
    # The writer appends whole lines, but a reader polling the live file can catch the last
    # one half-written: only lines that end in a newline are complete. A bad complete line
    # still fails the test.
    out = []
    for line in text[:text.rfind("\n") + 1].splitlines():
        if line.strip():
            ev = json.loads(line)
            if kind is None or ev.get("kind") == kind:
                out.append(ev)
    return out


def wait_for_events(path, pred, timeout_s: float = 10.0) -> list[dict]:
    """Events are flushed by a background thread every few ms: poll briefly."""
    deadline = time.monotonic() + timeout_s
    while True:
        evs = [e for e in read_events(path) if pred(e)]
        if evs or time.monotonic() > deadline:
            return evs
        time.sleep(0.1)


def _cpu_times() -> tuple[float, float]:
    """(idle, total) jiffies over all CPUs, from /proc/stat."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    vals = [float(x) for x in f]
    return vals[3] + (vals[4] if len(vals) > 4 else 0.0), sum(vals[:8])


def wait_for_quiet_cpu(idle_fraction: float = 0.85, window_s: float = 2.0,
                       timeout_s: float = 180.0) -> float:
    """Wait until the machine's CPUs are mostly idle over a whole window (processes of an
    earlier test still winding down, say), for tests that time real compute against a model
    of it. Returns the idle fraction last seen; after ``timeout_s`` it goes on regardless
    (the test then measures a busy machine, and says so if it fails)."""
    deadline = time.monotonic() + timeout_s
    idle = 0.0
    while True:
        i0, t0 = _cpu_times()
        time.sleep(window_s)
        i1, t1 = _cpu_times()
        idle = (i1 - i0) / max(1e-9, t1 - t0)
        if idle >= idle_fraction or time.monotonic() > deadline:
            return idle


def alive(procs: list) -> list[str]:
    """``pid:name`` of those of ``procs`` (psutil.Process) still running; a zombie has exited."""
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid}:{p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(procs: list, timeout_s: float) -> list[str]:
    """Wait up to ``timeout_s`` for ``procs`` to exit; returns those still running."""
    deadline = time.monotonic() + timeout_s
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


#: test modules that share one engine server (``fcfs_server``): pytest-xdist sends them to
#: one worker together (every other module goes whole to a worker of its own choosing, as
#: ``--dist loadfile`` does), so the server starts once for the three
SHARED_FCFS_SERVER = ("test_fcfs_equivalence", "test_replay_engine", "test_serve")


@pytest.hookimpl(optionalhook=True)  # (the agent environment has no pytest-xdist)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the modules of :data:`SHARED_FCFS_SERVER` as one file.
    (Not ``--dist loadgroup``: pytest-xdist 3.8 tags a group by rewriting ``item._nodeid``,
    which pytest 9 no longer reads, so every test was sent on its own and module fixtures,
    servers included, were set up on both workers.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedServerScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            name = scope.rsplit("/", 1)[-1].removesuffix(".py")
            return "fcfs-server" if name in SHARED_FCFS_SERVER else scope

    return SharedServerScheduling(config, log)


@pytest.fixture(scope="session")
def fcfs_server():
    """``mars-vllm serve`` as it starts by default (fcfs, the sidecar in front), with the
    usage's cached-token counts on, for the modules of :data:`SHARED_FCFS_SERVER`. Their
    tests find their own calls by session or request id and never assume a fresh server
    (nothing reads a counter's absolute value or the pool as a whole)."""
    with engine_server(["--enable-prompt-tokens-details"]) as srv:
        yield srv


def engine_server(extra_args: list[str] | None = None, **kw):
    vllm = pytest.importorskip("vllm")  # noqa: F841 - engine tests need the serving env
    from mars.launch import ServerProcess

    return ServerProcess(args=[*BASE_ARGS, *(extra_args or [])], **kw)


@pytest.fixture(params=["sync", "async"])
def scheduling(request, monkeypatch):
    """Run a scheduler test under both flavours vLLM can build: the synchronous class (CPU,
    the default here) and the async one a GPU user gets (``MarsAsyncScheduler``, driven as
    vLLM's batch queue drives it). Modules opt in with ``usefixtures("scheduling")``."""
    pytest.importorskip("vllm")
    from mars.engine.harness import offline

    monkeypatch.setattr(offline, "DEFAULT_ASYNC", request.param == "async")
    return request.param


def proc_label(p) -> str:
    """A ``psutil.Process``'s command line and name, "" for one that has exited meanwhile: a
    server starts short-lived children, and one not yet reaped (a zombie) or already gone
    has no command line (psutil raises; once, in a suite run, that failed a lifecycle test
    looking for the sidecar among a starting server's children)."""
    import psutil

    try:
        return " ".join(p.cmdline()) + " " + p.name()
    except psutil.Error:
        return ""
