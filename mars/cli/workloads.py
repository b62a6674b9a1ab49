"""``mars workloads generate|stats|validate|import``: the trace tools on the command line.

``mars/cli/__init__.py`` calls :func:`register` on its subparsers; every leaf command sets ``func`` to
a handler taking the parsed namespace and returning an exit code (0 ok, 1 bad trace or
arguments). ``python3 -m mars.cli.workloads ...`` runs the same commands standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pathlib import Path

from mars.workloads.generator import REGIMES, generate, get_regime
from mars.workloads.importer import CONDENSED_MODES, import_file
from mars.workloads.importers import FORMATS as IMPORT_FORMATS
from mars.workloads.plots import plot_regimes
from mars.workloads.stats import by_family, format_groups, format_stats, group_stats, trace_stats
from mars.workloads.trace import Trace, TraceError, read_trace, write_trace
from mars.cli.types import positive_float as _positive_float
from mars.cli.types import positive_int as _positive_int


def _regime_help() -> str:
    return "; ".join(
        f"{r.name}: mean prompt volume {r.target_mean_volume / 1000:g}K, context {r.context_limit}"
        for r in REGIMES.values()
    )


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        trace = generate(
            args.regime,
            num_tasks=args.num_tasks,
            duration_s=args.duration,
            rate=args.rate,
            seed=args.seed,
            scale=args.scale,
            time_scale=args.time_scale,
            context_limit=args.context_limit,
        )
    except ValueError as e:
        print(f"mars workloads generate: {e}", file=sys.stderr)
        return 1
    write_trace(trace, args.output)
    p = trace.header.params
    print(
        f"wrote {args.output}: {trace.header.regime}, {len(trace)} tasks, "
        f"{sum(t.num_rounds for t in trace)} rounds, mean prompt volume "
        f"{p['sample_mean_prompt_volume']:,.0f} at full scale (target {p['target_mean_prompt_volume']:,.0f}, "
        f"theta {p['theta']:.3f}), scale {args.scale:g}, time scale {args.time_scale:g}"
    )
    return 0


def _load_sources(args: argparse.Namespace) -> list[Trace]:
    """Each source is a trace file or a regime name (generated with --num-tasks / --seed)."""
    traces = []
    for src in args.sources:
        if Path(src).exists():
            traces.append(read_trace(src))
            continue
        try:
            get_regime(src)
        except ValueError:
            raise TraceError(f"{src}: no such file, and not a regime ({', '.join(REGIMES)})") \
                from None
        traces.append(generate(src, num_tasks=args.num_tasks, seed=args.seed))
    return traces


def _step_time(args: argparse.Namespace):
    if args.no_ideal:
        return None
    from mars.emulate.measured import step_model_for
    from mars.emulate.specs import get_gpu, get_model

    return step_model_for(get_model(args.model), get_gpu(args.gpu))


def cmd_stats(args: argparse.Namespace) -> int:
    try:
        traces = _load_sources(args)
        stm = _step_time(args)
    except (TraceError, ValueError) as e:
        print(f"mars workloads stats: {e}", file=sys.stderr)
        return 1
    labels = [t.header.regime if not Path(src).exists() else src
              for src, t in zip(args.sources, traces)]
    regimes = [group_stats(lab, t.tasks, stm) for lab, t in zip(labels, traces)]
    families = {lab: by_family(t, stm) for lab, t in zip(labels, traces)}
    if args.json:
        out = [{"source": lab, "regime": r.to_dict(),
                "families": [f.to_dict() for f in families[lab]]}
               for lab, r in zip(labels, regimes)]
        if len(traces) == 1:
            out[0]["trace"] = trace_stats(traces[0]).to_dict()
        print(json.dumps(out if len(out) > 1 else out[0], indent=2))
    else:
        if len(traces) == 1:
            print(format_stats(trace_stats(traces[0])))
            print()
        note = "" if stm is None else (
            f"  (ideal: estimated isolated completion time on an EMULATED {args.gpu} with "
            f"{args.model}, step-time model; not a measurement)")
        print(format_groups(regimes, "regime") + ("\n" + note if note else ""))
        for lab in labels:
            print()
            print(format_groups(families[lab], f"{lab} by family"))
    if args.plot:
        ideal = None
        if stm is not None:
            from mars.workloads.ideal import estimate_isolated_s

            ideal = {lab: [estimate_isolated_s(x, stm) for x in t.tasks]
                     for lab, t in zip(labels, traces)}
        path = plot_regimes({lab: t.tasks for lab, t in zip(labels, traces)}, args.plot, ideal,
                            f" (emulated {args.gpu})")
        print(f"plot: {path}" if path else "plot: matplotlib is not installed", file=sys.stderr)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    try:
        trace = read_trace(args.file)
    except TraceError as e:
        print(f"invalid trace: {e}", file=sys.stderr)
        return 1
    print(
        f"ok: {args.file}: {trace.header.regime}, {len(trace)} tasks, "
        f"{sum(t.num_rounds for t in trace)} rounds (schema version {trace.header.version})"
    )
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    try:
        res = import_file(
            args.input,
            args.format,
            prefix_tokens=args.prefix_tokens,
            template_tokens=args.template_tokens,
            condensed="clamp" if args.clamp else args.condensed,
            rate=args.rate,
            seed=args.seed,
            regime=args.regime,
        )
    except (TraceError, ValueError) as e:
        print(f"cannot import: {e}", file=sys.stderr)
        return 1
    write_trace(res.trace, args.output)
    notes = []
    if res.clamped:
        notes.append(f"{res.clamped} shrinking transitions clamped")
    if res.split:
        notes.append(f"{res.split} condensations split into new tasks")
    if res.untooled:
        notes.append(f"{res.untooled} non-final calls without a tool (tool 'unknown')")
    if res.dropped_final_tools:
        notes.append(f"{res.dropped_final_tools} tools after a last call dropped")
    arr = "from start_s" if res.used_timestamps else f"Poisson at {args.rate}/s, seed {args.seed}"
    print(
        f"wrote {args.output}: {res.sessions} tasks from {res.calls} calls, arrivals {arr}"
        + (f"; {'; '.join(notes)}" if notes else "")
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``workloads`` command group to a parent parser's subparsers."""
    wl = subparsers.add_parser(
        "workloads",
        help="generate, inspect, validate and import agent traces",
        description="Agent workload traces (versioned JSONL; schema in docs/workloads.md).",
    )
    sub = wl.add_subparsers(dest="workloads_command", metavar="COMMAND", required=True)

    g = sub.add_parser(
        "generate",
        help="generate a seeded synthetic trace for a regime",
        description=(
            "Generate a seeded OpenHands-style agent trace. Tasks are drawn from a 20k-task pool "
            "tilted so the mean prompt volume per task hits the regime's target; arrivals are "
            "Poisson. Regimes: " + _regime_help() + ". S-ILR targets are our choice (the paper "
            "gives none)."
        ),
    )
    g.add_argument("regime", metavar="REGIME", help=f"one of {', '.join(REGIMES)} (case-insensitive)")
    g.add_argument("-o", "--output", required=True, metavar="FILE", help="trace file to write")
    n = g.add_mutually_exclusive_group(required=True)
    n.add_argument("--num-tasks", type=_positive_int, metavar="N", help="number of tasks")
    n.add_argument(
        "--duration", type=_positive_float, metavar="S",
        help="all arrivals within S seconds of nominal (uncompressed) time",
    )
    g.add_argument("--rate", type=_positive_float, default=0.2, metavar="R",
                   help="Poisson arrival rate, tasks/s of nominal time (default 0.2)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument(
        "--scale", type=_positive_float, default=1.0, metavar="F",
        help="divide every token count by F for small models (rounds, tools and times are kept; default 1)",
    )
    g.add_argument(
        "--time-scale", type=_positive_float, default=1.0, metavar="T",
        help="divide tool durations and arrival times by T (effective rate R*T; default 1)",
    )
    g.add_argument(
        "--context-limit", type=_positive_int, default=None, metavar="TOKENS",
        help="full-scale context limit tasks are cut at (default: the regime's, 262144 or 131072)",
    )
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser(
        "stats", help="summary statistics of traces or regimes, per regime and per family",
        description=(
            "Summary statistics of trace files or generated regimes, side by side: tasks, "
            "rounds, per-call prompt (mean / P50 / P90 / max), prompt volume per task, output "
            "per round, tool time per task, the share of calls above 32K and 128K tokens and "
            "the estimated isolated completion time (step-time model of an emulated GPU); "
            "then the same per task family. One file also gets the full report. "
            "Example: mars workloads stats ILR-1 ILR-2 ILR-3 ILR-4 --plot fig6.png"))
    s.add_argument("sources", nargs="+", metavar="FILE|REGIME",
                   help=f"trace files or regime names ({', '.join(REGIMES)})")
    s.add_argument("--num-tasks", type=_positive_int, default=2000, metavar="N",
                   help="tasks per generated regime (default 2000)")
    s.add_argument("--seed", type=int, default=0, help="seed of generated regimes (default 0)")
    s.add_argument("--gpu", default="h100", help="emulated GPU of the ideal estimate "
                                                "(default h100; `mars emulate profiles`)")
    s.add_argument("--model", default="qwen3-coder-30b-a3b",
                   help="emulated model of the ideal estimate (default qwen3-coder-30b-a3b)")
    s.add_argument("--no-ideal", action="store_true", help="skip the ideal estimate")
    s.add_argument("--plot", metavar="PNG", help="write the per-regime distributions (the "
                                                 "shape of the paper's Figure 6) to PNG")
    s.add_argument("--json", action="store_true", help="machine-readable JSON output")
    s.set_defaults(func=cmd_stats)

    v = sub.add_parser("validate", help="check a trace file against the schema",
                       description="Check a trace file; on error print FILE:LINE: problem and exit 1.")
    v.add_argument("file", metavar="FILE")
    v.set_defaults(func=cmd_validate)

    i = sub.add_parser(
        "import",
        help="convert recorded agent logs (our JSONL, OpenAI request logs, SWE-agent .traj, "
             "OpenHands session logs) into a trace",
        description=(
            "Convert agent logs into a trace: a recording (JSONL, one LLM call per line: "
            "session_id, prompt_tokens, output_tokens, optional call_index, tool, "
            "tool_duration_s, observation_tokens, start_s), an OpenAI-style request log "
            "(JSONL: messages + response/usage per call), SWE-agent .traj files, or the "
            "session logs of `mars openhands run --out DIR`. Token counts come from the logs' "
            "usage fields, else from an estimate (UTF-8 bytes / 4). See docs/workloads.md §3."
        ),
    )
    i.add_argument("input", metavar="IN", help="log file or directory")
    i.add_argument("--format", default="auto", choices=("auto", *IMPORT_FORMATS),
                   help="input format (default: detected from the file)")
    i.add_argument("--condensed", default="error", choices=CONDENSED_MODES,
                   help="a context that shrank (condensed history): error (default), clamp "
                        "(growth 0), or split (a new task from the condensation on)")
    i.add_argument("-o", "--output", required=True, metavar="OUT", help="trace file to write")
    i.add_argument("--prefix-tokens", type=int, default=0, metavar="N",
                   help="tokens of each first prompt that are the shared prefix (default 0: unknown)")
    i.add_argument("--template-tokens", type=int, default=10, metavar="N",
                   help="template share of each prompt growth when observation_tokens is absent (default 10)")
    i.add_argument("--clamp", action="store_true",
                   help="same as --condensed clamp")
    i.add_argument("--rate", type=_positive_float, default=0.2, metavar="R",
                   help="Poisson rate for arrivals when the recording has no start_s (default 0.2)")
    i.add_argument("--seed", type=int, default=0, help="seed for those arrivals (default 0)")
    i.add_argument("--regime", default="imported", help="label written in the header (default 'imported')")
    i.set_defaults(func=cmd_import)
    return wl


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry: ``python3 -m mars.cli.workloads workloads generate ...`` or without
    the leading ``workloads``."""
    parser = argparse.ArgumentParser(prog="mars")
    register(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] != "workloads" and argv[0] not in ("-h", "--help"):
        argv = ["workloads", *argv]
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
