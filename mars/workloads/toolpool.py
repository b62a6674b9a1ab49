"""Stand-ins for agent tools on the host CPUs: CPU-bound kinds burn real CPU on tool cores.

The paper pins tool execution to its own cores, disjoint from the serving engine's, and CPU
contention is part of what MARS schedules around: when more CPU-bound tools are due than
there are tool cores, they queue, and that wait lengthens the agent's critical path. So the
replay runs CPU-bound tools (``terminal.run``/``test``/``install``; see
:func:`mars.workloads.tools.is_cpu_bound`) in a pool of worker *processes* (one per tool core
by default), each pinned to the tool cores with ``os.sched_setaffinity``, FIFO. The time from
enqueue to a worker picking the tool up is the tool queue wait. Light kinds (file views,
edits, search, task tracker) only sleep, with no queue: they are I/O-ish and short.

What "run for the recorded duration" means is a choice (``burn``):

* ``cpu`` (default): burn ``duration`` seconds of *CPU time* in the worker. A tool needs a
  fixed amount of work; if its core is also busy with something else it takes longer in wall
  time, as a real test suite would. The wall time it took is recorded as ``run_s``.
* ``wall``: spin until ``duration`` seconds of wall time have passed (a tool bounded by a
  timer, not by work).
* ``sleep`` (*virtual tool cores*): no worker processes; a CPU-bound tool waits for one of
  ``workers`` slots and sleeps its duration while holding it. The queueing of the paper's
  dedicated tool cores, without their CPU: for an emulated GPU on a small machine, where
  burning real cores would starve the engine (``mars replay --virtual-tool-cores N``; tell the
  sidecar the same ``N`` with ``--tool-cores``).

Workers ignore SIGINT (Ctrl-C reaches the whole foreground process group); the parent stops
them cooperatively through a shared event and terminates any that do not stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mars.launch import pin_to

BURN_MODES = ("cpu", "wall", "sleep")

#: a burn never runs longer than this many times its duration (+ a floor) in wall time: a
#: starved core must not wedge the replay
_WALL_CAP_FACTOR = 20.0
_WALL_CAP_FLOOR_S = 30.0

_stop_event: Any = None


def parse_cores(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]``. Raises ``ValueError`` with a clear message."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if b < a:
                    raise ValueError
                cores.update(range(a, b + 1))
            else:
                cores.add(int(part))
    except ValueError:
        raise ValueError(f"core list must look like 0-3,6 (got {text!r})") from None
    if not cores or min(cores) < 0:
        raise ValueError(f"core list must name at least one core >= 0 (got {text!r})")
    return sorted(cores)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1))


def format_cores(cores: list[int]) -> str:
    """Inverse of :func:`parse_cores` (compact ranges)."""
    out, run = [], []
    for c in sorted(cores):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while processes are spawned (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _worker_init(cores: list[int] | None, stop_event: Any) -> None:
    """Runs first in every worker. The worker dies with the replay: a replay killed outright
    (SIGKILL, an OOM kill, a supervisor's timeout) runs no clean-up, and a pool worker never
    sees its queue close -- it holds the queue's write end itself -- so it would wait forever
    (seen: orphans still alive 18 minutes after their replay was killed)."""
    global _stop_event
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _stop_event = stop_event
    pin_to(cores)


def _exit_with_parent() -> None:
    """Exit this worker as soon as the process that spawned it is gone.

    Waits on multiprocessing's parent sentinel (a pipe the parent *process* holds) in a daemon
    thread, not on the kernel's ``PR_SET_PDEATHSIG``: that one fires when the parent *thread*
    that spawned the worker exits, and a pool may be started from a thread that ends before
    it does (``mars replay`` started it from an executor thread until 2026-11-28)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns once the parent's end of the sentinel pipe is closed
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def burn(duration_s: float, mode: str = "cpu") -> tuple[float, float, bool]:
    """Burn a core for ``duration_s`` (see module docstring). Returns ``(start, end,
    completed)`` on the system-wide monotonic clock; ``completed`` is False when stopped early
    (replay interrupted, or the wall-time safety cap hit)."""
    start = time.monotonic()
    cap = start + max(_WALL_CAP_FACTOR * duration_s, duration_s + _WALL_CAP_FLOOR_S)
    clock = time.thread_time if mode == "cpu" else time.monotonic
    target = clock() + duration_s
    x = 1.0
    checks = 0
    while clock() < target:
        for _ in range(2000):  # ~0.1 ms of arithmetic between clock reads
            x = x * 1.0000001 + 1e-9
        checks += 1
        if checks % 64 == 0:
            now = time.monotonic()
            if now > cap or (_stop_event is not None and _stop_event.is_set()):
                return start, now, False
    return start, time.monotonic(), True


@dataclass(frozen=True, slots=True)
class ToolTiming:
    """One tool phase on the system-wide monotonic clock."""

    enqueue: float
    start: float
    end: float
    cpu_bound: bool
    completed: bool = True

    @property
    def wait_s(self) -> float:
        return max(0.0, self.start - self.enqueue)

    @property
    def run_s(self) -> float:
        return max(0.0, self.end - self.start)


class ToolPool:
    """Runs tool phases: CPU-bound ones in pinned worker processes, light ones as sleeps.

    Use as an async context manager, or call :meth:`start` / :meth:`close`.
    """

    def __init__(self, cores: list[int] | None = None, workers: int | None = None,
                 burn_mode: str = "cpu") -> None:
        if burn_mode not in BURN_MODES:
            raise ValueError(f"burn mode must be one of {BURN_MODES} (got {burn_mode!r})")
        self.virtual = burn_mode == "sleep"
        if self.virtual and cores:
            raise ValueError("virtual tool cores (burn mode 'sleep') are not pinned to cores")
        self.cores = [] if self.virtual else (list(cores) if cores else available_cores())
        avail = set(available_cores())
        missing = [c for c in self.cores if c not in avail]
        if missing:
            raise ValueError(f"tool cores {format_cores(missing)} are not available to this process "
                             f"(available: {format_cores(sorted(avail))})")
        self.workers = workers or len(self.cores) or len(avail)
        if self.workers < 1:
            raise ValueError(f"tool workers must be >= 1 (got {self.workers})")
        self.burn_mode = burn_mode
        self._ctx = mp.get_context("spawn")
        self._stop = self._ctx.Event()
        self._pool: ProcessPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None
        #: CPU-bound tools waiting for a tool core / burning one (for progress display)
        self.waiting = 0
        self.running = 0

    def start(self) -> "ToolPool":
        """Start every worker and wait until each has run a no-op (blocking)."""
        for f in self._spawn():
            f.result(timeout=120)
        return self

    def _spawn(self) -> list[Any]:
        """Spawn the workers (from the calling thread, which must be the main one for the
        SIGINT mask to apply) and return the futures of one no-op each.

        Every worker is started now, not on the first tool. They are spawned with SIGINT
        ignored: an ignored signal stays ignored across exec and Python then keeps it so,
        whereas a Ctrl-C landing before _worker_init ran used to kill a half-started worker
        and leave the wait for it hanging (seen under load)."""
        if self.virtual:
            return []
        self._pool = ProcessPoolExecutor(
            max_workers=self.workers, mp_context=self._ctx, initializer=_worker_init,
            initargs=(self.cores, self._stop))
        with _sigint_ignored():
            return [self._pool.submit(burn, 0.0, "wall") for _ in range(self.workers)]

    async def run(self, duration_s: float, cpu_bound: bool,
                  on_start: Callable[[float], None] | None = None) -> ToolTiming:
        """Run one tool phase and return its timing; ``asyncio.CancelledError`` propagates.

        CPU-bound tools queue *here* (FIFO, one slot per worker), so the caller learns the
        moment a tool core is free (``on_start(monotonic time)``) and can publish
        ``tool_start`` live, and the executor never holds a backlog of its own.
        """
        enqueue = time.monotonic()
        if not cpu_bound or duration_s <= 0:
            if on_start is not None:
                on_start(enqueue)
            if duration_s > 0:
                await asyncio.sleep(duration_s)
            return ToolTiming(enqueue, enqueue, time.monotonic(), cpu_bound)
        if self._slots is None or (self._pool is None and not self.virtual):
            raise RuntimeError("ToolPool.run before start()")
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            if on_start is not None:
                on_start(time.monotonic())
            if self.virtual:
                start = time.monotonic()
                await asyncio.sleep(duration_s)
                end = time.monotonic()
                return ToolTiming(enqueue, start, end, True, True)
            start, end, done = await loop.run_in_executor(
                self._pool, burn, float(duration_s), self.burn_mode)
        finally:
            self.running -= 1
            self._slots.release()
        return ToolTiming(enqueue, start, end, True, done)

    def close(self) -> None:
        """Stop burning tools, then shut the workers down (terminating stragglers)."""
        if self._pool is None:
            return
        self._stop.set()
        pool, self._pool = self._pool, None
        procs = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + 5.0
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(timeout=2.0)

    async def __aenter__(self) -> "ToolPool":
        # spawned from the loop's thread (the main one under ``mars replay``), where the SIGINT
        # mask applies (a spawn is a fork and exec: milliseconds); the wait for the workers'
        # start-up, seconds under load, does not block the loop
        futs = self._spawn()
        if futs:
            await asyncio.wait_for(asyncio.gather(*map(asyncio.wrap_future, futs)), 120)
        self._slots = asyncio.Semaphore(self.workers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
