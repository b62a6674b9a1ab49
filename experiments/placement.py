"""Placement across several engines (issue #34): MARS's placement against the placement
baselines, each with MARS inside every engine and with fcfs inside, on one trace, SIMULATED
on N EMULATED GPUs (``mars sim run --engines N --placement P``).

Rows: every placement of :data:`mars.policy.control.placement.PLACERS` x every inside policy,
and (``--static``) an *ideal static partition*: the trace's sessions dealt round-robin by
arrival over N separate single-engine MARS simulations, each with 1/N of the tool cores,
pooled (no placement decision at all, every session's engine known in advance and the
sessions spread evenly by count: the reference the issue names; not a bound, since dealing
by count does not balance the work and each part has private tool cores). Columns: mean and P90
task latency, goodput at slack 3, the context prefilled again in later rounds (tokens a
session's engine did not hold), sessions moved (engine gone) and switched (sent away from its
cached context by a per-call placer), and the mean latency relative to MARS's placement with
the same inside policy.

    .venv/bin/python experiments/placement.py ILR-3 --rate 0.88 --engines 4 --num-tasks 100 \\
        --jobs 2 --static --out runs/placement-ILR-3-0.88
    .venv/bin/python experiments/placement.py --trace runs/heldout4/burst-rate-0.48.jsonl \
        --policies mars --placements mars,vllm_dp,session_hash --static --out runs/placement-burst

Writes OUT/trace.jsonl, OUT/<policy>-<placement>/results.json (mars replay's schema; ``mars
report`` reads them) and OUT/report.md. The ideal latencies (goodput) are each task alone
under fcfs on one engine, cached as ``mars sim`` caches them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mars.policy.control.placement import PLACERS
from mars.policy.control.pressure import CPU_BUDGETS
from mars.workloads.generator import generate
from mars.workloads.results import RunResult, read_results
from mars.workloads.trace import Trace, read_trace, write_trace

GPU, MODEL = "h100-nvl", "qwen3-coder-30b-a3b"


def sim(trace: Path, out: Path, policy: str, engines: int, placement: str, tool_cores: int,
        cpu_budget: str, args: argparse.Namespace, ideal: str = "auto") -> Path:
    cmd = [sys.executable, "-m", "mars.cli", "sim", "run", "--trace", str(trace), "--ideal", ideal,
           "--gpu", args.gpu, "--model", args.model, "--policies", policy, "--flat",
           "--out", str(out), "--seed", str(args.seed), "--tool-cores", str(tool_cores),
           "--engines", str(engines), "--placement", placement, "--cpu-budget", cpu_budget,
           "--no-plots", "--no-progress"]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 3):  # 3: some task failed (reported in the table)
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    print(f"  {out.name}: {time.monotonic() - t0:,.0f} s", file=sys.stderr, flush=True)
    return out / "results.json"


def partition(trace: Trace, n: int, out: Path) -> list[Path]:
    """The trace's sessions dealt round-robin by arrival over ``n`` traces (arrival times
    kept: every sub-trace runs on the same timeline)."""
    tasks = sorted(trace.tasks, key=lambda t: t.arrival_s)
    paths = []
    for k in range(n):
        p = out / f"static-part{k}.jsonl"
        h = trace.header
        write_trace(Trace.build(h.regime, tasks[k::n], h.seed,
                                {**h.params, "static_partition": f"{k} of {n}"}), p)
        paths.append(p)
    return paths


def pooled(parts: list[RunResult], slacks: tuple[float, ...]) -> RunResult:
    """N single-engine runs on one timeline as one run."""
    first = parts[0]
    tasks = [t for r in parts for t in r.tasks]
    metrics = {"vllm:num_preemptions_total": sum(
        r.server_metrics.get("vllm:num_preemptions_total", 0.0) for r in parts)}
    return RunResult(label="static", mode=first.mode, trace=first.trace, server=first.server,
                     config=first.config, run=dict(first.run), tasks=tasks,
                     server_metrics=metrics,
                     cached_tokens_source=first.cached_tokens_source).finalize(slacks)


def row(name: str, r: RunResult, base: RunResult | None) -> str:
    s = r.summary
    lat = s.get("latency_s") or {}
    good = (s.get("goodput") or {}).get("3", {})
    tasks = s.get("tasks") or {}
    rel = "" if base is None else \
        f"{(lat.get('mean') or 0) / ((base.summary.get('latency_s') or {}).get('mean') or 1):.2f}×"
    return (f"| {name} | {tasks.get('completed', 0)}/{len(r.tasks)} | {lat.get('mean', 0):.1f} | "
            f"{lat.get('p90', 0):.1f} | {good.get('goodput', 0):.4f} | "
            f"{s.get('recomputed_context_tokens', 0):,} | {r.run.get('session_moves', 0)} | "
            f"{r.run.get('session_switches', 0)} | {rel} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("regime", nargs="?", help="ILR-1..4, S-ILR-1..3 (or --trace)")
    ap.add_argument("--trace", help="a trace file instead of a regime (a held-out workload: "
                    "experiments/heldout_workloads.py)")
    ap.add_argument("--rate", type=float, help="tasks/s for the whole node (with a regime)")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--num-tasks", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", default=GPU)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--tool-cores", type=int, default=32,
                    help="the node's tool cores, shared by its engines (default 32: 8 per "
                         "engine of 4, as the single-GPU set-up's 8)")
    ap.add_argument("--policies", default="mars,fcfs", help="inside policies (default mars,fcfs)")
    ap.add_argument("--placements", default=",".join(sorted(PLACERS)))
    ap.add_argument("--cpu-budgets", default="node",
                    help="how the engines' control planes count the tool cores: node "
                         "(shared), split (an equal share each), or both: node,split")
    ap.add_argument("--static", action="store_true",
                    help="also the ideal static partition (MARS inside)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if (args.regime is None) == (args.trace is None):
        ap.error("give a regime (with --rate) or --trace FILE, not both")
    if args.regime is not None and args.rate is None:
        ap.error("a regime needs --rate")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.trace:
        try:
            trace = read_trace(args.trace)
        except (OSError, ValueError) as exc:
            ap.error(f"--trace {args.trace}: {exc}")
        args.num_tasks = len(trace.tasks)
        point = f"{Path(args.trace).name} ({trace.header.regime})"
    else:
        trace = generate(args.regime, num_tasks=args.num_tasks, rate=args.rate, seed=args.seed)
        point = f"{args.regime} at {args.rate} tasks/s"
    tpath = out / "trace.jsonl"
    write_trace(trace, tpath)
    policies = [p for p in args.policies.split(",") if p]
    placements = [p for p in args.placements.split(",") if p]
    budgets = [b for b in args.cpu_budgets.split(",") if b]
    if not budgets or set(budgets) - set(CPU_BUDGETS):
        ap.error(f"--cpu-budgets: choose from {', '.join(CPU_BUDGETS)}")

    def key(pol: str, pl: str, b: str) -> str:
        return f"{pol}-{pl}" + ("" if b == "node" else f"-{b}")
    jobs: dict[str, tuple] = {}
    for b in budgets:
        for pol in policies:
            for pl in placements:
                k = key(pol, pl, b)
                jobs[k] = (tpath, out / k, pol, args.engines, pl, args.tool_cores, b)
    if args.static:
        if args.tool_cores % args.engines:
            raise SystemExit("--static: --tool-cores must divide evenly over the engines")
        for k, p in enumerate(partition(trace, args.engines, out)):
            jobs[f"static-{k}"] = (p, out / f"static-{k}", "mars", 1, "mars",
                                   args.tool_cores // args.engines, "node")
    print(f"placement: {point}, {args.num_tasks} tasks, "
          f"{args.engines} x EMULATED {args.gpu} x {args.model}, {len(jobs)} simulations",
          file=sys.stderr, flush=True)
    # the first alone: it simulates the ideal latencies (each task alone on one engine); the
    # others read them from the cache, the static parts from a file (their traces differ)
    first = next(iter(jobs))
    paths = {first: sim(*jobs[first], args)}
    ideal = out / "ideal.json"
    ideal.write_text(json.dumps({t.task_id: t.ideal_s for t in read_results(paths[first]).tasks
                                 if t.ideal_s is not None}))
    rest = [k for k in jobs if k != first]
    with ThreadPoolExecutor(args.jobs) as ex:
        paths.update(zip(rest, ex.map(
            lambda k: sim(*jobs[k], args, str(ideal) if k.startswith("static-") else "auto"),
            rest)))
    res = {k: read_results(p) for k, p in paths.items()}
    slacks = tuple(float(s) for s in res[next(iter(res))].config.get("slacks") or (2, 3, 5))
    lines = [f"SIMULATED, EMULATED GPU: {args.engines} x {args.gpu} x {args.model}, "
             f"{point}, {args.num_tasks} tasks, seed {args.seed}, "
             f"{args.tool_cores} tool cores on the host", "",
             "| inside / placement | done | mean (s) | P90 (s) | goodput s=3 (tasks/s) | "
             "re-prefilled context (tokens) | moves | switches | mean vs mars placement |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b in budgets:
        for pol in policies:
            base = res.get(key(pol, "mars", b))
            for pl in placements:
                label = f"{pol} / {pl}" + (f" / cpu {b}" if len(budgets) > 1 else "")
                lines.append(row(label, res[key(pol, pl, b)], base))
    if args.static:
        st = pooled([res[f"static-{k}"] for k in range(args.engines)], slacks)
        lines.append(row("mars / ideal static partition", st, res.get("mars-mars")))
    report = "\n".join(lines) + "\n"
    (out / "report.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
