"""Confidence intervals for MARS's ratio to a baseline at one operating point.

Every policy at a point replays the *same* trace, so their per-task latencies are paired:
task ``i`` under MARS and task ``i`` under the baseline faced the same arrival, prompts and
tools. The interval resamples tasks with replacement (a percentile bootstrap, deterministic
for a seed), recomputes the statistic (mean, P90, P95) of each policy over the resampled
tasks and takes the ratio, so it says how much of a ratio could be the luck of which tasks
the trace drew. Paired resampling keeps the shared difficulty of a task out of the spread,
which independent resampling would count twice. Pure numpy; no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: statistics of a latency sample, by the report's metric names
STATISTICS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": lambda a: a.mean(axis=-1),
    "p90": lambda a: np.percentile(a, 90, axis=-1),
    "p95": lambda a: np.percentile(a, 95, axis=-1),
}


@dataclass(frozen=True, slots=True)
class BootstrapConfig:
    resamples: int = 2000
    level: float = 0.95
    seed: int = 0
    #: fewer paired tasks than this: no interval (a bootstrap of a handful says little)
    min_tasks: int = 10


def paired_tasks(mars: Mapping[str, float | None],
                 base: Mapping[str, float | None]) -> tuple[np.ndarray, np.ndarray]:
    """Latencies of the tasks finished under both policies, in one order."""
    ids = sorted(k for k in mars.keys() & base.keys()
                 if mars[k] is not None and base[k] is not None)
    return (np.array([mars[k] for k in ids], dtype=np.float64),
            np.array([base[k] for k in ids], dtype=np.float64))


def ratio_interval(mars: Sequence[float] | np.ndarray, base: Sequence[float] | np.ndarray,
                   statistic: str, cfg: BootstrapConfig = BootstrapConfig()
                   ) -> tuple[float, float] | None:
    """The ``cfg.level`` interval of ``stat(base) / stat(mars)`` (> 1: MARS lower) over
    paired task resamples; None with too few tasks."""
    m, b = np.asarray(mars, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if m.shape != b.shape or m.ndim != 1:
        raise ValueError("paired samples must be two 1-D arrays of one length")
    if m.size < cfg.min_tasks:
        return None
    stat = STATISTICS[statistic]
    rng = np.random.default_rng(cfg.seed)
    idx = rng.integers(0, m.size, size=(cfg.resamples, m.size))
    sm, sb = stat(m[idx]), stat(b[idx])
    with np.errstate(divide="ignore", invalid="ignore"):
        r = sb / sm
    r = r[np.isfinite(r)]
    if r.size == 0:
        return None
    tail = (1.0 - cfg.level) / 2 * 100
    lo, hi = np.percentile(r, [tail, 100 - tail]).tolist()
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None


def clustered_ratio_interval(mars: Sequence[float] | np.ndarray,
                             base: Sequence[float] | np.ndarray, clusters: Sequence[str],
                             statistic: str, cfg: BootstrapConfig = BootstrapConfig()
                             ) -> tuple[float, float] | None:
    """The interval of :func:`ratio_interval` when the paired tasks come in clusters (the
    seeds of ``mars bench --seeds``): a two-stage bootstrap that resamples the clusters with
    replacement, then the tasks within each drawn cluster. Resampling pooled tasks alone
    would keep each seed's share of every resample at ~1/k, so a burst in one seed's
    arrivals would sit in every resample: the seed-to-seed spread is what the clusters add.
    With few clusters the interval is coarse (three seeds give ten distinct seed draws).
    One cluster: :func:`ratio_interval`."""
    m, b = np.asarray(mars, dtype=np.float64), np.asarray(base, dtype=np.float64)
    if m.shape != b.shape or m.ndim != 1 or len(clusters) != m.size:
        raise ValueError("paired samples and their clusters must be 1-D and of one length")
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(clusters):
        groups.setdefault(c, []).append(i)
    if len(groups) < 2:
        return ratio_interval(m, b, statistic, cfg)
    if m.size < cfg.min_tasks:
        return None
    members = [np.asarray(v) for v in groups.values()]
    stat = STATISTICS[statistic]
    rng = np.random.default_rng(cfg.seed)
    drawn = rng.integers(0, len(members), size=(cfg.resamples, len(members)))
    r = np.empty(cfg.resamples)
    for j in range(cfg.resamples):
        idx = np.concatenate([g[rng.integers(0, g.size, size=g.size)]
                              for g in (members[k] for k in drawn[j])])
        sm, sb = stat(m[idx]), stat(b[idx])
        r[j] = sb / sm if sm != 0 else math.nan
    r = r[np.isfinite(r)]
    if r.size == 0:
        return None
    tail = (1.0 - cfg.level) / 2 * 100
    lo, hi = np.percentile(r, [tail, 100 - tail]).tolist()
    return (lo, hi) if math.isfinite(lo) and math.isfinite(hi) else None
