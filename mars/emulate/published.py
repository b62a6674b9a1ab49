"""Published measurements the step-time model is checked against (never fitted to).

Each point is a number someone measured on a real GPU with a stated set-up; :func:`predict`
computes the same quantity from the step-time model. ``python -m mars.emulate.published``
prints the comparison table that docs/emulation.md shows. The set-ups are approximated where
the source leaves a detail open (say, the mean context during a ShareGPT decode); each point
says how.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from mars.emulate.specs import get_gpu, get_model
from mars.emulate.step_time import StepCoefficients, StepTimeModel


@dataclass(frozen=True, slots=True)
class Point:
    key: str
    model: str
    gpu: str
    #: "tpot_ms" (one decode step of ``batch`` requests at ``context``), "ttft_ms" (prefill
    #: of ``prompt`` tokens alone in ``chunk``-token steps) or "prefill_tok_s"
    metric: str
    measured: float
    setup: str
    source: str
    batch: int = 1
    context: int = 0
    prompt: int = 0
    chunk: int = 8192
    #: prediction / measured - 1 when the table was last made (checked by the tests)
    documented_error: float = 0.0


POINTS: tuple[Point, ...] = (
    Point("qwen-h100-c10-tpot", "qwen3-coder-30b-a3b", "h100", "tpot_ms", 13.18,
          "Qwen3-30B-A3B BF16, vLLM, 2048 in / 1024 out, concurrency 10 (mean context ~2.5K)",
          "vllm-project/vllm PR #23151 (benchmark output, untuned MoE configs)",
          batch=10, context=2560, documented_error=0.051),
    Point("qwen-h200-c1-tpot", "qwen3-coder-30b-a3b", "h200", "tpot_ms", 4.62,
          "Qwen3-30B-A3B-Instruct-2507 BF16, vLLM 0.17.0, 4096 in / 4096 out, concurrency 1 "
          "(mean context ~6K)", "cloudrift-ai/emmy PR #822", batch=1, context=6144,
          documented_error=-0.261),
    Point("qwen-h200-c1-ttft", "qwen3-coder-30b-a3b", "h200", "ttft_ms", 135.0,
          "same run, TTFT 128-142 ms for a 4096-token prompt (includes HTTP, tokenization "
          "and the first decode's sampling)", "cloudrift-ai/emmy PR #822",
          prompt=4096, documented_error=-0.349),
    Point("oss-h100-c4-tpot", "gpt-oss-120b", "h100", "tpot_ms", 8.31,
          "gpt-oss-120b MXFP4, vLLM 0.10.2, ShareGPT, concurrency 4 (mean context ~600)",
          "gpustack/gpustack docs/performance-lab/gpt-oss-120b/h100.md",
          batch=4, context=600, documented_error=-0.374),
    Point("oss-h100-32k-prefill", "gpt-oss-120b", "h100", "prefill_tok_s", 16137.0,
          "same set-up, 32000 in / 100 out, 100 requests at once: total tokens/s, essentially "
          "prefill throughput (8192-token steps)",
          "gpustack/gpustack docs/performance-lab/gpt-oss-120b/h100.md",
          prompt=32000, documented_error=0.473),
    Point("oss-h100-b256-itl", "gpt-oss-120b", "h100", "tpot_ms", 38.0,
          "same set-up, ShareGPT, 1000 requests at once: median ITL (batch ~256 decoding, "
          "mean context ~500)", "gpustack/gpustack docs/performance-lab/gpt-oss-120b/h100.md",
          batch=256, context=500, documented_error=-0.245),
)


def predict(p: Point, coefficients: StepCoefficients | None = None) -> float:
    """The model's value of ``p``'s metric, with the shipped coefficients or ``coefficients``
    (a fit to operator timings, :mod:`mars.emulate.op_fit`)."""
    m = StepTimeModel(get_model(p.model), get_gpu(p.gpu), coefficients)
    if p.metric == "tpot_ms":
        return m.decode_step(p.batch, p.context) * 1e3
    if p.metric == "ttft_ms":
        return m.prefill_time(p.prompt, p.chunk) * 1e3
    if p.metric == "prefill_tok_s":
        return p.prompt / m.prefill_time(p.prompt, p.chunk)
    raise ValueError(f"unknown metric {p.metric!r}")


def table() -> str:
    rows = ["| point | set-up | measured | predicted | error | source |",
            "|---|---|---:|---:|---:|---|"]
    for p in POINTS:
        pred = predict(p)
        unit = {"tpot_ms": " ms", "ttft_ms": " ms", "prefill_tok_s": " tok/s"}[p.metric]
        rows.append(f"| `{p.key}` ({p.gpu}) | {p.setup} | {p.measured:g}{unit} | "
                    f"{pred:.1f}{unit} | {pred / p.measured - 1:+.1%} | {p.source} |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover
    print(table())
    for p in POINTS:
        print(p.key, round(predict(p) / p.measured - 1, 3), file=sys.stderr)
