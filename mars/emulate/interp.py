"""Monotone, smooth interpolation of measured timings (pure Python, no numpy).

Operator times grow with the work along every axis the harness varies (tokens, requests,
context), but single timings carry 0.2-2 % of run-to-run noise, enough to make a neighbour
look faster than its smaller neighbour. An interpolant through the raw points would then
predict that adding work saves time. So each axis is first made monotone by isotonic
regression (pool adjacent violators: the closest non-decreasing sequence in least squares,
which moves no point that was already in order) and then interpolated with a monotone
piecewise-cubic Hermite curve (Fritsch-Carlson, the construction behind SciPy's PCHIP): it
passes through every point, never overshoots between them, and is C1-smooth. Both are done on
log-log axes, where GPU timings are close to straight lines (fixed cost at small sizes, a
power law at large ones).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent
    violators, equal weights)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks[-1]
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    out: list[float] = []
    for m, n in blocks:
        out.extend([m] * int(n))
    return out


class Pchip:
    """Monotone cubic Hermite interpolation through ``(xs, ys)`` (``xs`` strictly
    increasing, ``ys`` monotone). Outside ``[xs[0], xs[-1]]`` it returns the end value; the
    callers decide how to extrapolate."""

    __slots__ = ("xs", "ys", "ds")

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        if len(xs) != len(ys) or not xs:
            raise ValueError("interpolation needs as many ys as xs, at least one")
        if any(b <= a for a, b in zip(xs, xs[1:])):
            raise ValueError("interpolation xs must be strictly increasing")
        self.xs, self.ys = list(map(float, xs)), list(map(float, ys))
        self.ds = self._slopes()

    def _slopes(self) -> list[float]:
        xs, ys, n = self.xs, self.ys, len(self.xs)
        if n == 1:
            return [0.0]
        h = [xs[i + 1] - xs[i] for i in range(n - 1)]
        delta = [(ys[i + 1] - ys[i]) / h[i] for i in range(n - 1)]
        if n == 2:
            return [delta[0], delta[0]]
        d = [0.0] * n
        for i in range(1, n - 1):
            a, b = delta[i - 1], delta[i]
            if a * b <= 0:
                d[i] = 0.0
            else:  # weighted harmonic mean (Fritsch-Butland / SciPy's PCHIP)
                w1, w2 = 2 * h[i] + h[i - 1], h[i] + 2 * h[i - 1]
                d[i] = (w1 + w2) / (w1 / a + w2 / b)
        d[0] = self._end_slope(h[0], h[1], delta[0], delta[1])
        d[-1] = self._end_slope(h[-1], h[-2], delta[-1], delta[-2])
        return d

    @staticmethod
    def _end_slope(h0: float, h1: float, d0: float, d1: float) -> float:
        s = ((2 * h0 + h1) * d0 - h0 * d1) / (h0 + h1)
        if s * d0 <= 0:
            return 0.0
        if d0 * d1 <= 0 and abs(s) > abs(3 * d0):
            return 3 * d0
        return s

    @property
    def lo(self) -> float:
        return self.xs[0]

    @property
    def hi(self) -> float:
        return self.xs[-1]

    def __call__(self, x: float) -> float:
        xs, ys, ds = self.xs, self.ys, self.ds
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, x) - 1
        h = xs[i + 1] - xs[i]
        t = (x - xs[i]) / h
        t2, t3 = t * t, t * t * t
        return ((2 * t3 - 3 * t2 + 1) * ys[i] + (t3 - 2 * t2 + t) * h * ds[i]
                + (-2 * t3 + 3 * t2) * ys[i + 1] + (t3 - t2) * h * ds[i + 1])


class LogCurve:
    """Seconds as a monotone function of one positive size, from measured points: isotonic
    in log time, PCHIP on log-log axes. :meth:`inside` tells whether a size is within the
    measured range; outside it, :meth:`__call__` returns the nearest end's time and the
    caller scales it (the step-time model by the roofline's ratio, and says so)."""

    __slots__ = ("curve", "lo", "hi")

    def __init__(self, sizes: Sequence[float], seconds: Sequence[float]) -> None:
        pts = sorted(zip(sizes, seconds))
        if any(s <= 0 or t <= 0 or not math.isfinite(t) for s, t in pts):
            raise ValueError("timings need positive sizes and positive, finite seconds")
        merged: dict[float, list[float]] = {}
        for s, t in pts:  # a size timed twice: the mean of its log times
            merged.setdefault(math.log(s), []).append(math.log(t))
        xs = sorted(merged)
        ys = isotonic([sum(merged[x]) / len(merged[x]) for x in xs])
        self.curve = Pchip(xs, ys)
        #: the measured range, as given (not through exp(log(x)), which can miss the ends)
        self.lo, self.hi = float(pts[0][0]), float(pts[-1][0])

    def inside(self, size: float) -> bool:
        return self.lo <= size <= self.hi

    def __call__(self, size: float) -> float:
        return math.exp(self.curve(math.log(max(size, 1e-12))))


def log_lerp(x: float, x0: float, y0: float, x1: float, y1: float) -> float:
    """``y`` at ``x`` on the straight line through ``(x0, y0)``, ``(x1, y1)`` on log-log
    axes (all positive)."""
    if x1 == x0:
        return y0
    f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
