"""Each policy with and without vLLM's KV offloading, side by side (issue #35).

SIMULATED in virtual time on the EMULATED GPU (``mars sim``): for one operating point (a
regime and rate, or a trace file) three runs of the same trace --

* ``off``: the policies as they are (KV in GPU memory only);
* ``on``: the same policies over vLLM's own offloading (``--kv-offloading-size GiB``: every
  block stored to host memory, LRU there, loaded back on a prefix hit), each transfer timed
  on the emulated host link; mars prices a release as the read back (its three places);
* ``two``: mars over the same offloading blind to the host tier -- its retention rule
  (``--mars-config '{"retention": {"host_tier": false}}'``, the two-place rule) and its
  admission (``--admission-config '{"host_tier": false}'``: every admitted context charged
  whole) -- the ablation the three-place claim is measured against.

Then one table: mean and P90 latency, TTFT of later rounds, the prefix hit rate of later
rounds (cached tokens over prompt tokens), recomputed context, and the bytes each way on
the link::

    .venv/bin/python experiments/offloading.py ILR-3 --rate 0.22 --num-tasks 50 \\
        --policies fcfs,continuum,continuum_dy,mars --out runs/offload/ILR-3-0.22
    .venv/bin/python experiments/offloading.py --trace traces/swe-long-rate-0.03.jsonl \\
        --policies continuum_dy,mars --out runs/offload/swe-long-0.03
    .venv/bin/python experiments/offloading.py --table runs/offload/ILR-3-0.22   # no runs

A finished run (its ``report.md`` exists) is not run again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

VARIANTS = ("off", "on", "two")
BLIND = '{"retention": {"host_tier": false}}'
BLIND_ADMISSION = '{"host_tier": false}'


def _engine_args(variant: str, gib: float) -> str:
    if variant == "off":
        return ""
    args = f"--kv-offloading-size {gib:g}"
    if variant == "two":
        args += f" --mars-config {shlex.quote(BLIND)}"
    return args


def run(args: argparse.Namespace) -> None:
    for v in VARIANTS:
        out = Path(f"{args.out}-{v}")
        if (out / "report.md").exists():
            continue
        out.parent.mkdir(parents=True, exist_ok=True)  # (its log sits beside it)
        policies = "mars" if v == "two" else args.policies
        point = ["--trace", args.trace] if args.trace else \
            [args.regime, "--rate", str(args.rate), "--num-tasks", str(args.num_tasks)]
        cmd = [sys.executable, "-m", "mars.cli", "sim", "run", *point, "--gpu", args.gpu,
               "--model", args.model,
               "--policies", policies, "--engine-args", _engine_args(v, args.host_gib),
               "--seed", str(args.seed), "--ideal", "skip", "--jobs", str(args.jobs),
               "--no-progress", "--no-plots", "--out", str(out),
               *(["--admission-config", BLIND_ADMISSION] if v == "two" else [])]
        print(f"[{v}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
        with open(f"{out}.log", "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)


def _row(path: Path) -> dict:
    r = json.loads((path / "results.json").read_text())
    s = r["summary"]
    later = [x for x in s["ttft_by_round"] if x["round"] >= 1]
    first = [x for x in s["ttft_by_round"] if x["round"] == 0]
    n = sum(x["count"] for x in later)
    link = r["run"].get("host_link") or {}
    return {
        "mean": s["latency_s"]["mean"], "p90": s["latency_s"]["p90"],
        "ttft_first": first[0]["mean"] if first else float("nan"),
        "ttft_later": sum(x["mean"] * x["count"] for x in later) / n if n else float("nan"),
        "hit": s["cached_fraction"].get("later_rounds_token_weighted") or float("nan"),
        "recomputed": s.get("recomputed_context_tokens") or 0,
        "stored_gb": link.get("bytes_store", 0) / 1e9,
        "loaded_gb": link.get("bytes_load", 0) / 1e9,
    }


def table(prefix: str) -> str:
    rows = []
    for v in VARIANTS:
        d = Path(f"{prefix}-{v}")
        if not d.is_dir():
            continue
        for p in sorted(x for x in d.iterdir() if (x / "results.json").exists()):
            name = {"off": p.name, "on": f"{p.name} + offload",
                    "two": "mars two-place + offload"}[v]
            if v == "on" and p.name == "mars":
                name = "**mars three-place + offload**"
            rows.append((name, _row(p)))
    out = ["| policy | mean (s) | P90 (s) | TTFT, round 0 (s) | TTFT, rounds ≥ 1 (s) | "
           "prefix hit, rounds ≥ 1 | recomputed (K tokens) | to host (GB) | from host (GB) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, x in rows:
        out.append(f"| {name} | {x['mean']:,.1f} | {x['p90']:,.1f} | {x['ttft_first']:.2f} | "
                   f"{x['ttft_later']:.2f} | "
                   f"{x['hit']:.1%} | {x['recomputed'] / 1e3:,.0f} | {x['stored_gb']:,.0f} | "
                   f"{x['loaded_gb']:,.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("regime", nargs="?", help="ILR-1..4, S-ILR-1..3 (or --trace)")
    ap.add_argument("--trace", help="a trace file instead of a regime")
    ap.add_argument("--rate", type=float, default=0.2)
    ap.add_argument("--num-tasks", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", default="h100-nvl")
    ap.add_argument("--model", default="qwen3-coder-30b-a3b",
                    help="the emulated model (gpt-oss-120b: the h100-gptoss preset's)")
    ap.add_argument("--policies", default="fcfs,continuum,continuum_dy,mars")
    ap.add_argument("--host-gib", type=float, default=128.0,
                    help="host memory for offloaded KV, GiB (--kv-offloading-size)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", help="output prefix: OUT-off, OUT-on, OUT-two")
    ap.add_argument("--table", metavar="PREFIX", help="only print the table of finished runs")
    args = ap.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if not args.out or not (args.regime or args.trace):
        ap.error("give a REGIME or --trace, and --out")
    run(args)
    print(table(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
