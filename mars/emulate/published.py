"""Published end-to-end measurements the emulated GPU is checked against.

Four of them also set the measured step-time model's three values the operator timings cannot
(its step overhead, per-token cost and MXFP4 speed; :data:`TAKEN`,
``mars.engine.harness.serving_bench.fit``): those are marked and left out of the error summary.

Each point is a number someone measured with vLLM's own benchmark (``vllm bench serve`` or
``vllm bench throughput``) on a real H100 or H200, one GPU, with a stated set-up. The
emulation predicts it by running the same benchmark on vLLM's engine over the emulated GPU
(:mod:`mars.engine.harness.serving_bench`): ``mars emulate compare`` prints the table that
docs/emulation.md shows, once with the measured step-time model and once with the roofline it
replaced. Where a source leaves a detail open (ShareGPT's length distribution, the engine
version's defaults) the point says what was assumed.

Framework-free: the points and their workloads only; running them needs vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BenchWorkload:
    """One benchmark run: ``num_prompts`` requests of ``input_len`` prompt tokens and
    ``output_len`` generated ones; ``concurrency`` in flight at most (0: all sent at once)."""

    input_len: int
    output_len: int
    num_prompts: int
    concurrency: int = 0
    #: vLLM's --max-num-batched-tokens and --max-num-seqs (its defaults on an 80 GB+ card:
    #: 8192 for the API server, 16384 for the offline LLM class; 1024 sequences)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    max_model_len: int | None = None


#: metrics, as ``vllm bench`` names them, and their units
METRICS = {"mean_tpot_ms": "ms", "mean_ttft_ms": "ms", "median_itl_ms": "ms",
           "total_tok_s": "tok/s", "output_tok_s": "tok/s", "req_s": "req/s"}


@dataclass(frozen=True)
class Point:
    key: str
    model: str
    #: the emulated GPU: a measured profile, or a derived one (h100-nvl)
    gpu: str
    metric: str
    measured: float
    workload: BenchWorkload
    setup: str
    source: str
    #: prediction / measured - 1 when the table was last made, per step-time model
    #: ("measured", "roofline"); checked by the tests
    documented: dict[str, float] = field(default_factory=dict)

    @property
    def emulate(self) -> str:
        return f"{self.gpu}:{self.model}"

    @property
    def taken(self) -> bool:
        """Whether the measured model's overheads were taken from this point (not a check)."""
        return self.key in TAKEN


#: the points the measured model's step overhead, per-token cost and MXFP4 speed come from
TAKEN = frozenset({"qwen-h200-c1-tpot", "qwen-h100nvl-4096x8", "oss-h100-c4-tpot",
                   "oss-h100-sharegpt-itl"})

_Q, _O = "qwen3-coder-30b-a3b", "gpt-oss-120b"
_PR23151 = "vllm-project/vllm PR #23151 (benchmark output, untuned fused_moe configs)"
_EMMY = ("cloudrift-ai/emmy experiments/Qwen3-30B-A3B-Instruct-2507/serving/RESULTS.md "
         "(PR #822)")
_PR54742 = "vllm-project/vllm PR #54742 (results table, Triton MoE backend)"
_GPUSTACK = "gpustack/gpustack docs/performance-lab/gpt-oss-120b/h100.md (baseline)"

_Q_C10 = BenchWorkload(2048, 1024, 100, concurrency=10)
# the source ran 8 prompts one at a time; at concurrency 1 every prompt sees the same steps
_Q_C1 = BenchWorkload(4096, 4096, 2, concurrency=1, max_num_batched_tokens=4096)
_OFFLINE = {"max_num_batched_tokens": 16384}
# ShareGPT as the source's totals give it (215,312 in / 195,544 out over 1,000 prompts),
# every prompt at the mean lengths (the dataset's spread is not published with the run)
_O_SHAREGPT = BenchWorkload(215, 196, 1000, max_model_len=32768)
_O_C4 = BenchWorkload(229, 217, 100, concurrency=4, max_model_len=32768)

POINTS: tuple[Point, ...] = (
    Point("qwen-h100-c10-tpot", _Q, "h100", "mean_tpot_ms", 13.18, _Q_C10,
          "Qwen3-30B-A3B BF16, vLLM ~0.10.1, random 2048 in / 1024 out, 100 prompts, "
          "concurrency 10", _PR23151, {"measured": 0.134, "roofline": 0.068}),
    Point("qwen-h100-c10-out", _Q, "h100", "output_tok_s", 739.79, _Q_C10,
          "same run: output throughput", _PR23151, {"measured": -0.104, "roofline": -0.048}),
    Point("qwen-h100-c10-ttft", _Q, "h100", "mean_ttft_ms", 267.22, _Q_C10,
          "same run: mean TTFT (includes the API server)", _PR23151,
          {"measured": -0.373, "roofline": -0.477}),
    Point("qwen-h200-c1-tpot", _Q, "h200", "mean_tpot_ms", 4.62, _Q_C1,
          "Qwen3-30B-A3B-Instruct-2507 BF16, vLLM 0.17.0, random 4096 in / 4096 out, "
          "concurrency 1, --max-num-batched-tokens 4096", _EMMY,
          {"measured": 0.002, "roofline": -0.261}),
    Point("qwen-h200-c1-ttft", _Q, "h200", "mean_ttft_ms", 135.78, _Q_C1,
          "same runs: mean TTFT of a 4096-token prompt, mean of three seeds (127.7 / 142.1 / "
          "137.6 ms; includes the API server)", _EMMY, {"measured": -0.236, "roofline": -0.353}),
    Point("qwen-h100nvl-4096x8", _Q, "h100-nvl", "req_s", 9.16,
          BenchWorkload(4096, 8, 256, **_OFFLINE),
          "Qwen3-30B-A3B BF16, vLLM main (2026-09), `vllm bench throughput` 4096 in / 8 out, "
          "256 prompts (9.11, 9.21)", _PR54742, {"measured": -0.0, "roofline": 0.06}),
    Point("qwen-h100nvl-128x1024", _Q, "h100-nvl", "req_s", 6.35,
          BenchWorkload(128, 1024, 256, **_OFFLINE),
          "same, 128 in / 1024 out, 256 prompts", _PR54742, {"measured": 0.297, "roofline": 0.383}),
    Point("qwen-h100nvl-1024x128", _Q, "h100-nvl", "req_s", 15.14,
          BenchWorkload(1024, 128, 64, **_OFFLINE),
          "same, 1024 in / 128 out, 64 prompts", _PR54742, {"measured": -0.072, "roofline": -0.037}),
    Point("oss-h100-sharegpt-total", _O, "h100", "total_tok_s", 6095.37, _O_SHAREGPT,
          "gpt-oss-120b MXFP4, vLLM 0.10.2, --max-model-len 32768, ShareGPT 1000 prompts at "
          "once (taken at the mean lengths, 215 in / 196 out)", _GPUSTACK,
          {"measured": 1.415, "roofline": 2.068}),
    Point("oss-h100-sharegpt-tpot", _O, "h100", "mean_tpot_ms", 54.10, _O_SHAREGPT,
          "same run: mean TPOT", _GPUSTACK, {"measured": 0.418, "roofline": 0.109}),
    Point("oss-h100-sharegpt-itl", _O, "h100", "median_itl_ms", 37.98, _O_SHAREGPT,
          "same run: median ITL", _GPUSTACK, {"measured": 0.222, "roofline": -0.093}),
    Point("oss-h100-32k", _O, "h100", "total_tok_s", 16136.57,
          BenchWorkload(32000, 99, 100, max_model_len=32768),
          "same server, random 32000 in / 100 out (99 on average: no ignore-eos), 100 prompts "
          "at once: prefill-bound", _GPUSTACK, {"measured": 0.099, "roofline": 0.381}),
    Point("oss-h100-4k", _O, "h100", "total_tok_s", 14247.47,
          BenchWorkload(4000, 134, 500, max_model_len=32768),
          "same server, random 4000 in / 200 out (134 on average), 500 prompts at once",
          _GPUSTACK, {"measured": 0.359, "roofline": 0.657}),
    Point("oss-h100-2k", _O, "h100", "total_tok_s", 14385.69,
          BenchWorkload(2000, 98, 500, max_model_len=32768),
          "same server, random 2000 in / 100 out (98 on average), 500 prompts at once",
          _GPUSTACK, {"measured": 0.428, "roofline": 0.738}),
    Point("oss-h100-128", _O, "h100", "total_tok_s", 17059.15,
          BenchWorkload(128, 4, 1000, max_model_len=32768),
          "same server, random 128 in / 4 out, 1000 prompts at once", _GPUSTACK,
          {"measured": 0.524, "roofline": 0.782}),
    Point("oss-h100-c4-tpot", _O, "h100", "mean_tpot_ms", 8.31, _O_C4,
          "same server, ShareGPT 100 prompts at concurrency 4 (taken at the mean lengths, "
          "229 in / 217 out)", _GPUSTACK, {"measured": -0.222, "roofline": -0.375}),
    Point("oss-h100-c4-ttft", _O, "h100", "mean_ttft_ms", 49.00, _O_C4,
          "same run: mean TTFT (includes the API server)", _GPUSTACK,
          {"measured": 0.035, "roofline": -0.36}),
)
