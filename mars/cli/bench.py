"""``mars bench``: the paper's policy comparison (§6.3) and ablation (§6.5) on one machine,
served or simulated. This module reads the command line into a :class:`BenchConfig` (every
check that can fail does so here, before a server starts) and hands it to
:mod:`mars.bench`; docs/bench.md is the manual.

Exit status: 0 every point ran and every task finished; 1 bad input, or a server or replay
failed; 3 every point ran but some task did not finish; 130 interrupted (the tables are still
written from what finished; ``--resume`` continues).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from mars.bench.plan import (
    DEFAULT_POLICIES,
    DEFAULT_RATES,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    BenchConfig,
    BenchError,
    default_out,
    parse_rates,
    resolve_policies,
    resolve_regimes,
)
from mars.bench.report import ABLATIONS
from mars.bench.run import Bench, run_seeds
from mars.cli.types import cores as _cores
from mars.cli.types import positive_float as _positive_float
from mars.cli.types import positive_int as _positive_int
from mars.cli.types import seeds as _seeds
from mars.cli.types import (add_engines, add_ideal_cache, add_request_timeout, add_slacks,
                             add_tool_workers)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """Validate everything that can be checked before a server starts (raises BenchError)."""
    preset = _apply_preset(args) if args.preset else None
    if not args.regimes:
        raise BenchError("name at least one REGIME (e.g. ILR-1), or a --preset")
    regimes = resolve_regimes(args.regimes)
    policies = resolve_policies(args.policies, args.ablation)
    rates = parse_rates(args.rates) if args.rates else list(DEFAULT_RATES)
    if args.num_tasks is None:
        from mars.bench.presets import PRESET_TASKS

        args.num_tasks = PRESET_TASKS if preset else 20
    try:
        server_args = shlex.split(args.server_args or "")
    except ValueError as e:
        raise BenchError(f"--server-args: {e}") from None
    for flag in ("--policy", "--port", "--host", "--mars-events-file", "--engine-port",
                 "--no-sidecar"):
        if any(a == flag or a.startswith(flag + "=") for a in server_args):
            raise BenchError(f"--server-args must not set {flag}: mars bench sets it per server")
    if args.resume and not args.out:
        raise BenchError("--resume needs --out DIR (the bench to continue)")
    if args.ideal not in ("auto", "skip") and not Path(args.ideal).exists():
        raise BenchError(f"--ideal: {args.ideal}: no such file")
    if args.sim:
        from mars.emulate.specs import GPUS, MODELS

        from mars.emulate.profile import DeviceProfile, is_profile_path

        gpu, _, model = args.sim.partition(":")
        if is_profile_path(args.sim):
            try:
                DeviceProfile.load(args.sim)
            except ValueError as e:
                raise BenchError(f"--sim: {e}") from None
            args.sim = str(Path(args.sim).resolve())
        elif gpu not in GPUS or model not in MODELS:
            raise BenchError(f"--sim takes GPU:MODEL with GPU in {', '.join(GPUS)} and MODEL in "
                             f"{', '.join(MODELS)}, or a device profile file (got {args.sim!r})")
        for flag in ("engine_cores", "tool_cores"):
            if getattr(args, flag):
                raise BenchError(f"--{flag.replace('_', '-')} pins real processes; --sim runs "
                                 "in virtual time (use --tool-workers for its virtual tool cores)")
    elif args.engines > 1:
        raise BenchError("--engines simulates several engines (with --sim or --preset); a "
                         "served bench starts one server per point: run mars replay against "
                         "mars sidecar --upstream URL1,URL2,... for several served engines")
    return BenchConfig(
        regimes=regimes, rates=rates, policies=policies,
        out=Path(args.out) if args.out else default_out(regimes),
        num_tasks=args.num_tasks, seed=args.seed, scale=args.scale,
        time_scale=args.time_scale, max_rounds=args.max_rounds,
        context_limit=args.context_limit, server_args=server_args,
        engine_cores=args.engine_cores, tool_cores=args.tool_cores, pin=not args.no_pin,
        jobs=args.jobs, restart=args.restart, ideal=args.ideal,
        ideal_cache=args.ideal_cache, slacks=args.slacks, tool_burn=args.tool_burn,
        tool_workers=args.tool_workers,
        request_timeout=args.request_timeout, startup_timeout=args.startup_timeout,
        run_plots=not args.no_run_plots, progress_interval=args.progress_interval,
        resume=args.resume, sim=args.sim, engines=args.engines, placement=args.placement,
        cpu_budget=args.cpu_budget,
        regime_rates={r: preset.rates(r) for r in regimes} if preset else {},
        preset=preset.name if preset else None)


def _apply_preset(args: argparse.Namespace):
    """``--preset NAME``: its simulated set-up, regimes (or a subset named), per-regime rates
    and every policy, unless --policies says otherwise."""
    from mars.bench.presets import get_preset

    try:
        preset = get_preset(args.preset)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if args.rates:
        raise BenchError("--preset sets each regime's rates; do not give --rates")
    if args.sim and args.sim != preset.sim:
        raise BenchError(f"--preset {preset.name} simulates {preset.sim}; do not give --sim")
    args.sim = preset.sim
    if args.regimes:
        asked = resolve_regimes(args.regimes)
        extra = [r for r in asked if r not in preset.regimes]
        if extra:
            raise BenchError(f"--preset {preset.name} covers {', '.join(preset.regimes)} "
                             f"(not {', '.join(extra)})")
        args.regimes = asked
    else:
        args.regimes = list(preset.regimes)
    if args.policies is None and not args.ablation:
        args.policies = "all"
    return preset


def cmd_bench(args: argparse.Namespace) -> int:
    if args.list_presets:
        from mars.bench.presets import describe

        print(describe())
        return 0
    try:
        cfg = config_from_args(args)
        if args.seeds and len(args.seeds) > 1:
            return run_seeds(cfg, args.seeds)
        if args.seeds:
            cfg.seed = args.seeds[0]
        return Bench(cfg).run()
    except BenchError as e:
        print(f"mars bench: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # e.g. an unwritable --out
        print(f"mars bench: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before the workers started (trace generation)
        print("mars bench: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED


def register(subparsers: argparse._SubParsersAction) -> None:
    from mars.workloads.toolpool import BURN_MODES

    p = subparsers.add_parser(
        "bench",
        help="compare scheduling policies: a fresh server per policy, the same seeded "
             "traces, one comparison (paper §6.3, §6.5)",
        description=(
            "Start `mars-vllm serve --policy P` for every policy (same model, same flags), "
            "replay the same seeded traces of each REGIME at each rate with `mars replay`, "
            "and write one comparison: mean/P90/P95 latency and goodput per policy and "
            "rate, MARS's ratio to the strongest baseline at each point, latency-vs-rate "
            "plots per regime and an ablation table. See docs/bench.md."),
        epilog=(
            "example (tiny model on CPU): mars bench ILR-1 --ablation --rates 0.1,0.3 "
            "--num-tasks 8 --scale 20 --time-scale 10 "
            "--server-args='--max-model-len 4096 --kv-cache-memory-bytes 4194304'"),
    )
    p.add_argument("regimes", nargs="*", metavar="REGIME",
                   help="workload regimes (ILR-1..4, S-ILR-1..3; several or comma-separated; "
                        "with --preset, a subset of its regimes)")
    p.add_argument("--preset", metavar="NAME",
                   help="one of the paper's set-ups, simulated: h100-qwen, h100-gptoss, "
                        "h200-qwen (its --sim, regimes, each regime's rates as multiples of "
                        "that regime's measured fcfs saturation rate, every policy, 100 tasks "
                        "per point; --list-presets shows them; docs/bench.md)")
    p.add_argument("--list-presets", action="store_true",
                   help="print the presets and their rates, and exit")
    p.add_argument("--policies", metavar="LIST",
                   help=f"comma-separated policies, or 'all' (default: {','.join(DEFAULT_POLICIES)})")
    p.add_argument("--ablation", action="store_true",
                   help=f"also run mars and its ablations ({', '.join(ABLATIONS)})")
    p.add_argument("--rates", metavar="LIST",
                   help="arrival rates in tasks/s of nominal time (before --time-scale), "
                        f"comma-separated (default: {','.join(map(str, DEFAULT_RATES))})")
    p.add_argument("--num-tasks", type=_positive_int, default=None, metavar="N",
                   help="tasks per point (default: 20; 100 with --preset)")
    seed = p.add_mutually_exclusive_group()
    seed.add_argument("--seed", type=int, default=0,
                      help="trace and content seed (default: 0)")
    seed.add_argument("--seeds", type=_seeds, metavar="LIST",
                      help="several seeds (0,1,2 or 0-2): one bench per seed in OUT/seed-N, "
                           "then every point pooled over the seeds in OUT (intervals over "
                           "(seed, task) pairs) with MARS's ratio seed by seed")
    p.add_argument("--scale", type=_positive_float, default=1.0, metavar="F",
                   help="divide token counts by F (tiny models; default 1)")
    p.add_argument("--time-scale", type=_positive_float, default=1.0, metavar="T",
                   help="divide arrival times and tool durations by T (default 1)")
    p.add_argument("--max-rounds", type=_positive_int, metavar="N",
                   help="cut every task after N rounds (smoke tests)")
    p.add_argument("--context-limit", type=_positive_int, metavar="TOKENS",
                   help="generator's full-scale context limit (default: the regime's)")
    p.add_argument("--server-args", metavar="'ARGS'",
                   help="extra `mars-vllm serve` arguments for every server, one shell-quoted "
                        "string; write it with '=' (--server-args='MODEL --max-num-seqs 8')")
    p.add_argument("--engine-cores", type=_cores, metavar="LIST",
                   help="cores of the servers (default: all but the last)")
    p.add_argument("--tool-cores", type=_cores, metavar="LIST",
                   help="cores of the CPU-bound tools (default: the last)")
    p.add_argument("--no-pin", action="store_true", help="do not pin servers and tools")
    p.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="run N servers at once: smoke tests only, the latencies are then not "
                        "comparable (default: 1)")
    p.add_argument("--restart", choices=("auto", "policy", "point"), default="auto",
                   help="a fresh server per policy, per (regime, rate) point, or 'auto' "
                        "(default): per point for the policies whose sidecar admission keeps "
                        "state between runs (mars, mars_no_coord, mars_no_cosched), per "
                        "policy for the rest")
    p.add_argument("--ideal", default="auto", metavar="auto|skip|FILE",
                   help="ideal latencies for goodput: 'auto' measures them once per regime "
                        "(or takes them from the cache), 'skip', or a FILE for every point")
    add_ideal_cache(p)
    add_slacks(p)
    p.add_argument("--tool-burn", choices=BURN_MODES, default="cpu",
                   help="CPU-bound tools burn CPU time (cpu, default) or wall time (wall)")
    add_tool_workers(p)
    add_request_timeout(p)
    p.add_argument("--startup-timeout", type=_positive_float, default=600.0, metavar="S",
                   help="give up on a server not ready after S seconds (default 600)")
    p.add_argument("--no-run-plots", action="store_true",
                   help="skip each replay's own plots (the comparison plots are still drawn)")
    p.add_argument("--progress-interval", type=_positive_float, default=30.0, metavar="S",
                   help="seconds between progress lines (default 30)")
    p.add_argument("--sim", metavar="GPU:MODEL|PROFILE",
                   help="simulate every point in virtual time (mars sim, docs/sim.md) on this "
                        "EMULATED GPU and model instead of serving it: no server; points run "
                        "in parallel with --jobs and stay comparable; --server-args go to the "
                        "simulated engine; --tool-workers sets its virtual tool cores "
                        "(default 8), e.g. --sim h100-nvl:qwen3-coder-30b-a3b; or a device "
                        "profile from `mars emulate calibrate`")
    add_engines(p)
    p.add_argument("--out", metavar="DIR", help="output directory (default runs/bench-<regimes>-<time>)")
    p.add_argument("--resume", action="store_true",
                   help="continue the bench in --out: reuse its finished points")
    p.set_defaults(func=cmd_bench)
