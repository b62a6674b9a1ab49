"""Run metrics: latency percentiles, throughput and Dynamic SLO-Aware Goodput (paper §2.1).

The paper's point (§2.1) is that throughput measures how busy the engine is, while goodput
measures whether agent tasks finish on time. Goodput (Eq. 1-2):

    G = |{ r in C_T : L_r <= SLO_r }| / T,    SLO_r = slack * L_ideal_r

``C_T`` is the set of tasks completed within the window ``T`` (a task counts in the window in
which it *finishes*), ``L_r`` a task's end-to-end latency (arrival to the end of its last
round), and ``L_ideal_r`` its latency when run alone (the paper measures it with vLLM's
maximum concurrency set to one). The slack factor is how much system-induced overhead a task
may suffer; the paper reports slack 2, 3 and 5.

A completed task without a usable ideal time (absent, NaN, infinite or <= 0) cannot be judged:
it is excluded from the numerator and reported in ``missing_ideal``, so a run with missing
ideals reports a lower bound and says by how many tasks.

Pure Python + numpy; the replay harness and the report scripts both import this.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

DEFAULT_SLACKS: tuple[float, ...] = (2.0, 3.0, 5.0)


# ------------------------------------------------------------------------------ percentiles


@dataclass(frozen=True, slots=True)
class Summary:
    """Distribution summary. Percentiles interpolate linearly (numpy's default method)."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    min: float
    max: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def summarize(values: Iterable[float]) -> Summary:
    """Mean, P50/P90/P95/P99, min and max; all NaN (count 0) for no values.

    NaN inputs raise: a NaN latency is a bug upstream, not a value to average away.
    """
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        nan = math.nan
        return Summary(0, nan, nan, nan, nan, nan, nan, nan)
    if np.isnan(a).any():
        raise ValueError("summarize: values contain NaN")
    p50, p90, p95, p99 = np.percentile(a, [50, 90, 95, 99]).tolist()
    return Summary(int(a.size), float(a.mean()), p50, p90, p95, p99, float(a.min()), float(a.max()))


def throughput(amount: float, window_s: float) -> float:
    """``amount`` (tasks, tokens) per second over a window."""
    if not window_s > 0:
        raise ValueError(f"window must be > 0 s (got {window_s})")
    return amount / window_s


# --------------------------------------------------------------------------------- outcomes


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    """What a run observed for one task. Times are seconds on one clock (the run's)."""

    task_id: str
    arrival_s: float
    #: end of the task's last round; ``None`` when it did not complete
    finish_s: float | None
    #: latency when run in isolation (paper: vLLM with max concurrency 1); ``None`` if unknown
    ideal_s: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def completed(self) -> bool:
        return self.finish_s is not None

    @property
    def latency_s(self) -> float | None:
        if self.finish_s is None:
            return None
        lat = self.finish_s - self.arrival_s
        if lat < 0:
            raise ValueError(f"task {self.task_id!r} finishes before it arrives ({lat:g} s)")
        return lat

    @property
    def has_ideal(self) -> bool:
        return self.ideal_s is not None and math.isfinite(self.ideal_s) and self.ideal_s > 0


def attach_ideal(outcomes: Iterable[TaskOutcome], ideal: Mapping[str, float]) -> list[TaskOutcome]:
    """Outcomes with ``ideal_s`` filled from a ``task_id -> isolated latency`` map (e.g. the
    results of an isolated replay of the same trace); tasks not in the map keep theirs."""
    return [replace(o, ideal_s=ideal[o.task_id]) if o.task_id in ideal else o for o in outcomes]


@dataclass(frozen=True, slots=True)
class Window:
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def contains(self, t: float) -> bool:
        return self.start_s <= t <= self.end_s


def default_window(outcomes: Sequence[TaskOutcome]) -> Window:
    """First arrival to last completion: the span over which the run did work."""
    finishes = [o.finish_s for o in outcomes if o.finish_s is not None]
    if not finishes:
        raise ValueError("no completed tasks: give an explicit window")
    return Window(min(o.arrival_s for o in outcomes), max(finishes))


def completed_in(outcomes: Iterable[TaskOutcome], window: Window) -> list[TaskOutcome]:
    """``C_T``: tasks whose finish time falls within the window (inclusive)."""
    return [o for o in outcomes if o.finish_s is not None and window.contains(o.finish_s)]


# ---------------------------------------------------------------------------------- goodput


@dataclass(frozen=True, slots=True)
class GoodputResult:
    slack: float
    #: tasks meeting their dynamic SLO per second of window (Eq. 1)
    goodput: float
    #: completed tasks with latency <= slack * ideal
    good: int
    #: completed tasks in the window that could be judged (had an ideal time)
    evaluated: int
    #: all tasks completed in the window (``|C_T|``)
    completed: int
    #: completed tasks excluded for want of a usable ideal time
    missing_ideal: int
    window_s: float

    @property
    def attainment(self) -> float:
        """Fraction of judged tasks that met their SLO (NaN when none could be judged)."""
        return self.good / self.evaluated if self.evaluated else math.nan


def meets_slo(o: TaskOutcome, slack: float) -> bool:
    """Eq. 2: ``L_r <= slack * L_ideal_r``. Needs a completed task with a usable ideal."""
    lat = o.latency_s
    if lat is None or not o.has_ideal:
        raise ValueError(f"task {o.task_id!r} cannot be judged (incomplete or no ideal time)")
    return lat <= slack * o.ideal_s  # type: ignore[operator]


def goodput(
    outcomes: Sequence[TaskOutcome], slack: float, window: Window | None = None
) -> GoodputResult:
    """Dynamic SLO-aware goodput for one slack factor (Eq. 1-2)."""
    if not slack > 0:
        raise ValueError(f"slack must be > 0 (got {slack})")
    w = window or default_window(outcomes)
    done = completed_in(outcomes, w)
    judged = [o for o in done if o.has_ideal]
    good = sum(1 for o in judged if meets_slo(o, slack))
    return GoodputResult(
        slack=float(slack),
        goodput=throughput(good, w.duration_s),
        good=good,
        evaluated=len(judged),
        completed=len(done),
        missing_ideal=len(done) - len(judged),
        window_s=w.duration_s,
    )


def goodput_report(
    outcomes: Sequence[TaskOutcome],
    slacks: Iterable[float] = DEFAULT_SLACKS,
    window: Window | None = None,
) -> dict[float, GoodputResult]:
    w = window or default_window(outcomes)
    return {float(s): goodput(outcomes, s, w) for s in slacks}


# ---------------------------------------------------------------------------- run summary


@dataclass(frozen=True, slots=True)
class RunMetrics:
    window: Window
    #: tasks completed within the window
    completed: int
    #: tasks that never completed (not counted anywhere else)
    incomplete: int
    #: end-to-end latency of the tasks completed in the window
    latency: Summary
    #: completed tasks per second of window
    request_throughput: float
    #: output tokens of the completed tasks per second of window
    output_token_throughput: float
    goodput: dict[float, GoodputResult]

    def to_dict(self) -> dict:
        return {
            "window_s": [self.window.start_s, self.window.end_s],
            "completed": self.completed,
            "incomplete": self.incomplete,
            "latency_s": self.latency.to_dict(),
            "request_throughput": self.request_throughput,
            "output_token_throughput": self.output_token_throughput,
            "goodput": {
                str(s): {
                    "goodput": g.goodput,
                    "good": g.good,
                    "evaluated": g.evaluated,
                    "missing_ideal": g.missing_ideal,
                    "attainment": g.attainment,
                }
                for s, g in self.goodput.items()
            },
        }


def evaluate(
    outcomes: Sequence[TaskOutcome],
    slacks: Iterable[float] = DEFAULT_SLACKS,
    window: Window | None = None,
) -> RunMetrics:
    """Everything a report needs from one run's outcomes."""
    w = window or default_window(outcomes)
    done = completed_in(outcomes, w)
    return RunMetrics(
        window=w,
        completed=len(done),
        incomplete=sum(1 for o in outcomes if o.finish_s is None),
        latency=summarize(o.latency_s for o in done),  # type: ignore[misc]
        request_throughput=throughput(len(done), w.duration_s),
        output_token_throughput=throughput(sum(o.output_tokens for o in done), w.duration_s),
        goodput=goodput_report(outcomes, slacks, w),
    )
