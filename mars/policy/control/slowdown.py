"""Tool slowdown: how much longer tools run than their own type usually does -- counted only
when it stands out of the types' own variance.

Why: contention on the host's CPUs makes every CPU-bound tool run longer, so the ratio of a
call's duration to its type's usual duration is the paper's second CPU signal (§4.1: "the
number of concurrent requests executing tool calls alongside their respective execution
durations"). But recorded agent tools are heavy-tailed within a type: in the ILR traces the log
of a type's duration has a standard deviation of 1.3-2.3 (``terminal.run``: median 1.0 s, mean
7.0 s, longest 116x the median). An average of ratios over the last few calls then swings past
2x on one long call with no contention at all, and the AIMD window cut on it: with tools on
virtual cores, whose duration never depends on load, the slowdown band cut the window six times
in one run of 100 ILR-1 tasks at half the saturation rate (docs/control_plane.md).

So the estimate works in logarithms (a slowdown multiplies durations: it shifts their log),
against each type's own mean and variance of log duration, and reports the average shift only
when it exceeds ``significance`` standard errors of that average (4: for a normal average
with known variance about once in 30,000 calls; the types' baselines are estimated, so more
often while a type has few calls -- ``min_samples``); below, the slowdown is 1. (It jumps
between 1 and the average: a heavy call that widens the error can release the band's latch
mid-contention; a lower confidence bound would be smoother and much less sensitive.)
A type with a narrow distribution (a build, a test suite) reveals a 2x slowdown within a few
calls; a type that varies a hundredfold cannot, and then only the count of running tools
(``cpu_load``) speaks for contention. Framework-free; time-free (driven by tool ends).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: log-duration spread assumed at least (a type whose calls all took the same time would
#: otherwise make any timer jitter significant): 5 %
_MIN_SPREAD = 0.05


@dataclass(slots=True)
class _TypeStats:
    """Exponentially weighted mean and variance of one tool type's log duration."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0

    def update(self, x: float, alpha: float) -> None:
        # equal weights until 1/alpha samples (a plain running mean and variance), so that an
        # early variance is not an EMA's underestimate that makes every shift "significant"
        a = max(alpha, 1.0 / (self.count + 1))
        d = x - self.mean
        self.mean += a * d
        self.var = (1 - a) * (self.var + a * d * d)
        self.count += 1


class ToolSlowdown:
    """Observed over usual duration of recent tool calls, as a significant geometric mean."""

    def __init__(self, baseline_alpha: float = 0.02, ema_alpha: float = 0.2,
                 min_samples: int = 10, min_duration_s: float = 0.05,
                 significance: float = 4.0) -> None:
        self.baseline_alpha, self.ema_alpha = baseline_alpha, ema_alpha
        self.min_samples, self.min_duration_s = min_samples, min_duration_s
        self.significance = significance
        self._types: dict[str, _TypeStats] = {}
        #: EMA of the log shifts, and its variance with no slowdown: the sum over samples of
        #: (EMA weight)^2 x (that sample's type variance) -- types differ, so each sample
        #: carries its own
        self._shift: float | None = None
        self._var = 0.0
        self.samples = 0

    def observe(self, tool: str, duration_s: float) -> None:
        """One finished CPU-bound call of ``tool``."""
        if not (duration_s > 0 and math.isfinite(duration_s)):
            return
        x = math.log(duration_s)
        st = self._types.setdefault(tool, _TypeStats())
        if st.count >= self.min_samples and math.exp(st.mean) >= self.min_duration_s:
            a = self.ema_alpha
            shift, spread2 = x - st.mean, max(st.var, _MIN_SPREAD ** 2)
            if self._shift is None:
                self._shift, self._var = shift, spread2
            else:
                self._shift += a * (shift - self._shift)
                self._var = (1 - a) ** 2 * self._var + a * a * spread2
            self.samples += 1
        st.update(x, self.baseline_alpha)

    @property
    def standard_error(self) -> float | None:
        """Standard deviation of the averaged shift with no slowdown (log units)."""
        if self._shift is None:
            return None
        return math.sqrt(self._var)

    @property
    def value(self) -> float | None:
        """The slowdown factor (>= 1), 1.0 while not significant, None before any sample."""
        if self._shift is None:
            return None
        se = self.standard_error or 0.0
        if self._shift > self.significance * se:
            return math.exp(self._shift)
        return 1.0
