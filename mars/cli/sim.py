"""mars sim run: one operating point, each chosen policy, in virtual time.

For each policy a fresh simulation (vLLM's engine with that policy's scheduler on the
EMULATED GPU, the sidecar's admission core, tools on virtual cores) replays the trace;
policies run in parallel processes with --jobs. Ideal latencies for goodput are each task run
alone in the simulator under stock vLLM scheduling (fcfs), cached like the replay's: the same
for every policy, as the paper judges every policy against the same isolated latency. Writes
results.json and events.jsonl per policy in mars replay's schema (mars report reads them),
report.md with the side-by-side table, and a latency CDF plot. Times are virtual seconds.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from mars.cli.types import positive_int as _positive_int
from mars.cli.types import add_engines, add_ideal_cache, add_slacks

DEFAULT_GPU = "h100-nvl"
DEFAULT_MODEL = "qwen3-coder-30b-a3b"
#: the policy the isolated (ideal) run is simulated under
IDEAL_POLICY = "fcfs"
#: mars-vllm serve flags that configure the sidecar: the simulator builds its admission core
#: from the sidecar's defaults, the policy and --tool-cores, so these are refused, not ignored
SIDECAR_FLAGS = frozenset({"--sidecar-args", "--no-sidecar", "--tool-cores", "--api-key",
                           "--mars-events-api-key"})


def _policies(text: str) -> list[str]:
    from mars.policy.registry import POLICY_NAMES

    names = list(POLICY_NAMES) if text == "all" else [p for p in text.split(",") if p]
    bad = [p for p in names if p not in POLICY_NAMES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {bad[0] if bad else text!r}; valid: "
                                         f"{', '.join(POLICY_NAMES)} or all")
    return names


def _gpu_model(args: argparse.Namespace) -> None:
    from mars.emulate.specs import GPUS, MODELS

    if args.profile:
        from mars.emulate.profile import DeviceProfile, profile_digest

        try:
            prof = DeviceProfile.load(args.profile)
        except ValueError as e:
            raise SystemExit(f"mars sim: --profile: {e}") from None
        args.profile = os.path.abspath(args.profile)
        args.gpu, args.model = prof.gpu.name, prof.name
        args.profile_sha256 = profile_digest(args.profile)
        return
    args.profile_sha256 = None
    if args.gpu not in GPUS:
        raise SystemExit(f"mars sim: unknown GPU {args.gpu!r}; known: {', '.join(GPUS)}")
    if args.model not in MODELS:
        raise SystemExit(f"mars sim: unknown model {args.model!r}; known: {', '.join(MODELS)}")


def _host(args: argparse.Namespace) -> None:
    """``--host-from RUN``: the served host's delays, measured off a real run's records."""
    from mars.sim.host import HostModel, measure_host

    args.host_model = HostModel()
    run = getattr(args, "host_from", None)
    if not run:
        return
    from mars.workloads.eventlink import read_events
    from mars.workloads.results import read_results

    d = Path(run)
    try:
        res = read_results(d)
        ev = read_events(d / "events.jsonl")
        args.host_model = h = measure_host(res, ev)
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"mars sim: --host-from {run}: {e} (a `mars replay` output directory "
                         "with results.json and events.jsonl)") from None
    print(f"mars sim: host modeled from {run}: {h.request_s * 1e3:.1f} ms to the engine and "
          f"{h.response_s * 1e3:.1f} ms back per round, tools +{h.tool_overrun:.1%}",
          file=sys.stderr)


def point_config(args: argparse.Namespace, policy: str, engines: int | None = None):
    """The simulation of one policy; ``engines``: how many (default: ``--engines``)."""
    from mars.sim.host import HostModel
    from mars.sim.runner import SimConfig

    host = getattr(args, "host_model", None) or HostModel()
    return SimConfig(host=host, gpu=args.gpu, model=args.model, policy=policy,
                     tool_cores=args.tool_cores, seed=args.seed, slacks=tuple(args.slacks),
                     engine_args=tuple(shlex.split(args.engine_args)) if args.engine_args else (),
                     progress=not args.no_progress and args.jobs == 1,
                     profile=args.profile,
                     engines=getattr(args, "engines", 1) if engines is None else engines,
                     placement=getattr(args, "placement", "mars"),
                     cpu_budget=getattr(args, "cpu_budget", "node"),
                     admission_config=getattr(args, "admission_json", "") or "")


def scheduling_class(engine_args: str) -> str:
    """The class the simulated engines will run: async (vLLM's default on a GPU) unless
    asked for sync, or unless this process cannot keep it (the platform plugin did not
    load: docs/emulation.md, *Pacing*)."""
    from mars.engine.executor.platform import emulated_async_available

    if "--no-async-scheduling" in engine_args or not emulated_async_available():
        return "sync"
    return "async"


def ideal_fields(args: argparse.Namespace, trace) -> dict[str, Any]:
    from mars.emulate.measured import step_model_stamp
    from mars.workloads.ideal import trace_digest
    from mars.workloads.prompts import DEFAULT_TOKEN_RANGE
    from mars.workloads.trace import dumps_trace

    return {"trace_sha256": trace_digest(dumps_trace(trace)), "simulated": True,
            "gpu": args.gpu, "model": args.model, "policy": IDEAL_POLICY,
            # the step-time model the isolated runs were timed with (measured tables change
            # when re-timed; a profile's roofline is keyed by its digest below)
            **({} if args.profile else {"step_model": step_model_stamp(
                args.gpu, args.model,
                "roofline" if '"roofline"' in (args.engine_args or "") else "measured")}),
            **({"profile_sha256": args.profile_sha256} if args.profile else {}),
            "engine_args": args.engine_args or "", "tool_cores": args.tool_cores,
            # async scheduling became the default after sync-only ideals were cached
            "scheduling": scheduling_class(args.engine_args or ""),
            "token_range": list(DEFAULT_TOKEN_RANGE), "seed": args.seed,
            **({"host": args.host_model.as_dict()}
               if getattr(args, "host_model", None) and args.host_model.active else {})}


def simulate_ideal(args: argparse.Namespace, trace, out: Path) -> dict[str, float]:
    """Each task alone (the isolated run), cached by what determines it."""
    from mars.sim.runner import Simulation
    from mars.workloads.ideal import cache_dir, ideal_key, load_cached, save_cached
    from mars.workloads.results import write_results

    fields = ideal_fields(args, trace)
    key, cdir = ideal_key(fields), cache_dir(args.ideal_cache)
    ideal = load_cached(key, cdir)
    if ideal is not None:
        print(f"mars sim: ideal latencies from cache {cdir / (key + '.json')}", file=sys.stderr)
        return ideal
    print("mars sim: simulating ideal latencies (each task alone, fcfs)", file=sys.stderr)
    # a task alone needs one engine, however many the point has: the ideal is the same
    sim = Simulation(point_config(args, IDEAL_POLICY, engines=1))
    try:
        iso = sim.run(trace, "isolated", "ideal (isolated)")
    finally:
        sim.close()
    write_results(iso, out / "ideal_results.json")
    ideal = {t.task_id: t.latency_s for t in iso.tasks if t.latency_s is not None}
    if len(ideal) == len(iso.tasks):
        save_cached(key, fields, ideal, cdir, source="mars sim (isolated)")
    return ideal


def run_point(args: argparse.Namespace, policy: str, trace, ideal: dict[str, float] | None,
              out: Path) -> Path:
    """Simulate one policy; returns its results.json."""
    from mars.sim.runner import Simulation
    from mars.workloads.results import write_results

    pdir = out if args.flat else out / policy
    pdir.mkdir(parents=True, exist_ok=True)
    sim = Simulation(point_config(args, policy), events_path=pdir / "events.jsonl")
    try:
        res = sim.run(trace, "load", policy, ideal=ideal)
    finally:
        sim.close()
    res.files["events"] = str(pdir / "events.jsonl")
    res.config["ideal"] = {"mode": args.ideal, "policy": IDEAL_POLICY if args.ideal == "auto"
                           else None}
    write_results(res, pdir / "results.json")
    return pdir / "results.json"


def _point_worker(payload: tuple) -> str:
    args, policy, trace_text, ideal, out = payload
    from mars.workloads.trace import loads_trace

    _quiet_vllm()
    return str(run_point(args, policy, loads_trace(trace_text), ideal, Path(out)))


def _quiet_vllm() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def cmd_run(args: argparse.Namespace) -> int:
    from mars.cli.replay import build_trace
    from mars.workloads.results import format_report, read_results
    from mars.workloads.trace import TraceError, dumps_trace, write_trace

    _gpu_model(args)
    _host(args)
    if args.no_async_scheduling:  # vLLM's own flag, given to every engine
        args.engine_args = f"{args.engine_args or ''} --no-async-scheduling".strip()
    try:
        extra = shlex.split(args.engine_args or "")
    except ValueError as e:
        print(f"mars sim: --engine-args: {e}", file=sys.stderr)
        return 1
    bad = [a for a in extra if a.split("=")[0] in SIDECAR_FLAGS]
    if bad:
        print(f"mars sim: --engine-args: {bad[0]} configures the sidecar, which mars sim "
              "models from its defaults (use mars sim's own --tool-cores)", file=sys.stderr)
        return 1
    args.admission_json = ""
    if args.admission_config:
        from mars.sidecar.config import admission_config, read_admission_overrides

        try:
            raw = read_admission_overrides(args.admission_config)
            admission_config(raw)  # every key and value checked before any run starts
        except (OSError, ValueError, TypeError) as e:
            print(f"mars sim: --admission-config: {e}", file=sys.stderr)
            return 1
        args.admission_json = json.dumps(raw)
    if args.flat and len(args.policies) != 1:
        print("mars sim: --flat writes one policy's results into --out: give one policy",
              file=sys.stderr)
        return 1
    try:
        trace = build_trace(args)
    except (ValueError, TraceError, OSError) as e:
        print(f"mars sim: {e}", file=sys.stderr)
        return 1
    out = Path(args.out or Path("runs") / f"sim-{trace.header.regime}-"
               f"{_dt.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    write_trace(trace, out / "trace.jsonl")
    _quiet_vllm()
    t0 = time.monotonic()
    what = point_config(args, args.policies[0]).target
    if args.engines > 1:
        what = f"{args.engines} x {what} (placement {args.placement})"
    print(f"mars sim: SIMULATED (virtual time) on the EMULATED {what}: "
          f"{trace.header.regime}, {len(trace)} tasks, {sum(t.num_rounds for t in trace)} rounds, "
          f"{args.tool_cores} virtual tool cores; policies {', '.join(args.policies)}",
          file=sys.stderr, flush=True)
    ideal: dict[str, float] | None = None
    if args.ideal == "auto":
        ideal = simulate_ideal(args, trace, out)
    elif args.ideal != "skip":
        from mars.workloads.ideal import load_ideal_file

        try:
            ideal = load_ideal_file(args.ideal)
        except ValueError as e:
            print(f"mars sim: --ideal: {e}", file=sys.stderr)
            return 1
    paths: list[str] = []
    if args.jobs > 1 and len(args.policies) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        text = dumps_trace(trace)
        with ProcessPoolExecutor(min(args.jobs, len(args.policies)),
                                 mp_context=mp.get_context("spawn")) as ex:
            paths = list(ex.map(_point_worker, [(args, p, text, ideal, str(out))
                                                for p in args.policies]))
    else:
        for p in args.policies:
            paths.append(str(run_point(args, p, trace, ideal, out)))
    results = [read_results(p) for p in paths]
    if args.flat:
        r = results[0]
        lat = r.summary.get("latency_s") or {}
        print(f"mars sim: {r.label}: {r.summary.get('tasks')}, latency mean "
              f"{lat.get('mean') or float('nan'):.2f} s (virtual; {r.run.get('sim_wall_s')} s of "
              f"wall time)", file=sys.stderr)
        failed = r.summary.get("tasks", {}).get("error")
        return 3 if failed else 0
    report = format_report(results, names=args.policies, slacks=args.slacks)
    (out / "report.md").write_text(report + "\n")
    print(report)
    if not args.no_plots:
        try:
            from mars.workloads.plots import plot_latency_cdf

            plot_latency_cdf(results, out / "latency_cdf.png", args.policies)
            print(f"plot:    {out / 'latency_cdf.png'}", file=sys.stderr)
        except ImportError as e:
            print(f"mars sim: plots skipped: {e}", file=sys.stderr)
    virt = max(r.run.get("wall_s", 0.0) for r in results)
    print(f"results: {out}/<policy>/results.json (virtual time; {virt:,.0f} simulated seconds "
          f"in {time.monotonic() - t0:,.0f} s of wall time)", file=sys.stderr)
    failed = [r.label for r in results if r.summary.get("tasks", {}).get("error")]
    return 3 if failed else 0


def register(sub) -> None:
    from mars.workloads.generator import REGIMES
    from mars.cli.replay import add_trace_arguments

    p = sub.add_parser(
        "sim", help="simulate agent workloads on an emulated GPU in virtual time",
        description="The served stack's decisions in virtual time: vLLM's engine with each "
                    "policy's scheduler on the EMULATED GPU (step-time model), the sidecar's "
                    "admission core and tools on virtual cores, in one process per policy. "
                    "See docs/sim.md.")
    ss = p.add_subparsers(dest="sim_cmd", required=True)
    r = ss.add_parser("run", help="one operating point under one or more policies",
                      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("regime", nargs="?", metavar="REGIME",
                   help=f"generate a trace for this regime: {', '.join(REGIMES)}")
    r.add_argument("--trace", metavar="FILE", help="simulate this trace file instead")
    r.add_argument("--gpu", default=DEFAULT_GPU, help=f"emulated GPU (default {DEFAULT_GPU})")
    r.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"emulated model (default {DEFAULT_MODEL})")
    r.add_argument("--profile", metavar="FILE",
                   help="emulate a device profile from `mars emulate calibrate` (a measured "
                        "device and model, with its engine settings) instead of --gpu/--model")
    r.add_argument("--host-from", metavar="RUN_DIR",
                   help="model the served host as measured in this real run (a `mars replay` "
                        "output with the engine's events.jsonl): the mean time per round to "
                        "the engine and back, and the tools' overrun (default: no host)")
    r.add_argument("--policies", type=_policies, default=["fcfs", "mars"], metavar="LIST",
                   help="comma-separated policies, or all (default fcfs,mars)")
    add_trace_arguments(r)
    r.add_argument("--tool-cores", type=_positive_int, default=8, metavar="N",
                   help="virtual CPU cores for CPU-bound tools; the sidecar's CPU cap is told "
                        "the same (default 8)")
    add_engines(r)
    r.add_argument("--engine-args", default="", metavar="ARGS",
                   help="more `mars-vllm serve` arguments, one string (e.g. "
                        "'--max-num-seqs 256')")
    r.add_argument("--admission-config", default=None, metavar="JSON|@FILE",
                   help="the sidecar's AdmissionConfig overrides, as `mars sidecar "
                        "--admission-config` takes them (e.g. '{\"host_tier\": false}'; "
                        "docs/control_plane.md)")
    r.add_argument("--no-async-scheduling", action="store_true",
                   help="vLLM's sync scheduler class (MarsScheduler) instead of the async one "
                        "(MarsAsyncScheduler) that vLLM runs on a GPU by default")
    r.add_argument("--ideal", default="auto", metavar="auto|skip|FILE",
                   help="ideal latencies: auto = simulate each task alone (cached), skip, or "
                        "a file as for mars replay (default auto)")
    add_ideal_cache(r)
    r.add_argument("--jobs", type=_positive_int, default=1, metavar="N",
                   help="policies simulated in parallel processes (default 1)")
    add_slacks(r)
    r.add_argument("--out", metavar="DIR", help="output directory (default runs/sim-...)")
    r.add_argument("--flat", action="store_true",
                   help="one policy: write its results.json and events.jsonl into --out itself "
                        "(no per-policy directory, no report; used by mars bench --sim)")
    r.add_argument("--no-plots", action="store_true", help="no PNG plots")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)
