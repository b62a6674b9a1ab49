"""``mars demo``: the README's "run the main job": fcfs vs mars on an EMULATED H100.

By default it serves Qwen3-Coder-30B-A3B on an emulated H100 NVL (``mars-vllm serve
--emulate``: vLLM's real scheduler and KV cache manager with the model's real KV layout and
the card's KV capacity, each step taking the step-time model's time; docs/emulation.md),
replays the same seeded agent workload at full token scale under ``fcfs`` and under ``mars``
(one fresh server each), and prints them side by side: task latency mean / P90 / P95,
per-round TTFT, goodput, preemptions and recomputed context, with plots. The default
operating point (12 ILR-3 tasks at 0.2 tasks/s) loads the card past what its KV cache holds
across tool calls: under fcfs sessions lose their context to eviction while their tools run
and prefill it again (at 0.1 tasks/s of ILR-2 nothing is evicted and the two policies are
within 3 %). Tools run on virtual cores (they
queue for ``--virtual-tool-cores`` slots and sleep; the sidecar is told the same number).
Ideal latencies for goodput are the step-time model's isolated estimates
(``mars.workloads.ideal.estimate_isolated_s``), not a measured isolated run.

``mars demo --real-cpu`` runs the earlier demo instead: the embedded tiny model computing on
this machine's CPU, a short scaled ILR-1 replay (every policy is within noise there: the
costs MARS manages barely exist at that scale).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

from mars.launch import pinned_to

DEFAULT_EMULATE = "h100-nvl:qwen3-coder-30b-a3b"


def split_cores(available: list[int]) -> tuple[list[int], list[int]]:
    """Engine cores and tool cores: all but the last / the last (shared on one core)."""
    if len(available) < 2:
        return list(available), list(available)
    return available[:-1], available[-1:]


def run_demo(args: argparse.Namespace) -> int:
    return run_cpu_demo(args) if args.real_cpu else run_emulated_demo(args)


def write_estimated_ideal(path: Path, regime: str, num_tasks: int, rate: float, seed: int,
                          emulate: str, context_limit: int | None = None) -> dict[str, float]:
    """{task_id: seconds}: each task alone on the emulated GPU, by the step-time model."""
    from mars.emulate.measured import step_model_for
    from mars.emulate.specs import get_gpu, get_model
    from mars.workloads.generator import generate
    from mars.workloads.ideal import estimate_isolated_s

    gpu, _, model = emulate.partition(":")
    stm = step_model_for(get_model(model), get_gpu(gpu))
    trace = generate(regime, num_tasks=num_tasks, rate=rate, seed=seed,
                     context_limit=context_limit)
    ideal = {t.task_id: estimate_isolated_s(t, stm) for t in trace}
    path.write_text(json.dumps(ideal, indent=1))
    return ideal


def run_emulated_demo(args: argparse.Namespace) -> int:
    from mars.launch import ServerProcess
    from mars.workloads.results import format_report, read_results

    out = Path(args.out or Path("runs") / f"demo-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    regime = args.regime or "ILR-3"
    num = args.num_tasks or 12
    rate = args.rate or 0.2
    policies = [p for p in args.policies.split(",") if p]
    print(f"mars demo: EMULATED GPU {args.emulate} -- {regime}, {num} tasks at {rate}/s, "
          f"{args.virtual_tool_cores} virtual tool cores, policies {', '.join(policies)}",
          flush=True)
    t0 = time.monotonic()
    ideal_file = out / "ideal-estimate.json"
    context_limit = None
    runs = []
    for policy in policies:
        srv = ServerProcess(args=["--emulate", args.emulate, "--policy", policy,
                                  "--tool-cores", str(args.virtual_tool_cores),
                                  "--enable-prompt-tokens-details"])
        print(f"mars demo: starting `mars-vllm serve --emulate {args.emulate} --policy "
              f"{policy}` ...", flush=True)
        srv.start()
        try:
            if context_limit is None:
                import httpx

                # the trace is generated within what the emulated card serves
                context_limit = httpx.get(srv.url + "/v1/models", timeout=10).json()[
                    "data"][0]["max_model_len"]
                write_estimated_ideal(ideal_file, regime, num, rate, args.seed, args.emulate,
                                      context_limit=context_limit)
            run_dir = out / policy
            argv = ["replay", regime, "--url", srv.url, "--num-tasks", str(num),
                    "--rate", str(rate), "--seed", str(args.seed),
                    "--context-limit", str(context_limit),
                    "--virtual-tool-cores", str(args.virtual_tool_cores),
                    "--events-file", str(srv.events_file), "--ideal", str(ideal_file),
                    "--label", policy, "--out", str(run_dir)]
            print(f"mars demo: mars {' '.join(argv)}", flush=True)
            from mars.cli import main as mars_main

            rc = mars_main(argv)
            if rc != 0:
                print(f"mars demo: the {policy} replay failed (exit {rc}); log {srv.log_path}",
                      file=sys.stderr)
                return rc
            runs.append(run_dir)
        finally:
            srv.stop()
    results = [read_results(r / "results.json") for r in runs]
    table = format_report(results, names=policies)
    cmp_png = out / "latency_cdf.png"
    try:
        from mars.workloads.plots import plot_latency_cdf

        plot_latency_cdf(results, cmp_png, names=policies)
    except Exception as exc:  # noqa: BLE001 - plots are optional (matplotlib extra)
        print(f"mars demo: no comparison plot ({exc})", file=sys.stderr)
    header = (f"EMULATED GPU {args.emulate} (step-time model, docs/emulation.md); {regime}, "
              f"{num} tasks at {rate} tasks/s, seed {args.seed}; ideal = step-time estimate")
    (out / "comparison.md").write_text(header + "\n\n" + table + "\n")
    print("\n" + header + "\n\n" + table, flush=True)
    print(f"\nmars demo: done in {time.monotonic() - t0:.0f}s; results in {out}/ "
          f"(comparison.md, latency_cdf.png, <policy>/results.json and plots/)", flush=True)
    return 0


def run_cpu_demo(args: argparse.Namespace) -> int:
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
        argv = ["replay", args.regime or "ILR-1", "--url", srv.url,
                "--num-tasks", str(args.num_tasks or 10),
                "--scale", str(args.scale), "--time-scale", str(args.time_scale),
                "--rate", str(args.rate or 0.2), "--seed", str(args.seed),
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
    p = sub.add_parser("demo", help="fcfs vs mars on an emulated H100 (or --real-cpu: the tiny "
                                    "model on this CPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real-cpu", action="store_true",
                   help="the embedded tiny model computing on this CPU, one policy, scaled "
                        "tokens (the earlier demo)")
    p.add_argument("--emulate", default=DEFAULT_EMULATE, metavar="GPU:MODEL",
                   help="emulated GPU and model (default: %(default)s)")
    p.add_argument("--policies", default="fcfs,mars",
                   help="policies compared on the emulated GPU (default: %(default)s)")
    p.add_argument("--virtual-tool-cores", type=int, default=8, metavar="N",
                   help="tool slots on the emulated host (default: %(default)s)")
    p.add_argument("--regime", default=None,
                   help="workload regime (default: ILR-3 emulated, ILR-1 --real-cpu)")
    p.add_argument("--num-tasks", type=int, default=None,
                   help="tasks (default: 12 emulated, 10 --real-cpu)")
    p.add_argument("--rate", type=float, default=None,
                   help="arrival rate in tasks/s of nominal time (default: 0.2)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default: %(default)s)")
    p.add_argument("--policy", default="fcfs", help="--real-cpu: engine policy (default: %(default)s)")
    p.add_argument("--scale", type=float, default=50.0,
                   help="--real-cpu: token counts divided by this (default: %(default)s)")
    p.add_argument("--time-scale", type=float, default=10.0,
                   help="--real-cpu: arrivals and tool durations divided by this (default: "
                        "%(default)s)")
    p.add_argument("--engine-cores", help="--real-cpu: cores for the server (default: all but "
                                          "the last)")
    p.add_argument("--tool-cores", help="--real-cpu: cores for CPU-bound tools (default: the last)")
    p.add_argument("--out", help="output directory (default: runs/demo-<time>)")
    p.set_defaults(func=run_demo)


if __name__ == "__main__":
    from mars.cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
