"""What a bench leaves behind: ``bench.json`` (the configuration, every point's compact
summary, the servers, the comparison), written after every point so that a crash loses nothing
finished, and ``report.md`` (the command, the set-up, the tables of :mod:`mars.bench.report`).
No I/O but :func:`write_document`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .report import rate_key, regime_rates

BENCH_SCHEMA = "mars-bench"
BENCH_VERSION = 1


def point_summary(res) -> dict[str, Any]:
    """The numbers the comparison needs from one ``results.json`` (a ``RunResult``)."""
    from mars.workloads.results import DONE_STATUSES

    s = res.summary
    t = s.get("tasks") or {}
    total = int(t.get("total", 0))
    done = sum(int(t.get(k, 0)) for k in DONE_STATUSES)
    lat = s.get("latency_s") or {}
    gp = s.get("goodput") or {}
    judged = {k: v for k, v in gp.items() if v and v.get("evaluated")}

    def get(*path: str) -> Any:
        cur: Any = s
        for p in path:
            cur = cur.get(p) if isinstance(cur, dict) else None
        return cur

    return {
        "tasks_total": total, "tasks_done": done,
        **{f"tasks_{k}": int(t.get(k, 0)) for k in
           ("completed", "truncated", "error", "skipped", "interrupted", "not_started")},
        "complete": total > 0 and done == total and not res.run.get("interrupted"),
        "rounds": s.get("rounds"),
        "latency_s": {k: lat.get(k) for k in ("mean", "p50", "p90", "p95", "p99", "max")},
        "goodput": {k: v.get("goodput") for k, v in judged.items()},
        "goodput_good": {k: v.get("good") for k, v in judged.items()},
        "goodput_evaluated": max((v.get("evaluated", 0) for v in judged.values()), default=0),
        "slowdown_mean": get("slowdown", "mean"),
        "ideal_mean_s": get("ideal_latency_s", "mean"),
        "ttft_mean_s": get("ttft_s", "mean"),
        "cached_fraction_later": get("cached_fraction", "later_rounds_token_weighted"),
        "tool_wait_mean_s": get("tool_wait_s", "mean"),
        "tasks_per_s": get("throughput", "tasks_per_s"),
        "wall_s": res.run.get("wall_s"),
        # per-task latency (None: not finished): the paired intervals of the comparison
        "task_latency_s": {t.task_id: (None if t.latency_s is None else round(t.latency_s, 4))
                           for t in res.tasks},
    }


def report_md(doc: Mapping[str, Any], tables: str, plots: Mapping[str, str], out: Path) -> str:
    """``report.md``: the command, the set-up in a few lines, the tables, the plots."""
    cfg = doc["config"]
    run = doc["run"]
    lines = [
        "# mars bench",
        "",
        "```",
        "mars " + " ".join(_shell_quote(a) for a in _cli_args(run["command"])),
        "```",
        "",
        f"* regimes {', '.join(cfg['regimes'])}; rates "
        + ("; ".join(f"{reg}: {', '.join(regime_rates(cfg, reg))}" for reg in cfg["regimes"])
           if cfg.get("regime_rates") else ", ".join(rate_key(r) for r in cfg["rates"])) +
        f" tasks/s (nominal; time compressed ×{cfg['time_scale']:g}); {cfg['num_tasks']} tasks "
        f"per point, seed {cfg['seed']}, token counts / {cfg['scale']:g}"
        + (f", at most {cfg['max_rounds']} rounds per task" if cfg.get("max_rounds") else ""),
        *([f"* preset `{cfg['preset']}` (docs/bench.md: how its rates were chosen)"]
          if cfg.get("preset") else []),
        f"* server flags (every policy): `{' '.join(cfg['server_args']) or '(defaults)'}`"
        " + `--enable-prompt-tokens-details`",
        f"* engine cores {run.get('engine_cores')}, tool cores {run.get('tool_cores')}, "
        f"jobs {cfg['jobs']}{'' if cfg['comparable'] else ' (NOT comparable: concurrent servers)'}",
        f"* host: {run['host']['cpus']} CPUs, {run['host']['platform']}; "
        f"{run['versions'].get('vllm')}; wall time {fmt_dur(run['wall_s'])}"
        + ("; **interrupted**" if run["interrupted"] else ""),
        _load_line(doc),
        "* server start-up: " + ", ".join(
            f"{k} {v['startup_s']:.0f}s" for k, v in doc["servers"].items() if "startup_s" in v),
        "",
        tables,
    ]
    if plots:
        lines += ["", "Plots: " + ", ".join(f"`{Path(v).relative_to(out)}`"
                                            for v in plots.values())]
    return "\n".join(lines) + "\n"


def _load_line(doc: Mapping[str, Any]) -> str:
    loads = [x for p in doc.get("points") or [] for x in (p.get("loadavg") or []) if x is not None]
    if not loads:
        return "* host load average: not recorded"
    return (f"* host 1-minute load average at the points' starts and ends: {min(loads):.1f}"
            f"–{max(loads):.1f} on {os.cpu_count()} CPUs (anything above ~2 is other work "
            "sharing the machine)")


def _cli_args(argv: Sequence[str]) -> list[str]:
    """The bench's own arguments, whatever the entry point (``mars``, ``python -m``)."""
    argv = list(argv)
    if "bench" in argv:
        return argv[argv.index("bench"):]
    return argv[1:]


def _shell_quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


def finite(obj: Any) -> Any:
    """JSON has no NaN or infinity: they are written as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_document(path: Path, doc: Mapping[str, Any]) -> None:
    """``bench.json``, replaced atomically (workers finish points concurrently with --jobs, and
    an interrupted write must not leave half a document for ``--resume`` to read)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(finite(doc), indent=1) + "\n")
    tmp.replace(path)


def fmt_dur(s: float) -> str:
    s = max(0, int(round(s)))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
