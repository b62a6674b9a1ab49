"""``mars emulate``: the emulated GPU's step-time model from the command line.

    mars emulate profiles                     # every GPU x model: weights, KV, example steps
    mars emulate step --gpu h100 --model qwen3-coder-30b-a3b --decode 64 --context 8000
    mars emulate step --gpu h200 --model gpt-oss-120b --prefill 8192 --context 32000
    mars emulate compare                      # predictions vs published measurements
    mars emulate calibrate --out runs/cpu-profile.json   # fit the model to this machine's engine
    mars emulate time-ops --model qwen3-coder-30b-a3b --out ops.json   # on a GPU with PyTorch
    mars emulate fit-ops ops.json --gpu h100  # fit a GPU profile's efficiencies to those timings

Every number printed is an emulated GPU's (docs/emulation.md says where each coefficient
comes from and how far the model is from published measurements).
"""

from __future__ import annotations

import argparse
import sys

from mars.emulate.specs import GPUS, MODELS, GpuSpec, get_gpu, get_model
from mars.emulate.measured import step_model_for
from mars.emulate.step_time import StepTimeModel

_LABEL = "(emulated GPU: step-time model, docs/emulation.md)"


def _cmd_profiles(args: argparse.Namespace) -> int:
    print(f"Profiles {_LABEL}\n")
    print("| GPU | model | step-time model | weights GiB | KV per token | KV capacity (tokens) "
          "| decode step 1 / 16 / 64 at 8K ctx (ms) | 32K prefill in 8K chunks (s) |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    for g in GPUS.values():
        for m in MODELS.values():
            s = step_model_for(m, g)
            dec = " / ".join(f"{s.decode_step(b, 8000) * 1e3:.1f}" for b in (1, 16, 64))
            print(f"| {g.name} | {m.name} | {s.kind} | {m.weight_memory_bytes / 2**30:.1f} | "
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
    s = step_model_for(model, gpu, kind=args.step_model)
    b = s.breakdown(batch)
    print(f"{model.name} on {gpu.name} {_LABEL}; {s.kind}")
    print(f"batch: {args.decode} decodes at {args.context} tokens of context"
          + (f" + a {args.prefill}-token prefill chunk" if args.prefill else ""))
    for name in ("projections", "mlp", "attention", "logits", "overhead"):
        print(f"  {name:<12} {getattr(b, name) * 1e3:9.3f} ms")
    print(f"  {'step':<12} {b.total * 1e3:9.3f} ms")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    import sys

    from mars.emulate.published import POINTS

    if args.run:
        from mars.engine.harness.serving_bench import compare, table

        preds = compare(progress=lambda m: print(f"running {m}", file=sys.stderr, flush=True))
    else:  # the documented predictions, as the tests hold them
        preds = {p.key: {sm: p.measured * (1 + e) for sm, e in p.documented.items()}
                 for p in POINTS}
        from mars.engine.harness.serving_bench import table
    print(f"Predictions vs published measurements {_LABEL}"
          + ("" if args.run else " (as documented; --run re-runs them, minutes)") + "\n")
    print(table(preds))
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import shlex
    import time
    from pathlib import Path

    out = Path(args.out)
    if out.suffix != ".json":
        raise SystemExit("mars emulate calibrate: --out must name a .json file")
    try:
        extra = shlex.split(args.engine_args or "")
    except ValueError as exc:
        raise SystemExit(f"mars emulate calibrate: --engine-args: {exc}") from None
    if any(a.split("=")[0] == "--emulate" for a in extra):
        raise SystemExit("mars emulate calibrate: measures the real engine; --emulate is not "
                         "an engine argument here")
    t0 = time.monotonic()
    try:
        measured = _measure(extra, args.quick)
        prof, fit = _fit_profile(measured, args)
    except (ValueError, RuntimeError) as exc:
        raise SystemExit(f"mars emulate calibrate: {exc}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.write(out)
    _print_calibration(prof, fit, measured, out, time.monotonic() - t0)
    if not args.no_plot:
        try:
            _plot_fit(prof.fit["points"], out.with_suffix(".png"), prof.name)
            print(f"\nplot: {out.with_suffix('.png')}")
        except ImportError as exc:
            print(f"mars emulate calibrate: plot skipped: {exc}", file=sys.stderr)
    return 0


def _measure(extra: list[str], quick: bool) -> dict:
    """Run the real engine over the grid: its steps, settings, config and the peaks."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from mars.engine.harness.calibration import (DISTURBED_RATIO, CalibrationGrid,
                                               MeasuredEngine, measure_peaks, run_grid)

    print("mars emulate calibrate: starting the real engine on this machine (mars-vllm serve "
          f"{' '.join(extra) or '(defaults)'})", file=sys.stderr, flush=True)
    engine = MeasuredEngine(extra)
    try:
        settings = engine.settings()
        cfg = engine.model_config()
        peaks = measure_peaks(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))

        def progress(i: int, n: int) -> None:
            print(f"\r  measuring: {i}/{n} workloads", end="", file=sys.stderr, flush=True)

        grid = run_grid(engine, CalibrationGrid.quick() if quick else CalibrationGrid(),
                        progress)
        print(file=sys.stderr)
        if grid.disturbed:
            print(f"mars emulate calibrate: {grid.disturbed} of {grid.workloads} workloads ran "
                  f"> {DISTURBED_RATIO:g}x slower in one pass than in another (noise, or "
                  "something else using the CPU); the faster pass is kept", file=sys.stderr, flush=True)
        return {"steps": grid.steps, "settings": settings, "config": cfg, "peaks": peaks,
                "served": engine.served_model_name, "extra": extra, "quick": quick,
                "workloads": grid.workloads, "disturbed": grid.disturbed}
    finally:
        engine.close()


def _fit_profile(m: dict, args: argparse.Namespace):
    """The fitted device profile of a measurement, with every step beside its prediction."""
    from mars.emulate.fit import fit_coefficients, relative_errors
    from mars.emulate.profile import DeviceProfile, EngineSettings
    from mars.emulate.specs import model_from_hf_config
    from mars.engine.harness.calibration import host_facts, last_level_cache_bytes, memory_gib

    name = args.name or f"{m['served']}@{args.device_name}"
    model = model_from_hf_config(name, m["config"])
    peaks = m["peaks"]
    measured_gpu = GpuSpec(args.device_name, bf16_tflops=round(peaks["tflops"], 4),
                           fp8_tflops=round(peaks["tflops"], 4),
                           hbm_tb_s=round(peaks["tb_s"], 5), memory_gib=round(memory_gib(), 1))
    steps = m["steps"]
    fit = fit_coefficients(model, measured_gpu, steps, cache_hint_bytes=last_level_cache_bytes())
    errs = relative_errors(model, fit.gpu, fit.coefficients, steps)
    stm = StepTimeModel(model, fit.gpu, fit.coefficients)
    points = []
    for s, e in zip(steps, errs):
        w = stm.work(s.batch)
        points.append([s.kind, w.tokens, w.requests, w.full_pairs, w.full_kv,
                       round(s.seconds, 7), round(s.seconds * (1 + e), 7)])
    fit_info = {**fit.as_dict(), "grid": "quick" if m["quick"] else "default",
                "workloads": m.get("workloads"), "disturbed_workloads": m.get("disturbed"),
                "point_fields": ["kind", "tokens", "requests", "attention_pairs", "kv_tokens",
                                 "measured_s", "predicted_s"], "points": points}
    prof = DeviceProfile(name=name, gpu=fit.gpu, model_config=m["config"],
                         coefficients=fit.coefficients, engine=EngineSettings(**m["settings"]),
                         fit=fit_info,
                         host={**host_facts(), "peaks": peaks, "engine_args": m["extra"]},
                         served_model_name=m["served"])
    return prof, fit


def _print_calibration(prof, fit, m: dict, out, seconds: float) -> None:
    gpu, model, settings, peaks = prof.gpu, prof.model, prof.engine, m["peaks"]
    e = fit.errors
    print(f"Device profile {out} ({fit.samples} measured steps, {seconds:.0f} s)\n")
    print(f"device  {gpu.name}: {peaks['tflops'] * 1e3:.1f} GFLOP/s matmul, "
          f"{peaks['tb_s'] * 1e3:.1f} GB/s copy measured ({peaks['torch_threads']} torch "
          f"thread(s)); peaks in the profile {gpu.bf16_tflops * 1e3:.1f} GFLOP/s, "
          f"{gpu.hbm_tb_s * 1e3:.1f} GB/s")
    print(f"model   {model.name}: {model.num_layers} layers, hidden {model.hidden}, "
          f"{model.num_heads}/{model.num_kv_heads} heads x {model.head_dim}")
    print(f"engine  block {settings.block_size}, {settings.max_num_batched_tokens} tokens/step, "
          f"{settings.max_num_seqs} seqs, KV pool {settings.kv_cache_bytes / 2**30:.2f} GiB\n")
    print("| fitted coefficient | value |\n|---|---:|")
    for k in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
        print(f"| {k} | {getattr(fit.coefficients, k):.4g} |")
    for k in ("step_overhead_s", "request_overhead_s"):
        print(f"| {k} | {getattr(fit.coefficients, k) * 1e6:.1f} us |")
    for k in ("attention_parallelism", "attention_query_tile", "attention_occupancy_exponent"):
        print(f"| {k} | {getattr(fit.coefficients, k):.4g} |")
    print(f"| cache_bytes | {fit.coefficients.cache_bytes / 2**20:.1f} MiB |")
    print(f"| cache_bandwidth_ratio | {fit.coefficients.cache_bandwidth_ratio:.3g} |")
    print("\n| steps | n | mean abs error |\n|---|---:|---:|")
    kinds = [s.kind for s in m["steps"]]
    for kind in ("prefill", "decode", "mixed"):
        if f"mean_{kind}" in e:
            print(f"| {kind} | {kinds.count(kind)} | {e[f'mean_{kind}'] * 100:.1f} % |")
    print(f"| all | {fit.samples} | {e['mean'] * 100:.1f} % (median {e['median'] * 100:.1f} %,"
          f" P90 {e['p90'] * 100:.1f} %, max {e['max'] * 100:.1f} %) |")


def _cmd_time_ops(args: argparse.Namespace) -> int:
    from mars.emulate import op_timing

    return op_timing.main(args)


def _measured_gpu(timings) -> GpuSpec:
    """The timed device as its own peaks say (for a device with no shipped profile)."""
    pk, dev = timings.peaks, timings.device
    if not (pk.get("gemm_flops", 0) > 0 and pk.get("copy_bytes_per_s", 0) > 0):
        raise ValueError("the timings hold no measured peaks; name a shipped --gpu")
    tflops = pk["gemm_flops"] / 1e12
    return GpuSpec(f"measured:{dev.get('name', 'device')}", tflops, 2 * tflops,
                   pk["copy_bytes_per_s"] / 1e12, float(dev.get("memory_bytes", 0)) / 2**30)


def gpu_for_device(name: str) -> str | None:
    """The shipped GPU profile of a device PyTorch names (``NVIDIA H100 80GB HBM3``,
    ``NVIDIA H200``, ``NVIDIA H100 NVL``...), or None."""
    n = name.lower()
    for chip in ("h200", "h100"):
        if chip in n:
            return f"{chip}-nvl" if "nvl" in n else chip
    return None


def _cmd_fit_ops(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from mars.emulate.op_fit import OPS, OpTimings, fit_op_efficiencies

    try:
        timings = OpTimings.load(args.timings)
        dev = timings.device
        seen = gpu_for_device(str(dev.get("name", "")))
        name = args.gpu or seen
        if name is None:
            raise ValueError(f"the timed device ({dev.get('name', '?')}) has no shipped "
                             "profile: name one with --gpu (or --gpu measured)")
        if args.gpu and seen and args.gpu != seen:
            print(f"warning: the timings are from {dev.get('name')} ({seen}), fitted "
                  f"against --gpu {args.gpu}'s peaks", file=sys.stderr)
        gpu = _measured_gpu(timings) if name == "measured" else get_gpu(name)
        fit = fit_op_efficiencies(timings, gpu)
    except ValueError as exc:
        raise SystemExit(f"mars emulate fit-ops: {exc}") from None
    if not timings.complete:
        print("warning: the timing run was cut short; fitting what it timed",
              file=sys.stderr)
    for sk in timings.skipped:
        print(f"skipped attention point {sk}", file=sys.stderr)
    print(f"{timings.model.name}: {fit.samples} operator timings on {dev.get('name', '?')} "
          f"(torch {dev.get('torch', '?')}, MoE as {timings.moe_impl or '?'}), "
          f"efficiencies relative to {gpu.name} ({gpu.bf16_tflops:g} TFLOP/s, "
          f"{gpu.hbm_tb_s:g} TB/s)")
    pk = timings.peaks
    if pk:
        print(f"device peaks measured: {pk.get('gemm_flops', 0) / 1e12:.3g} TFLOP/s GEMM "
              f"({pk.get('gemm_flops', 0) / gpu.flops:.0%} of spec), "
              f"{pk.get('copy_bytes_per_s', 0) / 1e12:.3g} TB/s copy "
              f"({pk.get('copy_bytes_per_s', 0) / gpu.bandwidth:.0%} of spec)")
    print("\n| coefficient | shipped | fitted |\n|---|---:|---:|")
    for k in fit.fitted:
        print(f"| `{k}` | {getattr(fit.base, k):.3g} | {getattr(fit.coefficients, k):.3g} |")
    for k in fit.kept:
        print(f"| `{k}` | {getattr(fit.base, k):.3g} | kept (no timing binds it) |")
    print("\n| operator | timings | mean error, shipped | mean error, fitted | max, fitted |")
    print("|---|---:|---:|---:|---:|")
    for op in OPS:
        if op in fit.errors:
            n = sum(1 for r in timings.records if r.op == op)
            print(f"| {op} | {n} | {fit.errors_before[op]['mean']:.1%} | "
                  f"{fit.errors[op]['mean']:.1%} | {fit.errors[op]['max']:.1%} |")
    print("\n(the four-efficiency roofline; the shipped H100 / H200 profiles interpolate the "
          "timings instead: docs/emulation.md, *The measured model*)")
    cfg = json.dumps(fit.emulate_config(), separators=(",", ":"))
    if name != "measured" and timings.model.name in MODELS:
        print(f"\nserve with it: mars-vllm serve --emulate {gpu.name}:{timings.model.name} "
              f"--emulate-config '{cfg}'")
    else:
        print(f"\nfitted coefficients (--emulate-config): {cfg}")
    if args.out:
        out = Path(args.out)
        out.write_text(json.dumps(fit.as_dict(timings), indent=1) + "\n")
        print(f"fit -> {out}")
    return 0


def _plot_fit(points: list, path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for kind, marker in (("prefill", "o"), ("decode", "."), ("mixed", "x")):
        xs = [p[5] * 1e3 for p in points if p[0] == kind]
        ys = [p[6] * 1e3 for p in points if p[0] == kind]
        if xs:
            ax.scatter(xs, ys, marker=marker, label=kind, alpha=0.7)
    lo = min(min(p[5], p[6]) for p in points) * 1e3
    hi = max(max(p[5], p[6]) for p in points) * 1e3
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("step-time model (ms)")
    ax.set_title(f"{name}: fitted step-time model vs the real engine")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    step.add_argument("--step-model", choices=("measured", "roofline"), default="measured",
                      help="the operator tables measured on the GPU where it has them "
                           "(default), or the roofline")
    step.set_defaults(func=_cmd_step)
    cmp_ = esub.add_parser(
        "compare", help="predictions vs published measurements",
        description="Each published vLLM benchmark point (docs/emulation.md) against the "
                    "emulation's prediction, by the measured step-time model and by the "
                    "roofline it replaced. The emulation runs the same benchmark on vLLM's "
                    "engine over the emulated GPU, in virtual time.")
    cmp_.add_argument("--run", action="store_true",
                      help="run the benchmarks again (a few minutes) instead of printing the "
                           "documented predictions")
    cmp_.set_defaults(func=_cmd_compare)
    cal = esub.add_parser(
        "calibrate", help="fit the step-time model to the real engine on this machine",
        description="Measure the real engine of `mars-vllm serve` (the embedded model unless "
                    "--engine-args names another) on this machine over a grid of batches "
                    "(prefill chunks, decode batches at several contexts, mixed steps), fit "
                    "the step-time model's coefficients to the measured steps, and write a "
                    "device profile: `mars-vllm serve --emulate FILE` and `mars sim run "
                    "--profile FILE` then emulate this machine (docs/emulation.md). "
                    "Run it on an otherwise idle machine: a minute or two.")
    cal.add_argument("--out", required=True, metavar="FILE.json", help="profile to write")
    cal.add_argument("--engine-args", default="", metavar="ARGS",
                     help="more `mars-vllm serve` arguments for the measured engine, one string")
    cal.add_argument("--name", default=None, help="profile name (default: SERVED_NAME@cpu)")
    cal.add_argument("--device-name", default="cpu", help="device name (default: cpu)")
    cal.add_argument("--quick", action="store_true",
                     help="a small grid (about 2 minutes on 2 CPU cores; a rough fit, for a "
                          "first look and tests)")
    cal.add_argument("--no-plot", action="store_true",
                     help="no plot of measured vs predicted step times")
    cal.set_defaults(func=_cmd_calibrate)
    from mars.emulate.op_timing import add_arguments

    tops = esub.add_parser(
        "time-ops", help="time one layer's operators of a model's real shapes (PyTorch)",
        description="Time the operators the step-time model prices (projections, experts, "
                    "attention, LM head) at a model's real shapes on this device with "
                    "PyTorch, for `mars emulate fit-ops`. Meant for a GPU (minutes on an "
                    "H100; `python3 -m mars.emulate.op_timing` runs the same where only "
                    "PyTorch is installed); --device cpu --quick on a small config.json "
                    "runs in seconds.")
    add_arguments(tops)
    tops.set_defaults(func=_cmd_time_ops)
    fops = esub.add_parser(
        "fit-ops", help="fit a GPU profile's efficiencies to operator timings",
        description="Fit the step-time model's GEMM, MoE, attention and memory efficiencies "
                    "to timings from `mars emulate time-ops`, print the error per operator "
                    "with the shipped and the fitted coefficients (and against the "
                    "published measurements of the same GPU and model), and the "
                    "--emulate-config that serves with the fit (docs/emulation.md).")
    fops.add_argument("timings", metavar="TIMINGS.json")
    fops.add_argument("--gpu", default=None,
                      help=f"the profile whose peaks the efficiencies are relative to: "
                           f"{', '.join(GPUS)}, or 'measured' (the timed device's own "
                           f"peaks); default: the one the timed device's name matches")
    fops.add_argument("--out", default=None, metavar="FILE.json", help="write the fit here")
    fops.set_defaults(func=_cmd_fit_ops)
