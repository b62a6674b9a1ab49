"""How an agent's context grows after admission: the forecast the packing room charges.

An agent session's context only grows: every round appends the model's output and the tool's
observation to the prompt the next round sends (paper §2.1, the spatial shift). The packing
room (:meth:`mars.policy.control.admission.BalanceAndAdmit.room`) bounds what the admitted sessions'
contexts need resident at once. Counted at their *current* sizes, the bound holds on the day
of admission and breaks later, as each admitted context grows into the room the next
admission took: on held-out ``swe-long`` (≈ 50 rounds from ~9 K to ~52 K tokens) the engine
preempted 218 running calls per 100-task run (docs/control_plane.md, *Growth forecast*).

Charging every session the growth it can still show -- the sum of each one's expected peak --
is the other error: sessions do not peak together, and most end before the others have grown.
On the generator's regimes (≈ 11 rounds, contexts growing by half) that sum held out sessions
the pool would have held, with no preemption to prevent (1-12 % slower). So the forecast is
the expected *sum* over the coming rounds, each session weighted by the chance it is still
going, and the room is charged its peak:

    F(k) = sum_i  E[ (L_i + k * g) * 1{R >= r_i + k} | R >= r_i ]       peak = max_k F(k)

where session ``i`` has sent ``r_i`` rounds and its latest prompt is ``L_i`` blocks, ``R`` is
the number of rounds a session sends and ``g`` its growth per round, both taken jointly from
the sessions that ended (the last ``max_samples``; a round as the engine's events number it,
so a side call shares its round, else one per call): so ``F(0)`` is the sum of the latest
prompts (the room as it was), and ``F`` rises above it only while the admitted sessions can be
expected to grow faster than they end. Rounds are the clock (sessions that share the engine
advance at about the same pace in rounds; which one ends first is what the survival weights
carry). A queued session is added as one about to send its first round (``r = 1``, ``L``
its prompt estimate) and charged what it raises the peak by (:class:`Projection`): at most
its own expected peak, less where its growth comes after older sessions are expected to have
ended.

It claims nothing before ``min_samples`` sessions have ended (the room as before), and a
workload whose sessions do not grow, or end before they grow, is charged nothing. Pure and
bounded: the ended sessions sorted by rounds (rebuilt when one ends), and a query costs the
sessions priced times the look-ahead points (64 round by round, then ~10 % steps).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Iterable

from mars.policy.control.packing import Footprint


class ContextGrowth:
    """Rounds and context growth of recently ended sessions; the expected peak they imply.

    ``max_samples``: the window of ended sessions (recent ones, so a workload that changes is
    followed; the size of the control plane's other windows, e.g. ``RoundGaps``).
    ``min_samples``: ended sessions needed before any forecast; the forecast is a mean over
    them, shared by every admitted session, and a mean over 8 has a standard error of about a
    third of the spread. ``dense_points``: look-ahead rounds evaluated one by one; beyond
    them, up to the longest session seen, the points are spaced geometrically (each ~10 %
    further), so a session that ran for thousands of rounds neither costs thousands of points
    nor coarsens the grid for the rest (the peak of a curve rising over tens of rounds is read
    exactly). 64 covers the long agent sessions on record (SWE-rebench-OpenHands: 64 turns on
    average).
    """

    #: spacing of the look-ahead points past ``dense_points``
    _GROWTH = 1.1

    def __init__(self, max_samples: int = 512, min_samples: int = 8,
                 dense_points: int = 64) -> None:
        if max_samples < 1 or min_samples < 1 or dense_points < 1:
            raise ValueError("max_samples, min_samples and dense_points must be >= 1")
        self.min_samples = min_samples
        self.dense_points = dense_points
        #: (rounds, growth per round in blocks) of each ended session
        self._samples: deque[tuple[int, float]] = deque(maxlen=max_samples)
        self._tables: _Tables | None = None  # cache, None = rebuild

    def observe(self, rounds: int, growth_blocks: int | float) -> None:
        """A session ended after ``rounds`` rounds, its context grown ``growth_blocks``
        blocks from its first prompt to its largest."""
        if (not isinstance(rounds, int) or rounds < 1
                or not isinstance(growth_blocks, (int, float))
                or not math.isfinite(growth_blocks)):
            return
        per_round = max(0.0, float(growth_blocks)) / (rounds - 1) if rounds > 1 else 0.0
        self._samples.append((rounds, per_round))
        self._tables = None

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def ready(self) -> bool:
        return len(self._samples) >= self.min_samples

    def _build(self) -> _Tables:
        if self._tables is None:
            self._tables = _Tables(self._samples, self.dense_points, self._GROWTH)
        return self._tables

    def _curve(self, blocks: int, rounds: int) -> list[float]:
        """One session's expected context at each look-ahead point (``[blocks]`` while the
        forecast is not ready)."""
        b, r = max(0, int(blocks)), max(1, int(rounds))
        if not self.ready:
            return [float(b)]
        t = self._build()
        base = t.count(r)
        if base == 0:  # it outlived every ended session: no evidence of growth or end
            return [float(b)] * len(t.grid)
        return [float(b)] + [(b * t.count(r + k) + k * t.growth(r + k)) / base
                             for k in t.grid[1:]]

    def project(self, sessions: Iterable[tuple[int, int]]) -> Projection:
        """The expected summed context of ``sessions`` (``(latest blocks, rounds sent)``
        each) over the coming rounds, to which more sessions can be added."""
        tables = self._build() if self.ready else None
        curve = [0.0] * (len(tables.grid) if tables else 1)
        for b, r in sessions:
            for i, v in enumerate(self._curve(b, r)):
                curve[i] += v
        return Projection(self, curve, tables)

    def peak(self, sessions: Iterable[tuple[int, int]]) -> int:
        """The expected peak, over the coming rounds, of the summed contexts of ``sessions``
        (module docstring). Their plain sum while the forecast is not ready; never less."""
        return self.project(sessions).peak

    def session_peak(self, blocks: int, rounds: int = 1) -> int:
        """One session's expected peak context (``rounds = 1``: about to send its first)."""
        return self.peak([(blocks, rounds)])


class _Tables:
    """The ended sessions sorted by rounds: how many sent at least ``m`` rounds and the sum
    of their growth per round, by binary search (no table as long as the longest session);
    and the look-ahead grid."""

    __slots__ = ("rounds", "suffix", "grid")

    def __init__(self, samples: Iterable[tuple[int, float]], dense: int, factor: float):
        pairs = sorted(samples)
        self.rounds = [r for r, _ in pairs]
        self.suffix = [0.0] * (len(pairs) + 1)
        for i in range(len(pairs) - 1, -1, -1):
            self.suffix[i] = self.suffix[i + 1] + pairs[i][1]
        top = self.rounds[-1]
        grid = list(range(0, min(top, dense) + 1))
        k = float(grid[-1])
        while grid[-1] < top:
            k *= factor
            grid.append(min(top, max(grid[-1] + 1, math.ceil(k))))
        self.grid = grid

    def count(self, m: int) -> int:
        return len(self.rounds) - bisect.bisect_left(self.rounds, m)

    def growth(self, m: int) -> float:
        return self.suffix[bisect.bisect_left(self.rounds, m)]


class Projection(Footprint):
    """The expected summed context of a set of sessions at each look-ahead point (the first
    is now: the plain sum). The packer adds the sessions it picks one by one and charges each
    what it raises the peak by -- less than its own peak where its growth comes while older
    sessions are expected to have ended."""

    __slots__ = ("_growth", "_curve", "_tables")

    def __init__(self, growth: ContextGrowth, curve: list[float],
                 tables: _Tables | None) -> None:
        self._growth = growth
        self._curve = curve
        self._tables = tables

    @property
    def peak(self) -> int:
        # (a sum of whole blocks at point 0; float noise must not cost a block)
        return math.ceil(max(self._curve) - 1e-6)

    def _extra(self, blocks: int, rounds: int) -> list[float]:
        if (self._growth._build() if self._growth.ready else None) is not self._tables:
            raise ValueError("projection is stale: the ended sessions changed since it was "
                             "made; project the sessions again")
        return self._growth._curve(blocks, rounds)

    def rise(self, blocks: int, rounds: int = 1) -> int:
        """How much adding this session would raise the peak."""
        extra = self._extra(blocks, rounds)
        top = math.ceil(max(a + b for a, b in zip(self._curve, extra)) - 1e-6)
        return top - self.peak

    def add(self, blocks: int, rounds: int = 1) -> int:
        """Add this session; return how much it raised the peak."""
        before = self.peak
        for i, v in enumerate(self._extra(blocks, rounds)):
            self._curve[i] += v
        return self.peak - before
