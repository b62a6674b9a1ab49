"""``mars replay`` and ``mars report``: the measurement harness on the command line.

``mars/cli/__init__.py`` calls :func:`register`; each leaf command sets ``func(args) -> int``.
Exit status of ``mars replay``: 0 every task done, 1 bad input or unreachable server (one
line on stderr; malformed options are argparse's usual 2), 3 the run finished but some task
failed, 130 interrupted (partial results are still written).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any


from mars.workloads.generator import REGIMES, compress_time, generate, scale_trace
from mars.workloads.httpclient import ReplayError
from mars.workloads.ideal import cache_dir, ideal_key, load_cached, load_ideal_file, save_cached
from mars.workloads.prompts import DEFAULT_TOKEN_RANGE, parse_token_range
from mars.workloads.results import ResultsError, RunResult, format_report, read_results, write_results
from mars.workloads.toolpool import BURN_MODES
from mars.cli.interrupt import EarlyInterrupt
from mars.workloads.trace import Trace, TraceError, read_trace, write_trace
from mars.cli.types import cores as _cores
from mars.cli.types import positive_float as _positive_float
from mars.cli.types import positive_int as _positive_int
from mars.cli.types import add_ideal_cache, add_request_timeout, add_slacks, add_tool_workers

EXIT_OK, EXIT_USAGE, EXIT_FAILED_TASKS, EXIT_INTERRUPTED = 0, 1, 3, 130


def _token_range(s: str) -> tuple[int, int]:
    try:
        return parse_token_range(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# ---------------------------------------------------------------------------------- trace


def build_trace(args: argparse.Namespace) -> Trace:
    """The trace to replay: generated from a regime or read from ``--trace``, then scaled."""
    if (args.regime is None) == (args.trace is None):
        raise ValueError("give a regime (e.g. ILR-1) or --trace FILE, not both / neither")
    if args.trace is not None:
        if args.num_tasks is not None or args.duration is not None or args.rate is not None:
            raise ValueError("--num-tasks/--duration/--rate generate a trace; with --trace the "
                             "file decides (use --scale/--time-scale to transform it)")
        trace = read_trace(args.trace)
        trace = scale_trace(trace, args.scale)
        return compress_time(trace, args.time_scale)
    num = args.num_tasks if (args.num_tasks or args.duration) else 20
    return generate(args.regime, num_tasks=num, duration_s=args.duration,
                    rate=args.rate if args.rate is not None else 0.2, seed=args.seed,
                    scale=args.scale, time_scale=args.time_scale,
                    context_limit=args.context_limit)


# --------------------------------------------------------------------------------- replay


def cmd_replay(args: argparse.Namespace) -> int:
    # a Ctrl-C since the command started, held (and restored) by mars.cli.main: the replay
    # stops on it the graceful way once started
    early: EarlyInterrupt = args.early_interrupt
    try:
        trace = build_trace(args)
    except (TraceError, ValueError) as e:
        print(f"mars replay: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return asyncio.run(_replay_main(args, trace, early))
    except ReplayError as e:
        print(f"mars replay: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # e.g. an unwritable --out
        print(f"mars replay: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("mars replay: aborted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _out_dir(args: argparse.Namespace, trace: Trace) -> Path:
    if args.out:
        return Path(args.out)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = args.label or trace.header.regime
    return Path("runs") / f"{name}-{stamp}"


async def _replay_main(args: argparse.Namespace, trace: Trace,
                       early: EarlyInterrupt | None = None) -> int:
    from mars.workloads.replay import ReplayConfig, ReplaySession

    out = _out_dir(args, trace)
    if args.virtual_tool_cores:
        if args.tool_cores or args.tool_workers:
            raise SystemExit("mars replay: --virtual-tool-cores replaces --tool-cores and "
                             "--tool-workers")
        args.tool_burn, args.tool_workers = "sleep", args.virtual_tool_cores
    cfg = ReplayConfig(
        url=args.url, model=args.model, token_range=args.token_range, seed=args.seed,
        salt=args.salt, tool_cores=tuple(args.tool_cores) if args.tool_cores else None,
        tool_workers=args.tool_workers, tool_burn=args.tool_burn,
        request_timeout_s=args.request_timeout, events_file=args.events_file,
        progress=not args.no_progress, slacks=args.slacks,
        api_key=args.api_key or os.environ.get("MARS_API_KEY") or None,
        events_api_key=args.events_api_key or os.environ.get("MARS_EVENTS_API_KEY") or None)
    if args.ideal not in ("auto", "skip") and not args.isolated:
        try:
            ideal = load_ideal_file(args.ideal)
        except ValueError as e:
            raise ReplayError(f"--ideal: {e}") from None
    else:
        ideal = None
    async with ReplaySession(cfg) as session:
        loop = asyncio.get_running_loop()

        def on_sigint() -> None:
            print("\nmars replay: interrupted, stopping (Ctrl-C again to abort without "
                  "results)", file=sys.stderr, flush=True)
            loop.remove_signal_handler(signal.SIGINT)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            session.stop()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        if early is not None and early.pending:
            on_sigint()  # Ctrl-C came during start-up: stop before the first task
        assert session.server is not None
        srv, pool = session.server, session.pool
        tools = ("?" if pool is None else f"{pool.workers} virtual tool cores" if pool.virtual
                 else f"tool cores {pool.cores}")
        print(f"mars replay: {trace.header.regime}, {len(trace)} tasks, "
              f"{sum(t.num_rounds for t in trace)} rounds -> {srv.url} (model {srv.model}, "
              f"max_model_len {srv.max_model_len}, sidecar {'yes' if srv.sidecar else 'no'}); "
              f"{tools}", file=sys.stderr)
        from mars.workloads.ideal import trace_digest
        from mars.workloads.trace import dumps_trace

        key_fields = {
            "trace_sha256": trace_digest(dumps_trace(trace)), "model": srv.model,
            "root": srv.root, "max_model_len": srv.max_model_len,
            "cache_config": {k: srv.cache_config.get(k) for k in ("block_size", "enable_prefix_caching")},
            "token_range": list(cfg.token_range), "seed": cfg.seed,
            "tool_burn": cfg.tool_burn, "tool_workers": session.pool.workers if session.pool else None,
            "tag": args.ideal_tag,
        }
        key = ideal_key(key_fields)
        cdir = cache_dir(args.ideal_cache)
        ideal_info: dict[str, Any] = {"mode": args.ideal, "key": key}
        extra: list[RunResult] = []

        if args.isolated:
            result = await session.run(trace, "isolated", args.label or "isolated")
            _save_ideal(result, key, key_fields, cdir, ideal_info)
        else:
            if args.ideal == "auto":
                ideal = load_cached(key, cdir)
                if ideal is not None:
                    ideal_info["source"] = str(cdir / f"{key}.json")
                    print(f"mars replay: ideal latencies from cache {ideal_info['source']}",
                          file=sys.stderr)
                else:
                    print(f"mars replay: measuring ideal latencies (isolated replay, one task at "
                          f"a time; cached under {cdir})", file=sys.stderr)
                    iso = await session.run(trace, "isolated", "ideal (isolated)")
                    extra.append(iso)
                    ideal = _save_ideal(iso, key, key_fields, cdir, ideal_info)
            elif args.ideal != "skip":
                ideal_info["source"] = str(args.ideal)
            if session.stopping and extra:  # stopped while measuring the ideal latencies
                result = extra[0]
            else:  # (stopped before: the load run starts no task and says so)
                out.mkdir(parents=True, exist_ok=True)
                result = await session.run(trace, "load", args.label or "replay",
                                           events_path=out / "events.jsonl", ideal=ideal)
        result.config["ideal"] = ideal_info
        interrupted = session.stopping
    return _finish(args, trace, out, result, extra, interrupted)


def _save_ideal(iso: RunResult, key: str, fields: dict[str, Any], cdir: Path,
                info: dict[str, Any]) -> dict[str, float] | None:
    ideal = {t.task_id: t.latency_s for t in iso.tasks if t.latency_s is not None}
    if iso.run.get("interrupted") or len(ideal) != len(iso.tasks):
        info["source"] = None
        iso.notes.append(f"ideal latencies not cached: {len(iso.tasks) - len(ideal)} tasks not done")
        return ideal or None
    p = save_cached(key, fields, ideal, cdir, source="mars replay --isolated")
    info["source"] = str(p)
    return ideal


def _finish(args: argparse.Namespace, trace: Trace, out: Path, result: RunResult,
            extra: list[RunResult], interrupted: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    write_trace(trace, out / "trace.jsonl")
    result.files["trace"] = str(out / "trace.jsonl")
    for iso in extra:
        if iso is not result:
            write_results(iso, out / "ideal_results.json")
            result.files["ideal_results"] = str(out / "ideal_results.json")
    if not args.no_plots:
        try:
            from mars.workloads.eventlink import read_events
            from mars.workloads.plots import write_run_plots

            evs = read_events(result.files["events"]) if "events" in result.files else []
            result.files.update(write_run_plots(result, out / "plots", evs))
        except ImportError as e:
            result.notes.append(f"plots skipped: {e}")
    write_results(result, out / "results.json")
    print(format_report([result], slacks=args.slacks))
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    for t in result.tasks:
        if t.status in ("error", "skipped") and t.error:
            print(f"task {t.task_id} {t.status}: {t.error}", file=sys.stderr)
    print(f"\nresults: {out / 'results.json'}", file=sys.stderr)
    plots = [v for k, v in result.files.items() if v.endswith(".png")]
    if plots:
        print(f"plots:   {', '.join(plots)}", file=sys.stderr)
    if interrupted:
        return EXIT_INTERRUPTED
    t = result.summary.get("tasks", {})
    return EXIT_FAILED_TASKS if t.get("error") or t.get("skipped") else EXIT_OK


# --------------------------------------------------------------------------------- report


def cmd_report(args: argparse.Namespace) -> int:
    try:
        results = [read_results(p) for p in args.results]
    except ResultsError as e:
        print(f"mars report: {e}", file=sys.stderr)
        return EXIT_USAGE
    names = args.names.split(",") if args.names else _names(args.results, results)
    if len(names) != len(results):
        print(f"mars report: --names gives {len(names)} names for {len(results)} results",
              file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({n: r.summary for n, r in zip(names, results)}, indent=1))
    else:
        print(format_report(results, names, slacks=args.slacks))
    if args.plot:
        from mars.workloads.plots import plot_latency_cdf

        plot_latency_cdf(results, args.plot, names)
        print(f"\nlatency CDF: {args.plot}", file=sys.stderr)
    return EXIT_OK


def _names(paths: list[str], results: list[RunResult]) -> list[str]:
    """Run labels, made unique with the run directory's name where they clash."""
    labels = [r.label for r in results]
    if len(set(labels)) == len(labels):
        return labels
    out = []
    for p, r in zip(paths, results):
        d = Path(p)
        d = d.parent if d.name == "results.json" else d
        out.append(f"{r.label} ({d.name})")
    return out


# ------------------------------------------------------------------------------- parsers


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """The options :func:`build_trace` reads besides REGIME / --trace (``mars replay``,
    ``mars sim run``)."""
    n = p.add_mutually_exclusive_group()
    n.add_argument("--num-tasks", type=_positive_int, metavar="N",
                   help="tasks to generate (default 20)")
    n.add_argument("--duration", type=_positive_float, metavar="S",
                   help="generate all arrivals within S seconds of nominal time")
    p.add_argument("--rate", type=_positive_float, metavar="R",
                   help="Poisson arrival rate, tasks/s of nominal time (default 0.2)")
    p.add_argument("--scale", type=_positive_float, default=1.0, metavar="F",
                   help="divide token counts by F (tiny models; default 1)")
    p.add_argument("--time-scale", type=_positive_float, default=1.0, metavar="T",
                   help="divide arrival times and tool durations by T (default 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="trace seed and content seed of the token ids (default 0)")
    p.add_argument("--context-limit", type=_positive_int, metavar="TOKENS",
                   help="generator's full-scale context limit (default: the regime's)")


def register(subparsers: argparse._SubParsersAction) -> None:
    rp = subparsers.add_parser(
        "replay",
        help="replay an agent trace against an OpenAI-compatible server and measure it",
        description=(
            "Replay agent tasks (a generated regime or --trace FILE) against URL: exact "
            "token-id prompts that extend round by round, forced output lengths, session "
            "metadata in vllm_xargs, tools run on host CPUs between rounds. Measures task "
            "latency, TTFT, cached tokens, tool queue wait and Dynamic SLO-aware goodput "
            "(ideal latencies from an isolated run, cached). Writes results.json, "
            "trace.jsonl, events.jsonl (if events are available) and plots to --out. "
            "See docs/replay.md."),
    )
    rp.add_argument("regime", nargs="?", metavar="REGIME",
                    help=f"generate a trace for this regime: {', '.join(REGIMES)}")
    rp.add_argument("--trace", metavar="FILE", help="replay this trace file instead")
    rp.add_argument("--url", required=True,
                    help="server base URL (the sidecar, mars-vllm serve or vllm serve), "
                         "e.g. http://127.0.0.1:8000")
    rp.add_argument("--model", help="served model name (default: the first /v1/models lists)")
    rp.add_argument("--api-key", default=None, metavar="KEY",
                    help="bearer key of a server started with --api-key (default: "
                         "$MARS_API_KEY; never $OPENAI_API_KEY, which would go to any --url)")
    rp.add_argument("--events-api-key", default=None, metavar="KEY",
                    help="key for posting tool events, if the server has a separate one "
                         "(default: $MARS_EVENTS_API_KEY, else --api-key)")
    add_trace_arguments(rp)
    rp.add_argument("--out", metavar="DIR", help="output directory (default runs/<label>-<time>)")
    rp.add_argument("--label", help="name of this run in reports (e.g. the policy)")
    rp.add_argument("--isolated", action="store_true",
                    help="only run the tasks one at a time (ideal latencies); also caches them")
    rp.add_argument("--ideal", default="auto", metavar="auto|skip|FILE",
                    help="ideal latencies for goodput: 'auto' = cache or measure an isolated "
                         "run first; 'skip' = no goodput; FILE = an ideal cache file, an "
                         "isolated run's results.json or {task_id: seconds} (default auto)")
    rp.add_argument("--ideal-tag", default="", metavar="TEXT",
                    help="extra text in the ideal cache key (e.g. the hardware)")
    add_ideal_cache(rp)
    rp.add_argument("--tool-cores", type=_cores, metavar="LIST",
                    help="cores the CPU-bound tools are pinned to, e.g. 2-3 (default: all "
                         "cores this process may use; pin the server elsewhere with taskset)")
    add_tool_workers(rp)
    rp.add_argument("--tool-burn", choices=BURN_MODES, default="cpu",
                    help="CPU-bound tools burn their duration as CPU time (cpu, default) or "
                         "wall time (wall), or sleep it holding a slot (sleep)")
    rp.add_argument("--virtual-tool-cores", type=_positive_int, metavar="N",
                    help="CPU-bound tools queue for N virtual cores and sleep their duration "
                         "on one (no CPU burnt; for an emulated GPU on a small machine). Give "
                         "the server the same N (mars-vllm serve --tool-cores N)")
    rp.add_argument("--token-range", type=_token_range, default=DEFAULT_TOKEN_RANGE,
                    metavar="LO:HI",
                    help="token ids used for prompt content, half-open (default 100:900, "
                         "valid for the embedded tiny model)")
    rp.add_argument("--salt", default="run",
                    help="content salt: change it to replay the same trace on a warm server "
                         "without prefix-cache hits from the previous run (default 'run')")
    rp.add_argument("--events-file", metavar="FILE",
                    help="the engine's events JSONL (mars-vllm serve --mars-events-file): "
                         "sliced into events.jsonl for KV plots and cached tokens")
    add_request_timeout(rp)
    add_slacks(rp)
    rp.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    rp.add_argument("--no-progress", action="store_true", help="no progress bar")
    rp.set_defaults(func=cmd_replay, takes_early_interrupt=True)

    rr = subparsers.add_parser(
        "report", help="compare replay results (markdown table)",
        description="Print a markdown table comparing replay runs (results.json files or "
                    "run directories): latency percentiles, TTFT, cached fraction, tool "
                    "queue wait, throughput and goodput.")
    rr.add_argument("results", nargs="+", metavar="RESULT")
    rr.add_argument("--names", help="comma-separated column names (default: run labels)")
    rr.add_argument("--plot", metavar="PNG", help="also draw the runs' latency CDFs into PNG")
    rr.add_argument("--json", action="store_true", help="print the runs' summaries as JSON")
    add_slacks(rr, "goodput slack factors to show")
    rr.set_defaults(func=cmd_report)
