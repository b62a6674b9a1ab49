"""Several seeds of one bench (``mars bench --seeds 0,1,2``): each seed's bench runs into
``OUT/seed-N`` as a bench of its own, and this module pools them into ``OUT``.

Why: one seed is one draw of arrivals, prompt lengths, output lengths and tool durations. The
paired bootstrap of one bench (mars.bench.stats) says how much of a ratio could be the luck of
which tasks that one trace drew, but not how much could be the luck of that trace's arrival
pattern -- a burst that happens to land on one policy's weak spot is in every resample. Pooled
over seeds, a point's statistics are over every seed's tasks, and the interval is a
two-stage bootstrap (:func:`mars.bench.stats.clustered_ratio_interval`): seeds drawn with
replacement, then each drawn seed's paired tasks -- every policy still replays the same
traces, so the pairs stay paired, and the seed-to-seed spread enters the interval (pooled
tasks alone would keep each seed at ~1/k of every resample). Few seeds make it coarse.
The report adds MARS's mean-latency ratio seed by seed, so a ratio carried by one seed shows.

Pooled per point: latency statistics recomputed over the pooled finished tasks; task counts
and good-task counts summed; goodput (tasks/s within a run's window) and the other per-run
rates and means (TTFT, slowdown, cached fraction, tool wait) averaged over the seeds; a point
is complete only if every seed's is. Pure: documents in, documents out; no I/O but
:func:`write_combined`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .report import compare, format_tables, point_index, rate_key, write_plots
from .record import finite

__all__ = ["combine", "seed_dir", "seed_table", "write_combined"]

#: config entries a seed's bench may differ in
_PER_SEED = frozenset({"seed"})
_SUMMED = ("tasks_total", "tasks_done", "tasks_completed", "tasks_truncated", "tasks_error",
           "tasks_skipped", "tasks_interrupted", "tasks_not_started", "goodput_evaluated")
_AVERAGED = ("slowdown_mean", "ideal_mean_s", "ttft_mean_s", "cached_fraction_later",
             "tool_wait_mean_s", "tasks_per_s")
_PERCENTILES = {"p50": 50, "p90": 90, "p95": 95, "p99": 99}


def seed_dir(out: Path, seed: int) -> Path:
    return Path(out) / f"seed-{seed}"


def _mean(values: Sequence[Any]) -> float | None:
    xs = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(xs) / len(xs) if xs else None


def _pool_summary(summaries: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> dict:
    lat = {f"{seed}/{tid}": v for seed, s in zip(seeds, summaries)
           for tid, v in (s.get("task_latency_s") or {}).items()}
    done = np.array([v for v in lat.values() if v is not None], dtype=np.float64)
    latency: dict[str, float | None] = dict.fromkeys(("mean", "p50", "p90", "p95", "p99", "max"))
    if done.size:
        latency["mean"] = float(done.mean())
        latency["max"] = float(done.max())
        for k, q in _PERCENTILES.items():
            latency[k] = float(np.percentile(done, q))
    slacks = set.intersection(*(set((s.get("goodput") or {})) for s in summaries))
    out: dict[str, Any] = {
        **{k: sum(int(s.get(k) or 0) for s in summaries) for k in _SUMMED},
        "wall_s": sum(float(s.get("wall_s") or 0.0) for s in summaries),
        **{k: _mean([s.get(k) for s in summaries]) for k in _AVERAGED},
        "complete": all(bool(s.get("complete")) for s in summaries),
        "latency_s": latency,
        "goodput": {k: _mean([s["goodput"][k] for s in summaries]) for k in sorted(slacks)},
        "goodput_good": {k: sum(int((s.get("goodput_good") or {}).get(k) or 0)
                                for s in summaries) for k in sorted(slacks)},
        "task_latency_s": lat,
        "seeds": list(seeds),
    }
    return out


def _pool_point(points: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    first = points[0]
    statuses = [p.get("status") for p in points]
    errors = [f"seed {s}: {p['error']}" for s, p in zip(seeds, points) if p.get("error")]
    return {
        "regime": first["regime"], "rate": first["rate"], "policy": first["policy"],
        "status": next((st for st in statuses if st != "done"), "done"),
        "dir": first.get("dir"), "dirs": [p.get("dir") for p in points],
        "returncode": max((p.get("returncode") or 0) for p in points),
        "wall_s": sum(float(p.get("wall_s") or 0.0) for p in points),
        "reused": all(bool(p.get("reused")) for p in points),
        "ideal": first.get("ideal"), "loadavg": None,
        "error": "; ".join(errors) or None,
        "summary": (_pool_summary([p["summary"] for p in points], seeds)
                    if all(p.get("summary") for p in points) else {}),
    }


def combine(docs: Sequence[Mapping[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """One bench document pooling the seeds' documents (same config but the seed). Points
    present in every seed's bench are pooled; the others are left out (a point not yet run
    in one seed cannot be compared across seeds)."""
    if len(docs) != len(seeds) or len(docs) < 2:
        raise ValueError("combine needs two or more seed documents, one per seed")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds repeat: {list(seeds)}")
    cfgs = [{k: v for k, v in (d.get("config") or {}).items() if k not in _PER_SEED}
            for d in docs]
    for seed, cfg in zip(seeds[1:], cfgs[1:]):
        diff = sorted(k for k in cfg.keys() | cfgs[0].keys() if cfg.get(k) != cfgs[0].get(k))
        if diff:
            raise ValueError(f"the bench of seed {seed} differs from seed {seeds[0]}'s in "
                             f"more than the seed: {', '.join(diff)}")
    idx = [point_index(d.get("points") or []) for d in docs]
    keys = [k for k in idx[0] if all(k in i for i in idx[1:])]
    runs = [d.get("run") or {} for d in docs]
    return {
        "schema": docs[0].get("schema"), "version": docs[0].get("version"),
        "config": {**cfgs[0], "seed": None, "seeds": list(seeds)},
        "run": {**runs[0], "wall_s": sum(float(r.get("wall_s") or 0.0) for r in runs),
                "interrupted": any(bool(r.get("interrupted")) for r in runs),
                "seeds": list(seeds)},
        "traces": {f"seed-{s}/{k}": v for s, d in zip(seeds, docs)
                   for k, v in (d.get("traces") or {}).items()},
        "ideal": docs[0].get("ideal") or {},
        "servers": {},
        "points": [_pool_point([i[k] for i in idx], seeds) for k in keys],
    }


def seed_table(docs: Sequence[Mapping[str, Any]], seeds: Sequence[int],
               pooled: Mapping[str, Any]) -> str:
    """MARS's mean-latency ratio to the strongest baseline, per seed and pooled."""
    per_seed = [{(r["regime"], rate_key(r["rate"])): r for r in compare(d)["vs_baseline"]}
                for d in docs]
    rows = []
    for row in pooled["vs_baseline"]:
        key = (row["regime"], rate_key(row["rate"]))
        cells = [row["regime"], key[1]]
        for table in per_seed:
            cells.append(_ratio_cell(table.get(key)))
        cells.append(_ratio_cell(row, with_ci=True))
        rows.append(cells)
    header = ["regime", "rate", *[f"seed {s}" for s in seeds], "pooled"]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    lines += ["| " + " | ".join(c) + " |" for c in rows]
    return "\n".join(lines)


def _ratio_cell(row: Mapping[str, Any] | None, with_ci: bool = False) -> str:
    c = ((row or {}).get("metrics") or {}).get("mean") or {}
    r = c.get("ratio")
    if c.get("best") is None or r is None or not math.isfinite(r):
        return "–"
    ci = c.get("ci") if with_ci else None
    band = f" [{ci[0]:.2f}–{ci[1]:.2f}]" if ci else ""
    mark = "" if row.get("mars_complete") else " !"
    return f"{r:.2f}×{band}{mark} ({c['best']})"


def write_combined(out: Path, seeds: Sequence[int], command: str) -> dict[str, Any]:
    """Pool ``OUT/seed-N/bench.json`` into ``OUT/bench.json``, ``OUT/report.md`` and
    ``OUT/plots``; returns the pooled document."""
    out = Path(out)
    docs = []
    for s in seeds:
        p = seed_dir(out, s) / "bench.json"
        docs.append(json.loads(p.read_text()))
    doc = combine(docs, seeds)
    cmp = compare(doc)
    doc["comparison"] = cmp
    tables = format_tables(doc, cmp)
    plots: dict[str, str] = {}
    try:
        plots = write_plots(doc, out / "plots")
    except ImportError:
        pass
    cfg = doc["config"]
    lines = [
        "# mars bench, several seeds",
        "",
        "```",
        command,
        "```",
        "",
        f"* seeds {', '.join(map(str, seeds))}: one bench each in `seed-N/` (its own report); "
        f"here every point pools the seeds' {cfg.get('num_tasks')} tasks each, and the "
        "intervals resample seeds, then each drawn seed's paired tasks (a two-stage "
        "bootstrap: coarse with few seeds)",
        f"* regimes {', '.join(cfg.get('regimes') or [])}; policies "
        f"{', '.join(cfg.get('policies') or [])}"
        + (f"; simulated: {cfg['sim']}" if cfg.get("sim") else ""),
        f"* wall time of the seeds' benches together: {doc['run']['wall_s']:.0f} s",
        "",
        tables,
    ]
    if cmp["vs_baseline"]:
        lines += ["### MARS's mean-latency ratio per seed\n",
                  "Strongest baseline / MARS per seed (that seed's strongest baseline), and "
                  "pooled with its 95 % two-stage paired-bootstrap interval (seeds, then tasks).\n",
                  seed_table(docs, seeds, cmp), ""]
    if plots:
        lines += ["Plots: " + ", ".join(f"`{Path(v).relative_to(out)}`" for v in plots.values())]
    doc["files"] = {"report": str(out / "report.md"), **plots}
    (out / "bench.json").write_text(json.dumps(finite(doc), indent=1) + "\n")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return doc

