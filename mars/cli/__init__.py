"""The ``mars`` command: every subcommand's module sits in this folder, above the libraries
it drives (``sidecar``, ``bench``, ``sim``, ``replay``, ``workloads``, ``emulate``, ``demo``,
``openhands``, ``top``, ``dashboard``; shared argument types and options in
:mod:`mars.cli.types`); this file only wires them. Nothing below a command imports one
(``tests/test_layering.py``); the libraries take typed configurations. (The GPU timing
harness, ``mars.emulate.op_timing``, keeps a parser of its own: it runs alone as ``python -m``
on a GPU machine without vLLM.)

Imports are lazy so that ``mars --help`` and the light subcommands stay fast and so that the
command works in environments that lack vLLM (the agent environment) for what does not need it.
"""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_model_tiny(args: argparse.Namespace) -> int:
    from mars.model.tiny import TinyModelSpec, write_tiny_model

    out = write_tiny_model(args.dir, TinyModelSpec(seed=args.seed))
    print(out)
    return 0


def _format_event(ev: dict) -> str:
    head = f"{ev.get('ts', 0):.3f} {ev.get('kind', '?'):<14} {ev.get('session_id') or '-':<16}"
    rest = {k: v for k, v in ev.items() if k not in ("v", "ts", "kind", "session_id")}
    return head + " " + json.dumps(rest, separators=(",", ":"))


def _cmd_events_tail(args: argparse.Namespace) -> int:
    from mars.stream.subscriber import follow_jsonl, subscribe

    if args.file:
        stream = follow_jsonl(args.file, from_start=not args.new_only, idle_timeout_s=args.timeout)
    else:
        endpoint = args.endpoint
        if endpoint is None:
            import tempfile

            endpoint = f"ipc://{tempfile.gettempdir()}/mars-engine-{args.port}.ipc"
        stream = subscribe(endpoint, timeout_s=args.timeout)
    kinds = set(args.kind or [])
    try:
        for ev in stream:
            if kinds and ev.get("kind") not in kinds:
                continue
            if args.session and ev.get("session_id") != args.session:
                continue
            print(json.dumps(ev) if args.json else _format_event(ev), flush=True)
    except KeyboardInterrupt:
        pass
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mars",
        description="mars: agent-aware LLM serving on vLLM. The server itself is "
                    "`mars-vllm serve [MODEL]`; this command holds the tools around it.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = sub.add_parser("model", help="make the embedded tiny model")
    msub = model.add_subparsers(dest="model_cmd", required=True)
    tiny = msub.add_parser("tiny", help="write the tiny Qwen2-architecture model to DIR")
    tiny.add_argument("dir", help="output directory (created)")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    tiny.set_defaults(func=_cmd_model_tiny)

    events = sub.add_parser("events", help="the unified event stream")
    esub = events.add_subparsers(dest="events_cmd", required=True)
    tail = esub.add_parser("tail", help="print events as they arrive",
                           description="Follow the engine's event stream (ZMQ) or an events "
                                       "JSONL file written by the engine or the sidecar.")
    src = tail.add_mutually_exclusive_group()
    src.add_argument("--endpoint", help="ZMQ endpoint of the engine publisher")
    src.add_argument("--file", help="follow this JSONL file instead")
    tail.add_argument("--port", type=int, default=8000,
                      help="serving port, to derive the default endpoint (default: %(default)s)")
    tail.add_argument("--kind", action="append", help="only these kinds (repeatable)")
    tail.add_argument("--session", help="only this session id")
    tail.add_argument("--json", action="store_true", help="print raw JSON lines")
    tail.add_argument("--new-only", action="store_true", help="with --file: skip existing lines")
    tail.add_argument("--timeout", type=float, default=None,
                      help="stop after this many seconds without an event")
    tail.set_defaults(func=_cmd_events_tail)

    _register_optional(sub)
    return p


def _register_optional(sub) -> None:
    """Each command module registers its own subcommands; one missing from this build (the
    agent environment lacks vLLM's) is left out."""
    import importlib

    for mod in ("mars.cli.workloads", "mars.cli.replay", "mars.cli.sidecar",
                "mars.cli.bench", "mars.cli.demo", "mars.cli.openhands", "mars.cli.emulate",
                "mars.cli.sim", "mars.cli.top", "mars.cli.dashboard"):
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name and mod.startswith(exc.name):
                continue  # component not present in this build
            raise
        module.register(sub)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["openhands"]:
        # every option after it is the agent runner's own (it runs in .venv-agents)
        from mars.cli.openhands import forward

        return forward(argv[1:])
    from mars.cli.interrupt import EarlyInterrupt

    try:
        with EarlyInterrupt() as early:
            parser = build_parser()  # imports every command's module: most of start-up
            args = parser.parse_args(argv)
            if getattr(args, "takes_early_interrupt", False):
                args.early_interrupt = early  # the command stops gracefully on it
            else:
                early.release()
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # a Ctrl-C no command caught (one that came before the command could take it, say):
        # one line and the shell's status for SIGINT, not a traceback
        print("mars: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
