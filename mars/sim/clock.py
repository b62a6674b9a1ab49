"""The simulator's timeline: the callbacks due on a virtual clock.

Sans-IO and framework-free. Engine steps move the clock by their modeled time; when the
engine is idle the loop jumps to the next due callback. A callback due during a step runs at
the step's end (the served engine also takes new work only between steps), but it is told the
time it was due, so what it records (a tool's end, a request's arrival) keeps its own time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

# the clock belongs to the emulated GPU's time (the pacer moves it); re-exported here, where
# the simulator's timeline reads it
from mars.emulate.pacing import VirtualClock

__all__ = ["Timeline", "VirtualClock"]


class Timeline:
    """Callbacks ``fn(due_time)`` ordered by due time, ties in scheduling order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def next_due(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run_due(self, now: float) -> int:
        """Run every callback due at or before ``now`` (including ones they schedule)."""
        n = 0
        heap = self._heap
        while heap and heap[0][0] <= now:
            t, _, fn = heapq.heappop(heap)
            fn(t)
            n += 1
        return n
