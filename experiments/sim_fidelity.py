"""Fidelity of ``mars sim`` against the paced emulation it stands in for.

For each operating point and policy, the same trace runs twice on the same emulated GPU and
model: once through the whole served stack in real time (``mars-vllm serve --emulate GPU:MODEL
--policy P --tool-cores N`` and ``mars replay --virtual-tool-cores N``: real HTTP, the real
sidecar, the engine paced by the wall clock) and once in ``mars sim`` (the same engine, admission
core and trace semantics in one process on a virtual clock). Printed: mean / P90 / P95 task
latency, TTFT P50 / P90 and the Kolmogorov-Smirnov distance between the two per-round TTFT
distributions, the engine's own time summed over every call (scheduler took it to its end) and
the mean task latency less what lies outside the engine's calls and the tools' planned time
(``mars.sim.fidelity``: on the served side the HTTP path, API server, sidecar and late tool
timers), with the simulator's relative error. Both sides use ``--ideal skip``: goodput is
not compared here.

    .venv/bin/python experiments/sim_fidelity.py --points ILR-1:6:0.1,ILR-3:12:0.2 \\
        --policies fcfs,mars

With ``--profile FILE`` (a device profile of this machine from ``mars emulate calibrate``) the
reference is the *real* engine instead: ``mars-vllm serve --policy P`` on the embedded model,
real CPU compute, against ``mars sim run --profile FILE``; ``--time-scale`` shortens tools and
arrivals so that the small model's engine, not the tools, sets the latencies:

    .venv/bin/mars emulate calibrate --out runs/cpu-profile.json
    .venv/bin/python experiments/sim_fidelity.py --profile runs/cpu-profile.json \
        --points ILR-1:6:0.02,ILR-3:8:0.2 --time-scale 10 --policies fcfs,mars

Runs in real time (minutes per point and policy). Do not run it beside the tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from mars.launch import ServerProcess
from mars.workloads.generator import generate
from mars.workloads.results import read_results
from mars.workloads.trace import write_trace


def _ks(a: list[float], b: list[float]) -> float:
    """Largest gap between the two empirical CDFs."""
    if not a or not b:
        return float("nan")
    pts = sorted(set(a) | set(b))
    sa, sb = sorted(a), sorted(b)
    import bisect

    return max(abs(bisect.bisect_right(sa, x) / len(sa) - bisect.bisect_right(sb, x) / len(sb))
               for x in pts)


def _paced(args, policy: str, trace_path: Path, out: Path) -> Path:
    if args.profile:
        # the real engine, with the arguments the profile was measured with
        from mars.emulate.profile import DeviceProfile

        target = list(DeviceProfile.load(args.profile).host.get("engine_args") or [])
    else:
        target = ["--emulate", f"{args.gpu}:{args.model}"]
    srv = ServerProcess(args=[*target, "--policy", policy, "--tool-cores", str(args.tool_cores)],
                        startup_timeout_s=600)
    with srv:
        r = subprocess.run([sys.executable, "-m", "mars.cli", "replay", "--trace", str(trace_path),
                            "--url", srv.url, "--virtual-tool-cores", str(args.tool_cores),
                            "--ideal", "skip", "--no-plots", "--no-progress", "--label", policy,
                            "--events-file", srv.events_file, "--out", str(out)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"replay failed ({r.returncode}): {r.stderr[-2000:]}")
    return out


def _sim(args, policy: str, trace_path: Path, out: Path, ref: Path) -> Path:
    target = ["--profile", args.profile] if args.profile else ["--gpu", args.gpu,
                                                                "--model", args.model]
    host = ["--host-from", str(ref)] if args.host else []
    r = subprocess.run([sys.executable, "-m", "mars.cli", "sim", "run", "--trace", str(trace_path),
                        *target, *host, "--policies", policy,
                        "--tool-cores", str(args.tool_cores), "--ideal", "skip", "--no-plots",
                        "--no-progress", "--out", str(out)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"sim failed ({r.returncode}): {r.stderr[-2000:]}")
    return out / policy


def _row(res) -> dict:
    s = res.summary
    lat, ttft = s["latency_s"], s["ttft_s"]
    ttfts = [r.ttft_s for t in res.tasks for r in t.rounds if r.ttft_s is not None]
    from mars.sim.fidelity import engine_busy_seconds, engine_call_seconds, engine_side_mean
    from mars.workloads.eventlink import read_events

    ev_path = Path(res.files.get("events") or "")
    ev = read_events(ev_path) if ev_path.is_file() else None
    nan = float("nan")
    return {"mean": lat["mean"], "p90": lat["p90"], "p95": lat["p95"], "ttft_p50": ttft["p50"],
            "ttft_p90": ttft["p90"], "ttfts": ttfts,
            "engine": engine_call_seconds(ev) if ev else nan,
            "busy": engine_busy_seconds(ev) if ev else nan,
            "engine_side_mean": engine_side_mean(res, ev) if ev else nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h100-nvl")
    ap.add_argument("--model", default="qwen3-coder-30b-a3b")
    ap.add_argument("--points", default="ILR-1:6:0.1,ILR-3:12:0.2",
                    help="REGIME:TASKS:RATE,... (default %(default)s)")
    ap.add_argument("--policies", default="fcfs,mars")
    ap.add_argument("--tool-cores", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="reference = the real engine on this machine; sim = this device "
                         "profile (mars emulate calibrate)")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="divide tool durations and arrival times by this (default 1)")
    ap.add_argument("--out", default="runs/sim-fidelity")
    ap.add_argument("--host", action="store_true",
                    help="model the served host in the simulator as measured in each real or "
                         "paced run (mars sim run --host-from; results under sim-host/)")
    ap.add_argument("--reuse", action="store_true",
                    help="tabulate the runs already under --out instead of running them")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ref = "real" if args.profile else "paced"
    rows = []
    for spec in args.points.split(","):
        regime, n, rate = spec.split(":")
        trace = generate(regime, num_tasks=int(n), rate=float(rate), seed=args.seed,
                         time_scale=args.time_scale)
        ts = f"-ts{args.time_scale:g}" if args.time_scale != 1 else ""
        tdir = out / f"{regime}-{n}-{rate}{ts}"
        tdir.mkdir(parents=True, exist_ok=True)
        write_trace(trace, tdir / "trace.jsonl")
        for policy in args.policies.split(","):
            t0 = time.monotonic()
            sim_dir = tdir / ("sim-host" if args.host else "sim")
            pdir, sdir = tdir / f"paced-{policy}", sim_dir / policy
            if not (args.reuse and (pdir / "results.json").is_file()):
                pdir = _paced(args, policy, tdir / "trace.jsonl", pdir)
            paced = read_results(pdir)
            t1 = time.monotonic()
            if not (args.reuse and (sdir / "results.json").is_file()):
                sdir = _sim(args, policy, tdir / "trace.jsonl", sim_dir, pdir)
            sim = read_results(sdir)
            t2 = time.monotonic()
            p, s = _row(paced), _row(sim)
            rows.append((spec, policy, p, s, t1 - t0, t2 - t1))
            print(f"{spec} {policy}: {ref} mean {p['mean']:.1f} s ({t1 - t0:.0f} s), "
                  f"sim {s['mean']:.1f} s ({t2 - t1:.0f} s)", file=sys.stderr, flush=True)
    if args.profile:
        print(f"\nreal = the real engine on this machine (embedded model, served stack, real "
              f"time); sim = mars sim on the device profile {args.profile}; "
              f"{args.tool_cores} virtual tool cores, time scale {args.time_scale:g}"
              f"{'; host modeled from each real run' if args.host else ''}\n")
    else:
        print(f"\nEMULATED GPU {args.gpu} x {args.model}, {args.tool_cores} virtual tool cores; "
              "paced = served stack in real time, sim = mars sim (virtual time)\n")
    print(f"| point | policy | mean {ref} / sim (s) | err | P90 {ref} / sim (s) | err | "
          f"P95 {ref} / sim (s) | err | TTFT P50 {ref} / sim (s) | TTFT P90 {ref} / sim (s) | "
          f"TTFT KS | engine Σ {ref} / sim (s) | err | engine busy {ref} / sim (s) | err | "
          f"engine-side mean {ref} / sim (s) | err |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary = []
    for spec, policy, p, s, wp, ws in rows:
        def err(k: str) -> str:
            return f"{(s[k] - p[k]) / p[k] * 100:+.1f}%"
        ks = _ks(p["ttfts"], s["ttfts"])
        print(f"| {spec} | {policy} | {p['mean']:.1f} / {s['mean']:.1f} | {err('mean')} | "
              f"{p['p90']:.1f} / {s['p90']:.1f} | {err('p90')} | {p['p95']:.1f} / {s['p95']:.1f} "
              f"| {err('p95')} | {p['ttft_p50']:.3f} / {s['ttft_p50']:.3f} | "
              f"{p['ttft_p90']:.2f} / {s['ttft_p90']:.2f} | {ks:.2f} | "
              f"{p['engine']:.1f} / {s['engine']:.1f} | {err('engine')} | "
              f"{p['busy']:.1f} / {s['busy']:.1f} | {err('busy')} | "
              f"{p['engine_side_mean']:.1f} / {s['engine_side_mean']:.1f} | "
              f"{err('engine_side_mean')} |")
        summary.append({"point": spec, "policy": policy,
                        **{f"paced_{k}": v for k, v in p.items() if k != "ttfts"},
                        **{f"sim_{k}": v for k, v in s.items() if k != "ttfts"},
                        "ttft_ks": ks, "wall_paced_s": wp, "wall_sim_s": ws})
    (out / "fidelity.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
