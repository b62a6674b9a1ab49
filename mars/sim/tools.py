"""Tools on ``N`` virtual CPU cores, as ``mars replay --virtual-tool-cores N`` runs them.

A CPU-bound tool waits (FIFO) for one of ``cores`` slots and holds it for its recorded
duration; a light tool (edits, search, task tracking) starts at once and holds nothing --
the same rule as :class:`mars.workloads.toolpool.ToolPool` in ``sleep`` mode. Sans-IO: the
caller passes times and gets callbacks through the :class:`~mars.sim.clock.Timeline`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from mars.sim.clock import Timeline


@dataclass(slots=True)
class ToolRun:
    duration_s: float
    cpu_bound: bool
    enqueue: float
    on_start: Callable[[float], None]
    on_end: Callable[[float], None]
    start: float | None = None
    end: float | None = None


class VirtualCores:
    def __init__(self, cores: int, timeline: Timeline) -> None:
        if cores < 1:
            raise ValueError("virtual tool cores must be >= 1")
        self.cores = cores
        self.timeline = timeline
        self.busy = 0
        self.queue: collections.deque[ToolRun] = collections.deque()
        #: total seconds CPU-bound tools waited for a core
        self.waited_s = 0.0

    @property
    def running(self) -> int:
        return self.busy

    @property
    def waiting(self) -> int:
        return len(self.queue)

    def submit(self, now: float, duration_s: float, cpu_bound: bool,
               on_start: Callable[[float], None], on_end: Callable[[float], None]) -> ToolRun:
        run = ToolRun(max(0.0, duration_s), cpu_bound, now, on_start, on_end)
        if not cpu_bound or run.duration_s <= 0:
            self._start(run, now, holds=False)
        elif self.busy < self.cores:
            self._start(run, now, holds=True)
        else:
            self.queue.append(run)
        return run

    def _start(self, run: ToolRun, now: float, holds: bool) -> None:
        run.start = now
        if holds:
            self.busy += 1
            self.waited_s += now - run.enqueue
        run.on_start(now)

        def done(t: float) -> None:
            run.end = t
            if holds:
                self.busy -= 1
            run.on_end(t)
            if holds and self.queue and self.busy < self.cores:
                self._start(self.queue.popleft(), t, holds=True)

        self.timeline.at(now + run.duration_s, done)
