"""What ``mars bench`` makes of its runs: the comparison tables and the plots.

Everything here is a pure function of the ``bench.json`` document (schema ``mars-bench``),
so a finished or interrupted bench can be re-rendered without a server
(``experiments/plot_bench.py DIR``). The document's ``points`` hold one compact summary per
(regime, rate, policy); :func:`compare` derives from them what the paper reports in §6.3
and §6.5:

* per regime and rate: mean / P90 / P95 task latency and goodput of every policy;
* MARS's ratio to the **strongest baseline at each point**, per metric (the baseline with
  the lowest latency, or the highest goodput, at that point; each metric picks its own).
  Latency ratios are ``baseline / mars`` and goodput ratios ``mars / baseline``, so > 1
  always means MARS is better (the paper's "improves by 1.44x");
* the ablation: each of ``mars_no_coord`` / ``mars_no_ctrl`` / ``mars_no_cosched`` against
  ``mars`` (``variant / mars`` for latency, so > 1 means the removed component helped).

Latency ratios carry a 95 % interval where the points hold per-task latencies: a paired
bootstrap over the trace's tasks (:mod:`mars.bench.stats`; all policies at a point replay the
same tasks). A ratio whose interval excludes 1 is counted as a *clear* win or loss.

A run whose tasks did not all finish (errors, interruption) is *incomplete*: its latency
statistics cover only the finished tasks, which flatters it, so it is marked ``!`` in the
tables and never chosen as the strongest baseline.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mars.bench.stats import BootstrapConfig, clustered_ratio_interval, paired_tasks, ratio_interval

#: the paper's baselines (§6.2), in its order
BASELINES = ("fcfs", "autellix", "infercept", "continuum", "continuum_dy")
#: the paper's ablations (§6.5), each MARS minus one component
ABLATIONS = ("mars_no_coord", "mars_no_ctrl", "mars_no_cosched")
MARS = "mars"
LATENCY_METRICS = (("mean", "mean"), ("p90", "P90"), ("p95", "P95"))


# ------------------------------------------------------------------------------ helpers


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def _fin(x: Any) -> bool:
    return math.isfinite(_num(x))


def fmt_s(x: Any) -> str:
    v = _num(x)
    if not math.isfinite(v):
        return "–"
    return f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}"


def fmt_rate(x: Any) -> str:
    v = _num(x)
    if not math.isfinite(v):
        return "–"
    return f"{v:.3g}" if v >= 0.001 or v == 0 else f"{v:.2e}"


def fmt_ratio(x: Any) -> str:
    v = _num(x)
    if math.isinf(v):
        return "∞"
    if not math.isfinite(v):
        return "–"
    return f"{v:.2f}×"


def slack_key(s: float | str) -> str:
    return f"{float(s):g}"


def rate_key(r: float | str) -> str:
    return f"{float(r):g}"


def regime_rates(cfg: Mapping[str, Any], regime: str) -> list[str]:
    """The rate keys of ``regime``: its own list (a preset's per-regime rates) or the
    bench's."""
    own = (cfg.get("regime_rates") or {}).get(regime)
    return [rate_key(r) for r in (own if own else cfg.get("rates") or [])]


def point_index(points: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str, str], Mapping]:
    """``(regime, rate key, policy) -> point`` (the last one wins on duplicates)."""
    return {(p["regime"], rate_key(p["rate"]), p["policy"]): p for p in points}


def metric(point: Mapping[str, Any] | None, name: str) -> float:
    """A latency statistic (``mean``, ``p90``, ...) or ``goodput@<slack>`` of a point."""
    if not point:
        return math.nan
    s = point.get("summary") or {}
    if name.startswith("goodput@"):
        return _num((s.get("goodput") or {}).get(name.split("@", 1)[1]))
    return _num((s.get("latency_s") or {}).get(name))


def complete(point: Mapping[str, Any] | None) -> bool:
    return bool(point and (point.get("summary") or {}).get("complete"))


def _lower_better(name: str) -> bool:
    return not name.startswith("goodput@")


def ratio(mars: float, base: float, lower_better: bool) -> float:
    """> 1 means MARS is better: ``base / mars`` for latency, ``mars / base`` for goodput."""
    if not (math.isfinite(mars) and math.isfinite(base)):
        return math.nan
    num, den = (base, mars) if lower_better else (mars, base)
    if den == 0:
        return math.inf if num > 0 else math.nan
    return num / den


# ------------------------------------------------------------------------------ compare


def compare(doc: Mapping[str, Any]) -> dict[str, Any]:
    """MARS vs the strongest baseline per point and metric, and the ablation ratios.

    Returns ``{"vs_baseline": [...], "ablation": [...], "wins": {...}}``; see the module
    docstring for the definitions.
    """
    cfg = doc.get("config") or {}
    regimes = list(cfg.get("regimes") or [])
    policies = list(cfg.get("policies") or [])
    slacks = [slack_key(s) for s in cfg.get("slacks") or (2, 3, 5)]
    idx = point_index(doc.get("points") or [])
    metrics = [m for m, _ in LATENCY_METRICS] + [f"goodput@{s}" for s in slacks]
    baselines = [p for p in BASELINES if p in policies]

    vs: list[dict[str, Any]] = []
    wins = {m: {"better": 0, "points": 0, "with_ci": 0, "clearly_better": 0,
                "clearly_worse": 0} for m in metrics}
    if MARS in policies and baselines:
        for reg in regimes:
            for rate in regime_rates(cfg, reg):
                mp = idx.get((reg, rate, MARS))
                row: dict[str, Any] = {"regime": reg, "rate": float(rate),
                                       "mars_complete": complete(mp), "metrics": {}}
                for m in metrics:
                    lower = _lower_better(m)
                    cands = [(metric(idx.get((reg, rate, b)), m), b) for b in baselines
                             if complete(idx.get((reg, rate, b)))]
                    cands = [(v, b) for v, b in cands if math.isfinite(v)]
                    mv = metric(mp, m)
                    if not cands:
                        row["metrics"][m] = {"mars": mv, "best": None, "best_value": math.nan,
                                             "ratio": math.nan}
                        continue
                    bv, best = (min if lower else max)(cands)
                    r = ratio(mv, bv, lower)
                    ci = _interval(mp, idx.get((reg, rate, best)), m)
                    row["metrics"][m] = {"mars": mv, "best": best, "best_value": bv, "ratio": r,
                                         "ci": ci}
                    if math.isfinite(mv) and complete(mp):
                        wins[m]["points"] += 1
                        # goodput: a tie (e.g. both at the same value) counts as not worse
                        if (mv < bv) if lower else (mv >= bv and mv > 0):
                            wins[m]["better"] += 1
                        if ci is not None:
                            wins[m]["with_ci"] += 1
                            wins[m]["clearly_better"] += ci[0] > 1
                            wins[m]["clearly_worse"] += ci[1] < 1
                vs.append(row)

    abl: list[dict[str, Any]] = []
    variants = [v for v in ABLATIONS if v in policies]
    if MARS in policies and variants:
        for reg in regimes:
            for rate in regime_rates(cfg, reg):
                mp = idx.get((reg, rate, MARS))
                row = {"regime": reg, "rate": float(rate), "mars_complete": complete(mp),
                       "metrics": {}}
                for m in ("mean", "p95", f"goodput@{slacks[len(slacks) // 2]}" if slacks else None):
                    if m is None:
                        continue
                    lower = _lower_better(m)
                    mv = metric(mp, m)
                    cells = {"mars": mv}
                    for v in variants:
                        vp = idx.get((reg, rate, v))
                        vv = metric(vp, m)
                        # variant / mars for latency (> 1: the component helps); for goodput
                        # mars / variant, so > 1 also means the component helps
                        r = ratio(mv, vv, lower)
                        cells[v] = {"value": vv, "ratio": r, "complete": complete(vp)}
                    row["metrics"][m] = cells
                abl.append(row)
    return {"vs_baseline": vs, "ablation": abl, "wins": wins, "baselines": baselines,
            "variants": variants}


def _interval(mars_point: Mapping[str, Any] | None, base_point: Mapping[str, Any] | None,
              name: str) -> list[float] | None:
    """The paired-bootstrap interval of a latency ratio, when both points carry per-task
    latencies (bench documents before they did: none)."""
    if name not in ("mean", "p90", "p95") or not mars_point or not base_point:
        return None
    a = (mars_point.get("summary") or {}).get("task_latency_s")
    b = (base_point.get("summary") or {}).get("task_latency_s")
    if not a or not b:
        return None
    if (mars_point.get("summary") or {}).get("seeds"):  # pooled seeds: "<seed>/<task>" keys
        ids = sorted(k for k in a.keys() & b.keys() if a[k] is not None and b[k] is not None)
        ci = clustered_ratio_interval([a[k] for k in ids], [b[k] for k in ids],
                                      [k.split("/", 1)[0] for k in ids], name,
                                      BootstrapConfig())
    else:
        ci = ratio_interval(*paired_tasks(a, b), name, BootstrapConfig())
    return None if ci is None else [round(ci[0], 4), round(ci[1], 4)]


# ------------------------------------------------------------------------------- tables


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|")


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    align = align or "l" * 2 + "r" * (len(header) - 2)
    sep = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    out = ["| " + " | ".join(_cell(h) for h in header) + " |", sep]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _done(point: Mapping[str, Any] | None) -> str:
    if not point:
        return "–"
    s = point.get("summary") or {}
    if not s:
        return "–"
    mark = "" if s.get("complete") else " !"
    return f"{s.get('tasks_done', 0)}/{s.get('tasks_total', 0)}{mark}"


def _ordered_policies(policies: Sequence[str]) -> list[str]:
    """Baselines in the paper's order, then mars, then the ablations, then anything else."""
    order = [*BASELINES, MARS, *ABLATIONS]
    known = [p for p in order if p in policies]
    return known + [p for p in policies if p not in known]


def latency_table(doc: Mapping[str, Any], regime: str) -> str:
    cfg = doc.get("config") or {}
    slacks = [slack_key(s) for s in cfg.get("slacks") or (2, 3, 5)]
    policies = _ordered_policies(cfg.get("policies") or [])
    idx = point_index(doc.get("points") or [])
    rows = []
    for rate in regime_rates(cfg, regime):
        pts = {p: idx.get((regime, rate, p)) for p in policies}
        best = {}  # bold: the best complete run among the baselines and mars (not ablations)
        for m in ["mean", "p90", "p95"] + [f"goodput@{s}" for s in slacks]:
            vals = [metric(pt, m) for p, pt in pts.items() if complete(pt) and p not in ABLATIONS]
            vals = [v for v in vals if math.isfinite(v)]
            if len(vals) > 1:
                best[m] = (min if _lower_better(m) else max)(vals)
        for p in policies:
            pt = pts[p]
            if pt is None:
                continue
            row = [rate, p, _done(pt)]
            for m in ["mean", "p90", "p95"]:
                v = metric(pt, m)
                cell = fmt_s(v)
                if complete(pt) and m in best and v == best[m] and p not in ABLATIONS:
                    cell = f"**{cell}**"
                row.append(cell)
            for s in slacks:
                m = f"goodput@{s}"
                v = metric(pt, m)
                cell = fmt_rate(v)
                if (complete(pt) and m in best and v == best[m] and best[m] > 0
                        and p not in ABLATIONS):
                    cell = f"**{cell}**"
                row.append(cell)
            row.append(_status_note(pt))
            rows.append(row)
    header = ["rate", "policy", "done", "mean (s)", "P90 (s)", "P95 (s)",
              *[f"goodput s={s} (tasks/s)" for s in slacks], "note"]
    return _table(header, rows, "ll" + "r" * (len(header) - 3) + "l")


def _status_note(pt: Mapping[str, Any]) -> str:
    st = pt.get("status")
    s = pt.get("summary") or {}
    bits = []
    if st and st != "done":
        bits.append(st.replace("_", " "))
    for k in ("error", "skipped", "interrupted", "not_started"):
        if s.get(f"tasks_{k}"):
            bits.append(f"{s[f'tasks_{k}']} {k}")
    if s.get("tasks_truncated"):
        bits.append(f"{s['tasks_truncated']} truncated")
    if pt.get("reused"):
        bits.append("reused")
    return ", ".join(bits)


def vs_baseline_table(cmp: Mapping[str, Any], slacks: Sequence[str]) -> str:
    rows = []
    for row in cmp["vs_baseline"]:
        cells = [row["regime"], rate_key(row["rate"])]
        for m in ["mean", "p90", "p95"] + [f"goodput@{s}" for s in slacks]:
            c = row["metrics"].get(m) or {}
            if c.get("best") is None or not _fin(c.get("mars")):
                cells.append("–")
                continue
            mark = "" if row["mars_complete"] else " !"
            ci = c.get("ci")
            band = f" [{ci[0]:.2f}–{ci[1]:.2f}]" if ci else ""
            cells.append(f"{fmt_ratio(c['ratio'])}{band}{mark} (vs {c['best']})")
        rows.append(cells)
    header = ["regime", "rate", "mean", "P90", "P95", *[f"goodput s={s}" for s in slacks]]
    return _table(header, rows)


def wins_line(cmp: Mapping[str, Any], slacks: Sequence[str]) -> str:
    w = cmp["wins"]
    parts = []
    any_ci = any((d or {}).get("with_ci") for d in w.values())
    for m, label in [("mean", "mean latency"), ("p90", "P90"), ("p95", "P95")] + [
            (f"goodput@{s}", f"goodput s={s}") for s in slacks]:
        d = w.get(m) or {}
        if d.get("points"):
            clear = ""
            if d.get("with_ci"):
                clear = (f" ({d['clearly_better']} clearly better, {d['clearly_worse']} "
                         "clearly worse)")
            parts.append(f"{label} {d['better']}/{d['points']}{clear}")
    if not parts:
        return ""
    return ("MARS beats the strongest baseline (goodput: at least equal and > 0) at: "
            + ", ".join(parts) + " points."
            + (" Clearly: the ratio's 95 % paired-bootstrap interval over the trace's tasks "
               "excludes 1." if any_ci else ""))


def ablation_table(cmp: Mapping[str, Any]) -> str:
    variants = list(cmp["variants"])
    rows = []
    for row in cmp["ablation"]:
        for m, cells in row["metrics"].items():
            label = {"mean": "mean (s)", "p95": "P95 (s)"}.get(m, m.replace("goodput@", "goodput s=")
                                                          + " (tasks/s)")
            fmt = fmt_s if not m.startswith("goodput@") else fmt_rate
            out = [row["regime"], rate_key(row["rate"]), label,
                   fmt(cells["mars"]) + ("" if row["mars_complete"] else " !")]
            for v in variants:
                c = cells[v]
                mark = "" if c["complete"] else " !"
                out.append(f"{fmt(c['value'])}{mark} ({fmt_ratio(c['ratio'])})"
                           if _fin(c["value"]) else "–")
            rows.append(out)
    header = ["regime", "rate", "metric", "mars", *variants]
    return _table(header, rows, "lll" + "r" * (len(header) - 3))


def format_tables(doc: Mapping[str, Any], cmp: Mapping[str, Any] | None = None) -> str:
    """The whole comparison as markdown (what ``mars bench`` prints and writes to report.md)."""
    cmp = cmp or compare(doc)
    cfg = doc.get("config") or {}
    slacks = [slack_key(s) for s in cfg.get("slacks") or (2, 3, 5)]
    out: list[str] = []
    for reg in cfg.get("regimes") or []:
        out.append(f"### {reg}: task latency and goodput per policy and rate\n")
        out.append(latency_table(doc, reg))
        out.append("")
    if cmp["vs_baseline"]:
        out.append("### MARS vs the strongest baseline at each point\n")
        out.append("Latency: strongest baseline / MARS; goodput: MARS / strongest baseline "
                   "(> 1: MARS better). The strongest baseline is picked per point and metric "
                   f"among {', '.join(cmp['baselines'])}.\n")
        out.append(vs_baseline_table(cmp, slacks))
        line = wins_line(cmp, slacks)
        if line:
            out.append("\n" + line)
        out.append("")
    if cmp["ablation"]:
        out.append("### Ablation: MARS without one component\n")
        out.append("(×) = variant / mars for latency, mars / variant for goodput: > 1 means "
                   "the removed component helps.\n")
        out.append(ablation_table(cmp))
        out.append("")
    if any(p.get("summary") and not complete(p) for p in doc.get("points") or []):
        out.append("`!`: not every task of that run finished (its latency covers only the "
                   "finished ones); such runs are never picked as the strongest baseline.")
    return "\n".join(out).rstrip() + "\n"


# -------------------------------------------------------------------------------- plots

_STYLE = {
    "fcfs": ("C0", "o"), "autellix": ("C1", "s"), "infercept": ("C2", "^"),
    "continuum": ("C4", "D"), "continuum_dy": ("C5", "v"), "mars": ("C3", "*"),
    "mars_no_coord": ("C6", "P"), "mars_no_ctrl": ("C7", "X"), "mars_no_cosched": ("C8", "h"),
}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(doc: Mapping[str, Any], regime: str, policy: str, name: str) -> tuple[list, list]:
    idx = point_index(doc.get("points") or [])
    xs, ys = [], []
    for r in regime_rates(doc.get("config") or {}, regime):
        v = metric(idx.get((regime, r, policy)), name)
        if math.isfinite(v):
            xs.append(float(r))
            ys.append(v)
    return xs, ys


def _lines(ax: Any, doc: Mapping[str, Any], regime: str, policies: Sequence[str], name: str) -> bool:
    drawn = False
    idx = point_index(doc.get("points") or [])
    for p in policies:
        xs, ys = _series(doc, regime, p, name)
        if not xs:
            continue
        color, marker = _STYLE.get(p, (None, "."))
        is_mars = p == MARS
        ax.plot(xs, ys, marker=marker, color=color, label=p.replace("_", "-"),
                linewidth=2.4 if is_mars else 1.3, markersize=9 if is_mars else 6,
                zorder=3 if is_mars else 2)
        bad = [(x, y) for x, y in zip(xs, ys)
               if not complete(idx.get((regime, rate_key(x), p)))]
        if bad:
            ax.scatter(*zip(*bad), facecolors="none", edgecolors="k", s=140, zorder=4)
        drawn = True
    return drawn


def plot_latency_vs_rate(doc: Mapping[str, Any], regime: str, path: str | os.PathLike[str]) -> Path | None:
    """Mean / P90 / P95 task latency vs arrival rate, one line per policy (Figures 7-10)."""
    policies = [p for p in _ordered_policies((doc.get("config") or {}).get("policies") or [])
                if p not in ABLATIONS]
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    drawn = False
    for ax, (m, label) in zip(axes, LATENCY_METRICS):
        drawn |= _lines(ax, doc, regime, policies, m)
        ax.set_title(f"{regime}: {label} latency")
        ax.set_xlabel(_rate_label(doc))
        ax.set_ylabel("task latency (s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return None
    _legend(fig, axes[0])
    return _save(fig, plt, path)


def plot_goodput_vs_rate(doc: Mapping[str, Any], regime: str, path: str | os.PathLike[str]) -> Path | None:
    """Goodput per slack vs arrival rate (Figure 9)."""
    cfg = doc.get("config") or {}
    slacks = [slack_key(s) for s in cfg.get("slacks") or (2, 3, 5)]
    policies = [p for p in _ordered_policies(cfg.get("policies") or []) if p not in ABLATIONS]
    plt = _plt()
    fig, axes = plt.subplots(1, len(slacks), figsize=(4.4 * len(slacks), 3.8), squeeze=False)
    drawn = False
    for ax, s in zip(axes[0], slacks):
        drawn |= _lines(ax, doc, regime, policies, f"goodput@{s}")
        ax.set_title(f"{regime}: goodput, slack {s}")
        ax.set_xlabel(_rate_label(doc))
        ax.set_ylabel("goodput (tasks/s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return None
    _legend(fig, axes[0][0])
    return _save(fig, plt, path)


def plot_ablation(doc: Mapping[str, Any], regime: str, path: str | os.PathLike[str]) -> Path | None:
    """Mean and P95 latency of mars and its ablations per rate, as grouped bars (Figure 13)."""
    cfg = doc.get("config") or {}
    policies = [p for p in (MARS, *ABLATIONS) if p in (cfg.get("policies") or [])]
    if MARS not in policies or len(policies) < 2:
        return None
    idx = point_index(doc.get("points") or [])
    rates = regime_rates(cfg, regime)
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(policies)
    drawn = False
    for ax, (m, label) in zip(axes, (("mean", "mean"), ("p95", "P95"))):
        for i, p in enumerate(policies):
            ys = [metric(idx.get((regime, r, p)), m) for r in rates]
            xs = [k + (i - (len(policies) - 1) / 2) * width for k in range(len(rates))]
            ok = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
            if not ok:
                continue
            ax.bar(*zip(*ok), width=width, color=_STYLE.get(p, (None,))[0],
                   label=p.replace("_", "-"))
            drawn = True
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel(_rate_label(doc))
        ax.set_ylabel("task latency (s)")
        ax.set_title(f"{regime}: ablation, {label} latency")
        ax.grid(alpha=0.3, axis="y")
    if not drawn:
        plt.close(fig)
        return None
    _legend(fig, axes[0])
    return _save(fig, plt, path)


def _rate_label(doc: Mapping[str, Any]) -> str:
    ts = _num((doc.get("config") or {}).get("time_scale"))
    if math.isfinite(ts) and ts != 1:
        return f"arrival rate (tasks/s, nominal; real ×{ts:g})"
    return "arrival rate (tasks/s)"


def _legend(fig: Any, ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 9),
                   fontsize="small", frameon=False)
        fig.tight_layout(rect=(0, 0, 1, 0.9))


def _save(fig: Any, plt: Any, path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if not fig.get_layout_engine():
        fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def write_plots(doc: Mapping[str, Any], directory: str | os.PathLike[str]) -> dict[str, str]:
    """Every plot of the bench into ``directory``; ``{name: path}`` of those drawn."""
    d = Path(directory)
    out: dict[str, str] = {}
    for reg in (doc.get("config") or {}).get("regimes") or []:
        for name, fn in (("latency_vs_rate", plot_latency_vs_rate),
                         ("goodput_vs_rate", plot_goodput_vs_rate),
                         ("ablation", plot_ablation)):
            p = fn(doc, reg, d / f"{name}_{reg}.png")
            if p is not None:
                out[f"{name}_{reg}"] = str(p)
    return out
