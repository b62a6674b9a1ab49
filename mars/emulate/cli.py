"""``mars emulate``: the emulated GPU's step-time model from the command line.

    mars emulate profiles                     # every GPU x model: weights, KV, example steps
    mars emulate step --gpu h100 --model qwen3-coder-30b-a3b --decode 64 --context 8000
    mars emulate step --gpu h200 --model gpt-oss-120b --prefill 8192 --context 32000
    mars emulate compare                      # predictions vs published measurements

Every number printed is an emulated GPU's (docs/emulation.md says where each coefficient
comes from and how far the model is from published measurements).
"""

from __future__ import annotations

import argparse

from mars.emulate.specs import GPUS, MODELS, get_gpu, get_model
from mars.emulate.step_time import StepTimeModel

_LABEL = "(emulated GPU: step-time model, docs/emulation.md)"


def _cmd_profiles(args: argparse.Namespace) -> int:
    print(f"Profiles {_LABEL}\n")
    print("| GPU | model | weights GiB | KV per token | KV capacity (tokens) | decode step "
          "1 / 16 / 64 at 8K ctx (ms) | 32K prefill in 8K chunks (s) |")
    print("|---|---|---:|---:|---:|---|---:|")
    for g in GPUS.values():
        for m in MODELS.values():
            s = StepTimeModel(m, g)
            dec = " / ".join(f"{s.decode_step(b, 8000) * 1e3:.1f}" for b in (1, 16, 64))
            print(f"| {g.name} | {m.name} | {m.weight_memory_bytes / 2**30:.1f} | "
                  f"{m.kv_bytes_per_token() / 1024:.0f} KiB | "
                  f"{s.kv_capacity_tokens(args.gpu_memory_utilization):,} | {dec} | "
                  f"{s.prefill_time(32_000, 8192):.2f} |")
    return 0


def _cmd_step(args: argparse.Namespace) -> int:
    try:
        model, gpu = get_model(args.model), get_gpu(args.gpu)
    except ValueError as exc:
        raise SystemExit(f"mars emulate step: {exc}") from None
    if args.kv_fp8:
        model = model.with_kv_bytes(1)
    batch = [(1, args.context)] * args.decode
    if args.prefill:
        batch.append((args.prefill, args.context))
    if not batch:
        raise SystemExit("mars emulate step: give --decode N and/or --prefill TOKENS")
    s = StepTimeModel(model, gpu)
    b = s.breakdown(batch)
    print(f"{model.name} on {gpu.name} {_LABEL}")
    print(f"batch: {args.decode} decodes at {args.context} tokens of context"
          + (f" + a {args.prefill}-token prefill chunk" if args.prefill else ""))
    for name in ("projections", "mlp", "attention", "logits", "overhead"):
        print(f"  {name:<12} {getattr(b, name) * 1e3:9.3f} ms")
    print(f"  {'step':<12} {b.total * 1e3:9.3f} ms")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from mars.emulate.published import table

    print(f"Predictions vs published measurements {_LABEL}\n")
    print(table())
    return 0


def register(sub) -> None:
    p = sub.add_parser("emulate", help="the emulated GPU's step-time model",
                       description=__doc__.split("\n\n")[0])
    esub = p.add_subparsers(dest="emulate_cmd", required=True, metavar="COMMAND")
    prof = esub.add_parser("profiles", help="every shipped GPU x model profile")
    prof.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="share of the card's memory vLLM may use (default: %(default)s)")
    prof.set_defaults(func=_cmd_profiles)
    step = esub.add_parser("step", help="the time of one step for a batch you describe")
    step.add_argument("--gpu", required=True, help=f"one of: {', '.join(GPUS)}")
    step.add_argument("--model", required=True, help=f"one of: {', '.join(MODELS)}")
    step.add_argument("--decode", type=int, default=0, metavar="N",
                      help="decoding requests in the step")
    step.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                      help="one prefill chunk of this many tokens")
    step.add_argument("--context", type=int, default=0, metavar="TOKENS",
                      help="tokens already cached for each request")
    step.add_argument("--kv-fp8", action="store_true", help="fp8 KV cache")
    step.set_defaults(func=_cmd_step)
    cmp_ = esub.add_parser("compare", help="predictions vs published measurements")
    cmp_.set_defaults(func=_cmd_compare)
