"""How much room a second KV place could give MARS at one point: the same GPU with k times
its KV pool (issue #35).

Host memory under the engine lets a paused session's context leave GPU memory and come back
over the link, so MARS can admit as if the pool were larger. No host tier can do more than
a larger pool with free transfers. This runs MARS (no offloading) on the same trace with the
pool multiplied by k (vLLM's ``--num-gpu-blocks-override``; the step-time model is
unchanged, so it is the same GPU with more blocks). Where even k = 10 is not 1.3x faster,
no third place can be. It is not a bound in the other direction: more memory lets more
sessions in, and a larger batch decodes slower, so a larger pool can be slower.

It also reads from the x1 run why the door holds sessions there:

* **engine share**: the share of the admitted sessions' time with a call in the engine,
  plain and weighted by each context's blocks (as the admission's share charge counts it).
  Only the rest is time a host tier can take a context out of GPU memory. Weighted by
  blocks, it is the share of the admitted contexts' KV that must stay resident.
* **door wait**: the mean wait of a session before admission.
* **KV while queued**: free blocks, the engine's running calls and the window's free slots,
  time-weighted over the time some session waits at the door. Free blocks there are KV that
  the admission keeps for the admitted sessions' projected growth.

    .venv/bin/python experiments/kv_headroom.py ILR-3 --rate 0.22 --num-tasks 50 --seed 3 \\
        --out runs/headroom/ILR-3-0.22-s3
    .venv/bin/python experiments/kv_headroom.py --trace runs/offload/traces/swe-long-rate-0.03.jsonl \\
        --out runs/headroom/swe-long

SIMULATED in virtual time on the EMULATED GPU (``mars sim``). Writes OUT/x<k>/ (mars sim's
output) and OUT/report.md. A finished run (its results.json exists) is not run again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _sim(args: argparse.Namespace, out: Path, blocks: int | None) -> Path:
    res = out / "mars" / "results.json"
    if res.exists():
        return out
    point = ["--trace", args.trace] if args.trace else \
        [args.regime, "--rate", str(args.rate), "--num-tasks", str(args.num_tasks)]
    cmd = [sys.executable, "-m", "mars.cli", "sim", "run", *point, "--gpu", args.gpu,
           "--model", args.model, "--policies", "mars", "--seed", str(args.seed),
           "--ideal", "skip", "--jobs", "1", "--no-progress", "--no-plots", "--out", str(out)]
    if blocks is not None:
        cmd += ["--engine-args", f"--num-gpu-blocks-override {blocks}"]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode not in (0, 3):
            raise SystemExit(f"{' '.join(cmd)} failed: see {out}.log")
    return out


def pool_blocks(run: Path) -> int:
    """The KV pool of a run, in blocks (vLLM's count: the engine's usable blocks and the
    null block)."""
    with open(run / "mars" / "events.jsonl") as f:
        for line in f:
            ev = json.loads(line)
            if ev.get("kind") == "scheduler_start":
                return int(ev["total_blocks"]) + 1
    raise SystemExit(f"{run}: no scheduler_start event")


class _Shares:
    """Each admitted session's time with a call in the engine (``gpu_submit`` to
    ``gpu_end``) against its time admitted (``session_admit`` to ``session_end``), plain and
    weighted by its context's blocks (its largest prompt so far), as the admission's engine
    share counts it (:class:`mars.policy.control.residency.EngineShare`)."""

    def __init__(self) -> None:
        self.block_size = 16
        self._since: dict[str, float] = {}  # admitted sessions: their last account
        self._blocks: dict[str, int] = {}
        self._calls: dict[str, int] = {}
        self.busy = self.life = self.busy_bs = self.life_bs = 0.0

    def _account(self, sid: str, t: float) -> None:
        if sid in self._since:
            dt, b = t - self._since[sid], self._blocks.get(sid, 0)
            self.life += dt
            self.life_bs += b * dt
            if self._calls.get(sid, 0) > 0:
                self.busy += dt
                self.busy_bs += b * dt
            self._since[sid] = t

    def observe(self, ev: dict) -> None:
        kind, sid, t = ev["kind"], ev.get("session_id"), ev["ts"]
        if kind == "scheduler_start":
            self.block_size = int(ev.get("block_size") or self.block_size)
        if sid is None:
            return
        if kind == "session_admit":
            self._since[sid] = t
        elif kind in ("gpu_submit", "gpu_end", "session_end"):
            self._account(sid, t)
            if kind == "gpu_submit":
                self._calls[sid] = self._calls.get(sid, 0) + 1
                blocks = -(-int(ev.get("prompt_tokens") or 0) // self.block_size)
                self._blocks[sid] = max(self._blocks.get(sid, 0), blocks)
            elif kind == "gpu_end":
                self._calls[sid] = max(0, self._calls.get(sid, 0) - 1)
            else:
                self._since.pop(sid, None)

    def shares(self) -> tuple[float, float]:
        nan = float("nan")
        return (self.busy / self.life if self.life else nan,
                self.busy_bs / self.life_bs if self.life_bs else nan)


def read(run: Path) -> dict:
    """Latency and the door's state from a run's results and events."""
    r = json.loads((run / "mars" / "results.json").read_text())
    s = r["summary"]
    waits: dict[str, float] = {}
    queued, snap, budget, admitted, last = 0, None, 0, 0, None
    acc = {"free": 0.0, "running": 0.0, "slots": 0.0, "t": 0.0}
    shares = _Shares()
    with open(run / "mars" / "events.jsonl") as f:
        for line in f:
            ev = json.loads(line)
            t = ev["ts"]
            if last is not None and queued > 0 and snap is not None:
                dt = t - last
                acc["t"] += dt
                acc["free"] += dt * snap["free_blocks"] / snap["total_blocks"]
                acc["running"] += dt * snap["running"]
                acc["slots"] += dt * max(0, budget - admitted)
            last = t
            shares.observe(ev)
            kind = ev["kind"]
            if kind == "kv_snapshot":
                snap = ev
            elif kind == "window_update":
                queued, budget, admitted = ev["queued"], ev["budget"], ev["admitted"]
            elif kind == "session_admit":
                waits[ev["session_id"]] = ev["queued_s"]
    q = acc["t"]
    plain, weighted = shares.shares()
    return {"mean": s["latency_s"]["mean"], "p90": s["latency_s"]["p90"],
            "done": sum(t["status"] == "completed" for t in r["tasks"]), "tasks": len(r["tasks"]),
            "engine_share": plain, "engine_share_blocks": weighted,
            "door_wait": sum(waits.values()) / len(waits) if waits else 0.0, "queued_s": q,
            "free_q": acc["free"] / q if q else float("nan"),
            "running_q": acc["running"] / q if q else float("nan"),
            "slots_q": acc["slots"] / q if q else float("nan")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("regime", nargs="?", help="ILR-1..4, S-ILR-1..3 (or --trace)")
    ap.add_argument("--trace", help="a trace file instead of a regime")
    ap.add_argument("--rate", type=float, help="tasks/s (with a regime)")
    ap.add_argument("--num-tasks", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", default="h100-nvl")
    ap.add_argument("--model", default="qwen3-coder-30b-a3b")
    ap.add_argument("--multipliers", default="2,10",
                    help="pool multipliers besides x1 (default: %(default)s)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if (args.regime is None) == (args.trace is None):
        ap.error("give a regime (with --rate) or --trace FILE, not both")
    if args.regime is not None and args.rate is None:
        ap.error("a regime needs --rate")
    try:
        mults = [float(m) for m in args.multipliers.split(",") if m]
    except ValueError:
        ap.error(f"--multipliers: numbers separated by commas, not {args.multipliers!r}")
    if any(m <= 0 for m in mults):
        ap.error("--multipliers must be > 0")
    out = Path(args.out)
    base = _sim(args, out / "x1", None)  # first: its pool sizes the others
    pool = pool_blocks(base)
    with ThreadPoolExecutor(args.jobs) as ex:
        runs = dict(zip(mults, ex.map(
            lambda m: _sim(args, out / f"x{m:g}", int(round(pool * m))), mults)))
    rows = [(1.0, read(base))] + [(m, read(runs[m])) for m in mults]
    one = rows[0][1]
    point = args.trace or f"{args.regime} at {args.rate} tasks/s, {args.num_tasks} tasks"
    lines = [f"SIMULATED, EMULATED GPU {args.gpu} x {args.model}: MARS on {point}, seed "
             f"{args.seed}, the KV pool ({pool:,} blocks) multiplied", "",
             "| KV pool | done | mean (s) | P90 (s) | mean vs x1 | door wait (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for m, x in rows:
        lines.append(f"| x{m:g} | {x['done']}/{x['tasks']} | {x['mean']:,.1f} | "
                     f"{x['p90']:,.1f} | {one['mean'] / x['mean']:.2f}x | {x['door_wait']:.1f} |")
    lines += ["", f"At x1: engine share {one['engine_share']:.0%} of the admitted sessions' time, "
              f"{one['engine_share_blocks']:.0%} weighted by their contexts' blocks; while "
              f"some session waited at the door ({one['queued_s']:.0f} s), {one['free_q']:.0%} "
              f"of the KV free, {one['running_q']:.1f} calls running, {one['slots_q']:.1f} free "
              "window slots (time-weighted)."]
    report = "\n".join(lines) + "\n"
    (out / "report.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
