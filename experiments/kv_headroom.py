"""What room alone gives MARS at one point: the same GPU with k times its KV pool (issue
#35).

Host memory under the engine lets a paused session's context leave GPU memory and come back
over the link, so MARS can admit as if the pool were larger. This runs MARS (no offloading)
on the same trace with the pool multiplied by k (vLLM's ``--num-gpu-blocks-override``; the
step-time model is unchanged, so it is the same GPU with more blocks): what more room, with
nothing to move, does for MARS's door as it is. It is not a bound on a host tier: the gain is
not monotone in the room (more memory lets more sessions in, and a larger batch decodes
slower, so a larger pool can be slower), and a host tier admits differently from a larger
pool (it charges each context its resident share), so it can beat every k measured.

It also reads from the x1 run why the door holds sessions there:

* **engine share**: the share of the admitted sessions' time with a call in the engine,
  plain and weighted by each context's blocks. Only the rest is time a host tier can take a
  context out of GPU memory; weighted by blocks, it estimates the share of the admitted
  contexts' KV that must stay resident. The admission measures its own share alike but not
  the same: it weights by each session's projected blocks and stops counting a pause past
  the longest recent gap between rounds; this counts every admitted second, at the
  session's first-prompt estimate until its first call and its largest prompt after.
* **door wait**: the mean wait of a session before admission.
* **KV while queued**: free blocks, the engine's running calls and the window's free slots,
  time-weighted over the time some session waits at the door (as the window's
  ``window_update`` records show it: they change at control steps).

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
import math
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
    """Each admitted session's time with a call in the engine (a ``gpu_submit`` to its
    ``gpu_end``, by request id) against its time admitted (``session_admit`` to
    ``session_end``, or the log's last event), plain and weighted by its context's blocks:
    its first-prompt estimate (``session_admit``'s ``est_blocks``) until a call reaches the
    engine, then its largest prompt so far."""

    def __init__(self) -> None:
        self.block_size = 16
        self._since: dict[str, float] = {}  # admitted sessions: their last account
        self._blocks: dict[str, int] = {}
        #: sessions that have sent a call to the engine: the request ids still in it
        self._calls: dict[str, set[str]] = {}
        self.busy = self.life = self.busy_bs = self.life_bs = 0.0

    def _account(self, sid: str, t: float) -> None:
        if sid in self._since:
            dt, b = t - self._since[sid], self._blocks.get(sid, 0)
            self.life += dt
            self.life_bs += b * dt
            if self._calls.get(sid):
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
            self._blocks[sid] = int(ev.get("est_blocks") or 0)
            return
        if kind not in ("gpu_submit", "gpu_end", "session_end"):
            return
        self._account(sid, t)
        rid = str(ev.get("request_id"))
        if kind == "gpu_submit":
            blocks = -(-int(ev.get("prompt_tokens") or 0) // self.block_size)
            # the first call replaces the estimate; later ones can only grow the context
            if sid in self._calls:
                blocks = max(self._blocks.get(sid, 0), blocks)
            self._blocks[sid] = blocks
            self._calls.setdefault(sid, set()).add(rid)
        elif kind == "gpu_end":
            self._calls.get(sid, set()).discard(rid)
        else:
            self._since.pop(sid, None)

    def end(self, t: float) -> None:
        """The log ended at ``t``: sessions still admitted count up to it."""
        for sid in list(self._since):
            self._account(sid, t)

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
    if last is not None:
        shares.end(last)
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
    if args.trace is not None and args.rate is not None:
        ap.error("--rate goes with a regime; a trace has its own arrivals")
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        ap.error("--rate must be a number > 0")
    if args.num_tasks < 1 or args.jobs < 1:
        ap.error("--num-tasks and --jobs must be >= 1")
    try:
        mults = [float(m) for m in args.multipliers.split(",") if m]
    except ValueError:
        ap.error(f"--multipliers: numbers separated by commas, not {args.multipliers!r}")
    if not mults or any(not (math.isfinite(m) and 0 < m <= 1000) for m in mults):
        ap.error("--multipliers must be numbers in (0, 1000]")
    out = Path(args.out)
    base = _sim(args, out / "x1", None)  # first: its pool sizes the others
    pool = pool_blocks(base)
    small = [m for m in mults if round(pool * m) < 2]
    if small:
        ap.error(f"--multipliers {small}: a pool of {pool} blocks times that is under 2 blocks")
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
