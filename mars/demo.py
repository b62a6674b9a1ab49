"""``mars demo``: the README's "run the main job": a short scaled ILR-1 replay on CPU.

It starts ``mars-vllm serve`` on the embedded tiny model (CPU, 32K context, prefix-cache hits
reported in usage), replays a few ILR-1 agent tasks against it with ``mars replay`` (token
counts scaled down 50x, time compressed 10x, so it takes a few minutes on two cores), prints
the summary table, writes ``results.json`` and the plots, and stops the server.

Cores are split as the paper does (§6.2: engine and tools on disjoint cores): the server gets
all cores but the last, the CPU-bound tools the last one (on a one-core machine they share).
The first run also measures each task alone for the goodput SLOs; that is cached
(``~/.cache/mars/ideal``), so later runs of the same demo are shorter.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from pathlib import Path

from mars.launch import pinned_to


def split_cores(available: list[int]) -> tuple[list[int], list[int]]:
    """Engine cores and tool cores: all but the last / the last (shared on one core)."""
    if len(available) < 2:
        return list(available), list(available)
    return available[:-1], available[-1:]


def run_demo(args: argparse.Namespace) -> int:
    from mars.launch import ServerProcess
    from mars.workloads.toolpool import available_cores, format_cores, parse_cores

    avail = available_cores()
    engine, tools = split_cores(avail)
    if args.engine_cores:
        engine = parse_cores(args.engine_cores)
    if args.tool_cores:
        tools = parse_cores(args.tool_cores)
    out = Path(args.out or Path("runs") / f"demo-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    print(f"mars demo: starting `mars-vllm serve` on the embedded tiny model (CPU, policy "
          f"{args.policy}, engine cores {format_cores(engine)}) ...", flush=True)
    t0 = time.monotonic()
    env = {"VLLM_CPU_OMP_THREADS_BIND": format_cores(engine)}
    srv = ServerProcess(args=["--policy", args.policy, "--max-model-len", "32768",
                              "--enable-prompt-tokens-details"], env=env)
    with pinned_to(engine):
        srv.start()
    try:
        print(f"  server up at {srv.url} in {time.monotonic() - t0:.0f}s "
              f"(log {srv.log_path}, engine events {srv.events_file})", flush=True)
        argv = ["replay", "ILR-1", "--url", srv.url, "--num-tasks", str(args.num_tasks),
                "--scale", str(args.scale), "--time-scale", str(args.time_scale),
                "--rate", str(args.rate), "--seed", str(args.seed),
                "--tool-cores", format_cores(tools), "--events-file", str(srv.events_file),
                "--label", args.policy, "--out", str(out),
                "--ideal-tag", f"mars-demo engine={format_cores(engine)}"]
        print(f"mars demo: mars {' '.join(argv)}", flush=True)
        from mars.cli import main as mars_main

        rc = mars_main(argv)
    finally:
        srv.stop()
    print(f"mars demo: done in {time.monotonic() - t0:.0f}s; results in {out}/ "
          f"(results.json, plots/*.png); compare runs with `mars report DIR...`", flush=True)
    return rc


def register(sub) -> None:
    p = sub.add_parser("demo", help="serve the embedded tiny model and replay a short ILR-1 workload",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="fcfs", help="engine policy (default: %(default)s)")
    p.add_argument("--num-tasks", type=int, default=10, help="ILR-1 tasks (default: %(default)s)")
    p.add_argument("--scale", type=float, default=50.0,
                   help="token counts divided by this (default: %(default)s)")
    p.add_argument("--time-scale", type=float, default=10.0,
                   help="arrivals and tool durations divided by this (default: %(default)s)")
    p.add_argument("--rate", type=float, default=0.2,
                   help="arrival rate in tasks/s of nominal time (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default: %(default)s)")
    p.add_argument("--engine-cores", help="cores for the server (default: all but the last)")
    p.add_argument("--tool-cores", help="cores for CPU-bound tools (default: the last)")
    p.add_argument("--out", help="output directory (default: runs/demo-<time>)")
    p.set_defaults(func=run_demo)


if __name__ == "__main__":
    from mars.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
