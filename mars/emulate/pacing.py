"""When an emulated GPU step ends: the pacer between the step-time model and a clock.

A real engine on an H100/H200 runs vLLM with asynchronous scheduling: the host prepares step
``k+1`` (scheduling, input preparation, output processing of step ``k``) while the GPU runs step
``k``, so the step cadence is ``max(GPU time, host time)``. The emulated engine runs either way:

* **async** (the default, as on the card; :mod:`mars.engine.executor.emulated_platform`): vLLM's
  ``step_with_batch_queue`` launches a step and schedules the next one before the first one's
  outputs are processed. The pacer keeps the card's timeline: a launched step starts when the
  device finishes the one before it (or at once if the device is idle) and lasts its modeled
  time (:meth:`StepPacer.launch`); its outputs are available at its end
  (:meth:`StepPacer.wait`). Host work between launches overlaps the device by construction.
* **sync** (``--no-async-scheduling``; vLLM's CPU platform's choice for the real CPU engine):
  the host work happens *between* steps. To keep the real cadence the pacer hides that host
  work under the next step: a step that starts after the engine spent ``h`` seconds of its
  own CPU since the previous step ended is due ``modeled - min(h, modeled)`` seconds after it
  starts (:meth:`StepPacer.begin` / :meth:`StepPacer.end`). The host time is the engine
  thread's CPU time (``time.thread_time``), not the wall gap, so a gap in which the engine was
  idle (waiting for requests) is not mistaken for overlapped work.

A step whose host work exceeds its modeled time cannot be hidden: it ends late (sync), or the
device waits for the host (async), as on a real GPU whose host is the bottleneck.
:class:`PacerStats` counts such steps and their lateness; the emulation is faithful only while
they stay rare (``mars bench`` reports them, and the docs show the engine's CPU time per step
against the modeled step time).

:class:`WallPacer` sleeps (paced, real time: the served stack); :class:`VirtualPacer` advances a
:class:`VirtualClock` by exactly the modeled time (the simulator, the offline engine).
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass


@dataclass(slots=True)
class PacerStats:
    """Running totals of one engine's emulated steps (seconds)."""

    steps: int = 0
    #: the step-time model's total
    modeled_s: float = 0.0
    #: the engine's own CPU time: host work between steps plus the executor's bookkeeping
    host_cpu_s: float = 0.0
    #: steps whose host work outlasted their modeled time, and by how much in total
    late_steps: int = 0
    late_s: float = 0.0

    def as_dict(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


class StepPacer(abc.ABC):
    """Makes each step take its modeled time on some clock."""

    def __init__(self) -> None:
        self.stats = PacerStats()

    @abc.abstractmethod
    def begin(self) -> None:
        """The executor was handed a step."""

    @abc.abstractmethod
    def end(self, modeled_s: float) -> None:
        """Return when the step that began last, modeled at ``modeled_s``, is due."""

    @abc.abstractmethod
    def launch(self, modeled_s: float) -> float:
        """Async scheduling: a step of ``modeled_s`` enters the device's queue now. Returns
        when it will have finished, on this pacer's clock."""

    @abc.abstractmethod
    def wait(self, done_at: float) -> None:
        """Async scheduling: return when the launched step that finishes at ``done_at`` has
        finished (its outputs are read)."""

    @abc.abstractmethod
    def busy_until(self) -> float:
        """When the device finishes the work launched so far (``-inf``: none yet); a copy
        the device is asked for now starts no earlier (its stream waits for the compute)."""

    @abc.abstractmethod
    def now(self) -> float:
        """This pacer's clock (what transfers on the emulated host link are timed on)."""

    @abc.abstractmethod
    def until(self, t: float) -> None:
        """Return at ``t`` on this pacer's clock: the engine blocks on something other than
        a step (a KV transfer it must see land)."""


class WallPacer(StepPacer):
    """Real time: sleeps until the step is due, hiding host work as async scheduling does."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.thread_time,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__()
        self._clock, self._cpu, self._sleep = clock, cpu_clock, sleep
        self._cpu_at_end: float | None = None
        self._wall_at_end = 0.0
        self._start = self._cpu_at_start = 0.0
        self._hidden = 0.0
        # async: when the device finishes the last step launched, and the steps launched
        # whose outputs are still unread
        self._free_at: float | None = None
        self._cpu_at_launch = 0.0
        self._unread = 0

    def begin(self) -> None:
        self._start, self._cpu_at_start = self._clock(), self._cpu()
        # the engine's own CPU since the last step ended (0 for the first step)
        self._hidden = 0.0 if self._cpu_at_end is None else \
            max(0.0, self._cpu_at_start - self._cpu_at_end)

    def end(self, modeled_s: float) -> None:
        st = self.stats
        st.steps += 1
        st.modeled_s += modeled_s
        if self._start - self._wall_at_end - self._hidden > modeled_s:
            # the engine sat idle (no work) for longer than a step: the GPU had nothing to
            # overlap with, so this step's host work delays it like any first step's
            self._hidden = 0.0
        host = self._hidden + max(0.0, self._cpu() - self._cpu_at_start)
        st.host_cpu_s += host
        # host work before the step hides under it up to its length; the rest delays it
        excess = max(0.0, self._hidden - modeled_s)
        left = self._start + modeled_s - min(self._hidden, modeled_s) - self._clock()
        if left > 0:
            self._sleep(left)
        late = excess + max(0.0, -left)
        if late > 0:
            st.late_steps += 1
            st.late_s += late
        self._cpu_at_end, self._wall_at_end = self._cpu(), self._clock()

    # ------------------------------------------------------------------ async
    def launch(self, modeled_s: float) -> float:
        st = self.stats
        now, cpu = self._clock(), self._cpu()
        if self._free_at is not None:
            # the engine's own work since the last launch (it overlapped the device)
            st.host_cpu_s += max(0.0, cpu - self._cpu_at_launch)
            if self._unread and now > self._free_at:
                # an earlier step was still unread: the gap between its end and this launch
                # is the device waiting for the host
                st.late_steps += 1
                st.late_s += now - self._free_at
        start = max(now, self._free_at or now)
        self._free_at = start + modeled_s
        self._cpu_at_launch = cpu
        self._unread += 1
        st.steps += 1
        st.modeled_s += modeled_s
        return self._free_at

    def wait(self, done_at: float) -> None:
        self._unread -= 1
        left = done_at - self._clock()
        if left > 0:
            self._sleep(left)

    def busy_until(self) -> float:
        return -math.inf if self._free_at is None else self._free_at

    def now(self) -> float:
        return self._clock()

    def until(self, t: float) -> None:
        left = t - self._clock()
        if left > 0:
            self._sleep(left)


class VirtualPacer(StepPacer):
    """Virtual time: each step advances ``advance`` by exactly its modeled time (sync), or
    the clock moves to the end of each launched step when its outputs are read (async: the
    device runs launched steps back to back; host work takes no virtual time)."""

    def __init__(self, advance: Callable[[float], None],
                 now: Callable[[], float] | None = None) -> None:
        super().__init__()
        self._advance = advance
        self._now = now
        self._free_at = -math.inf
        #: launched steps whose outputs were read (async)
        self.read = 0

    def begin(self) -> None:
        pass

    def end(self, modeled_s: float) -> None:
        self.stats.steps += 1
        self.stats.modeled_s += modeled_s
        self._advance(modeled_s)

    def launch(self, modeled_s: float) -> float:
        if self._now is None:
            raise RuntimeError("an async VirtualPacer needs the clock's now()")
        self.stats.steps += 1
        self.stats.modeled_s += modeled_s
        self._free_at = max(self._now(), self._free_at) + modeled_s
        return self._free_at

    def wait(self, done_at: float) -> None:
        self.read += 1
        self.until(done_at)

    def busy_until(self) -> float:
        return self._free_at

    def now(self) -> float:
        if self._now is None:
            raise RuntimeError("this VirtualPacer was given no clock's now()")
        return self._now()

    def until(self, t: float) -> None:
        left = t - self.now()
        if left > 0:
            self._advance(left)


class VirtualClock:
    """Seconds that move only when told to (starts at ``start``, an arbitrary epoch)."""

    def __init__(self, start: float = 1_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        if dt < 0:
            raise ValueError("time does not run backwards")
        self.now += dt

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t


# ---------------------------------------------------------------------------- process slot
_ACTIVE: StepPacer | None = None


def set_active(pacer: StepPacer | None) -> None:
    """The engine process's pacer. vLLM's EngineCore builds the executor and the scheduler
    separately and hands neither to the other; the scheduler publishes these stats in its
    KV snapshots, so both sides meet here (one engine per process)."""
    global _ACTIVE
    _ACTIVE = pacer


def active_stats() -> PacerStats | None:
    return _ACTIVE.stats if _ACTIVE is not None else None
