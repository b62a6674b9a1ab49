"""A serving benchmark (``vllm bench serve`` / ``vllm bench throughput``) on the emulated GPU.

Published end-to-end numbers come from runs of vLLM's own benchmarks: N prompts of fixed
input and output lengths, sent all at once or with at most C in flight, then mean TTFT, mean
TPOT, median ITL and token throughput. To predict such a number the emulation runs the same
benchmark: vLLM's own ``EngineCore`` (its scheduler, chunked prefill, KV cache manager and
preemption) on the emulated GPU, in virtual time (:class:`~mars.engine.harness.sim_engine.
SimEngine`), with random prompts (no prefix-cache hits, as the benchmarks' random datasets).

What it leaves out, and says so in every comparison: the API server's own time (HTTP,
tokenisation, detokenisation) and any client-side delay; the engine steps are all that is
timed. The metrics follow vLLM's benchmark definitions (``vllm/benchmarks/serve.py``): TPOT
per request = (latency - TTFT) / (output - 1), averaged over requests; ITL = every gap between
a request's successive outputs, pooled.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mars.emulate.published import METRICS, POINTS, BenchWorkload, Point


@dataclass(frozen=True)
class BenchResult:
    mean_ttft_ms: float
    mean_tpot_ms: float
    median_itl_ms: float
    duration_s: float
    total_tok_s: float
    output_tok_s: float
    req_s: float
    preemptions: int

    def metric(self, name: str) -> float:
        return float(getattr(self, name))


def run_bench(emulate: str, w: BenchWorkload, *, step_model: str = "measured",
              seed: int = 0) -> BenchResult:
    """Run ``w`` on the emulated ``GPU:MODEL`` with vLLM's FCFS scheduler (the benchmarks
    ran stock vLLM) and the ``step_model`` (``measured`` or ``roofline``)."""
    from mars.emulate.pacing import VirtualClock
    from mars.engine.harness.sim_engine import SimEngine

    extra = ["--max-num-batched-tokens", str(w.max_num_batched_tokens),
             "--max-num-seqs", str(w.max_num_seqs),
             "--emulate-config", json.dumps({"step_model": step_model})]
    if w.max_model_len:
        extra += ["--max-model-len", str(w.max_model_len)]
    clock = VirtualClock()
    eng = SimEngine(emulate, "fcfs", clock=clock, sink=lambda _e: None, extra_args=extra)
    try:
        return _drive(eng, clock, w, random.Random(seed))
    finally:
        eng.close()


def _drive(eng, clock, w: BenchWorkload, rng: random.Random) -> BenchResult:
    start = clock()
    sent: dict[str, float] = {}
    stamps: dict[str, list[float]] = {}
    pending = list(range(w.num_prompts))
    limit = w.concurrency or w.num_prompts
    in_flight = 0

    def send() -> None:
        nonlocal in_flight
        while pending and in_flight < limit:
            i = pending.pop(0)
            rid = f"bench-{i}"
            eng.add(rid, [rng.randrange(1, eng.token_hi) for _ in range(w.input_len)],
                    w.output_len)
            sent[rid], stamps[rid] = clock(), []
            in_flight += 1

    send()
    while eng.has_work:
        outs = eng.step()
        now = clock()
        for o in outs:
            if o.new_token_ids:
                stamps[o.request_id].extend([now] * len(o.new_token_ids))
            if o.finished:
                in_flight -= 1
        send()
    end = clock()
    ttft, tpot, itl = [], [], []
    for rid, ts in stamps.items():
        if not ts:
            continue
        ttft.append(ts[0] - sent[rid])
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
            itl.extend(b - a for a, b in zip(ts, ts[1:]) if b > a)
    dur = end - start
    out_tokens = sum(len(ts) for ts in stamps.values())
    return BenchResult(
        mean_ttft_ms=statistics.fmean(ttft) * 1e3 if ttft else 0.0,
        mean_tpot_ms=statistics.fmean(tpot) * 1e3 if tpot else 0.0,
        median_itl_ms=statistics.median(itl) * 1e3 if itl else 0.0,
        duration_s=dur, total_tok_s=(w.input_len * w.num_prompts + out_tokens) / dur,
        output_tok_s=out_tokens / dur, req_s=w.num_prompts / dur,
        preemptions=int(eng.counters().get("preempted", 0)))


STEP_MODELS = ("measured", "roofline")


def compare(points: Sequence[Point] = POINTS, step_models: Sequence[str] = STEP_MODELS,
            progress: Callable[[str], None] | None = None) -> dict[str, dict[str, float]]:
    """``{point key: {step model: predicted value}}``, each distinct workload run once per
    step-time model."""
    runs: dict[tuple[str, BenchWorkload, str], BenchResult] = {}
    out: dict[str, dict[str, float]] = {}
    for p in points:
        for sm in step_models:
            k = (p.emulate, p.workload, sm)
            if k not in runs:
                if progress:
                    progress(f"{p.emulate} {sm}: {p.workload}")
                runs[k] = run_bench(p.emulate, p.workload, step_model=sm)
            out.setdefault(p.key, {})[sm] = runs[k].metric(p.metric)
    return out


def table(preds: dict[str, dict[str, float]], points: Sequence[Point] = POINTS) -> str:
    rows = ["| point | GPU | set-up | measured | roofline (before) | error | measured tables "
            "| error | source |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for p in points:
        unit = METRICS[p.metric]
        got = preds[p.key]
        cells = []
        for sm in ("roofline", "measured"):
            v = got.get(sm)
            cells.append("–" if v is None else f"{v:,.4g} {unit}")
            cells.append("–" if v is None else f"{v / p.measured - 1:+.1%}")
        derived = " (derived)" if p.gpu.endswith("-nvl") else ""
        key = f"`{p.key}`" + (" *(taken)*" if p.taken else "")
        rows.append(f"| {key} | {p.gpu}{derived} | {p.setup} | {p.measured:,.4g} {unit} | "
                    + " | ".join(cells) + f" | {p.source} |")
    errs = {sm: sorted(abs(preds[p.key][sm] / p.measured - 1) for p in points
                       if sm in preds[p.key] and not p.taken) for sm in STEP_MODELS}
    rows.append("")
    for sm, e in errs.items():
        if e:
            rows.append(f"{sm}: over the {len(e)} points not taken: median |error| "
                        f"{statistics.median(e):.1%}, worst {e[-1]:.1%}, "
                        f"{sum(x > 0.30 for x in e)} over 30 %")
    return "\n".join(rows)


def _point(key: str) -> Point:
    return next(p for p in POINTS if p.key == key)


def _bisect(f, lo: float, hi: float, target: float, rising: bool, steps: int = 14) -> float:
    """x in [lo, hi] with f(x) = target, for f monotone in x (rising or falling)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        if (f(mid) < target) == rising:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def fit(progress: Callable[[str], None] = lambda _m: None):
    """The measured model's overheads and MXFP4 bandwidth share, each taken from one
    published point (:data:`mars.emulate.measured.OVERHEADS`): the step overhead makes
    ``qwen-h200-c1-tpot`` exact (a decode step at batch 1 is the operators plus it), the
    per-token cost ``qwen-h100nvl-4096x8`` (an offline prefill-bound run: no API server in
    the number), the MXFP4 share ``oss-h100-c4-tpot`` and ``oss-h100-sharegpt-itl`` (gpt-oss
    decodes at 4 and about 256 requests)."""
    from mars.emulate import measured as ms

    def value(key: str, o, x) -> float:
        p = _point(key)
        with ms.taken_from(o, x):
            return run_bench(p.emulate, p.workload).metric(p.metric)

    x = ms.Mxfp4Kernel(1.0)
    o = ms.Overheads()
    p = _point("qwen-h200-c1-tpot")
    base = value(p.key, o, x)
    o = ms.Overheads(step_s=max(0.0, (p.measured - base) / 1e3))
    progress(f"step_s = {o.step_s * 1e6:.1f} us ({p.key}: {base:.3f} ms with none)")
    p = _point("qwen-h100nvl-4096x8")
    tl = _bisect(lambda v: value(p.key, ms.Overheads(o.step_s, token_layer_s=v), x),
                 0.0, 2e-6, p.measured, rising=False)
    o = ms.Overheads(o.step_s, token_layer_s=tl)
    progress(f"token_layer_s = {tl * 1e9:.1f} ns")
    # gpt-oss's two decode points disagree with any one share (small batches want about
    # half, 256-request batches nearly all of the BF16 kernel's rate): the share closest to
    # both in log-error, on a 0.1 grid
    import math

    pts = (_point("oss-h100-c4-tpot"), _point("oss-h100-sharegpt-itl"))

    def miss(v: float) -> float:
        return sum(math.log(value(p.key, o, ms.Mxfp4Kernel(v)) / p.measured) ** 2
                   for p in pts)

    share = min((0.5, 0.6, 0.7, 0.8, 0.9, 1.0), key=miss)
    progress(f"mxfp4 relative_speed = {share:.3f}")
    return o, ms.Mxfp4Kernel(share)


if __name__ == "__main__":  # pragma: no cover
    if "--fit" in sys.argv:
        print(fit(progress=lambda m: print(m, flush=True)))
        sys.exit(0)
    got = compare(progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(got))
    print({k: {sm: round(v / next(p for p in POINTS if p.key == k).measured - 1, 3)
               for sm, v in d.items()} for k, d in got.items()}, file=sys.stderr)
