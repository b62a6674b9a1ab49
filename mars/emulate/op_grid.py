"""What the operator-timing harness times and what it writes: the model (a shipped one or a
Hugging Face ``config.json``), the operators (one term of the step-time model each, for one
layer), the grids of shapes (``quick`` for a CPU and the tests, the default, and ``dense``,
which the shipped tables were measured on), and one record per timed point (:class:`OpTiming`,
the ``mars-op-timings/1`` format). Read by the harness (:mod:`mars.emulate.op_timing`, which
needs PyTorch) and by what reads its files (:mod:`mars.emulate.op_fit`,
:mod:`mars.emulate.op_tables`), which do not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from mars.emulate.specs import ModelSpec, get_model, model_from_hf_config

FORMAT = "mars-op-timings/1"
#: operand copies are rotated until they exceed the last-level cache this many times
CACHE_MULTIPLE = 4
MAX_COPIES = 64
#: where the last-level cache is taken to be when the device does not report it (bytes)
DEFAULT_CACHE = 32 * 2**20
#: expanded K/V (where the backend has no grouped-query path) beyond this is not timed
#: (bytes)
MAX_EXPANDED_KV_BYTES = 24 * 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


#: the operators timed, each one term of the step-time model for one layer
OPS = ("projections", "moe", "attention", "logits")
#: a whole decoder layer's forward (norms, rotary, attention, routing, experts, residuals):
#: the check that the operators sum to the layer, not an input of any fit
LAYER = "layer"
#: FlashAttention-3 against FlashAttention-2, forward, BF16, H100 SXM5: 1.5-2.0x
#: (Shah et al., "FlashAttention-3", 2024, Fig. 5; up to 740 TFLOP/s). vLLM runs FA3 on
#: Hopper, PyTorch's kernels are FA2-class: the gap is recorded beside the timings, not
#: applied to them (docs/emulation.md)
FA3_SPEEDUP = (1.5, 2.0)


@dataclass(frozen=True, slots=True)
class OpTiming:
    """One timed operator of one layer: what ran and how long it took."""

    op: str
    seconds: float
    tokens: int = 0
    requests: int = 0
    new: int = 0
    context: int = 0
    #: K/V read with their own heads (False: expanded to the query heads before the kernel)
    gqa: bool = True
    #: timed as a CUDA graph replay (False: eager launches, or not CUDA)
    graph: bool = False
    #: attention: which kernel was fastest and kept ("flash", "cudnn", "efficient",
    #: "split" = flash over the cache plus the causal chunk, merged; "" elsewhere)
    kernel: str = ""

    def batch(self) -> list[tuple[int, int]]:
        """The step-time model's batch for this operator."""
        if self.op in ("projections", "moe"):
            return [(self.tokens, 0)]
        if self.op in ("attention", LAYER):
            return [(self.new, self.context)] * self.requests
        return [(1, 0)] * self.requests  # logits: one last token per request


@dataclass(frozen=True)
class OpGrid:
    """The points timed. The default spans what the paper's set-ups run: single decodes to
    256-request batches, 1K to 128K-token contexts, and vLLM's 8K-token prefill chunks."""

    #: tokens per step for the projections and the experts
    tokens: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 2048, 4096, 6144, 8192, 12288)
    #: decode batches and the context each request attends to
    decode_batches: tuple[int, ...] = (1, 8, 32, 128, 256)
    contexts: tuple[int, ...] = (1024, 8192, 32768, 131072)
    #: prefill chunks, over no cached context and over each of ``contexts``
    prefill_chunks: tuple[int, ...] = (512, 2048, 8192)
    #: requests whose last token goes through the LM head
    logits_requests: tuple[int, ...] = (1, 16, 64, 256)
    #: the most KV tokens one attention point may hold (per layer), to bound memory
    max_kv_tokens: int = 4_200_000
    warmup: int = 3
    repeats: int = 10
    #: the square GEMM and the copy that measure the device's own peaks
    peak_gemm: int = 8192
    peak_copy_bytes: int = 2 * 2**30
    #: at most this many copies of an operand to rotate over (``CACHE_MULTIPLE`` times the
    #: cache sets how many are wanted)
    max_copies: int = MAX_COPIES

    #: whole-layer timings ``(requests, new, context)``: decodes and prefill chunks
    layers: tuple[tuple[int, int, int], ...] = ((1, 1, 4096), (32, 1, 4096), (256, 1, 4096),
                                               (1, 2048, 0), (1, 8192, 0), (1, 2048, 16384))

    @classmethod
    def quick(cls) -> OpGrid:
        """A small grid for a CPU and the tests (seconds on a small model)."""
        return cls(tokens=(1, 8, 64), decode_batches=(1, 4), contexts=(256, 1024),
                   prefill_chunks=(64,), logits_requests=(1, 8), max_kv_tokens=65536,
                   warmup=1, repeats=3, peak_gemm=512, peak_copy_bytes=32 * 2**20,
                   layers=((1, 1, 256), (4, 1, 256), (1, 64, 0), (1, 64, 256)),
                   # a small model's operands are a fraction of a CPU's 32 MiB cache, so
                   # defeating it took 64 copies a point, every call timed 64 times x 3
                   # passes: 2 of every 3 seconds of the quick run (PyTorch's grouped GEMM
                   # on a CPU is a slow fallback). What the quick grid is for -- every
                   # operator and the fit's path exercised -- needs no cold caches
                   max_copies=2)

    @classmethod
    def dense(cls) -> OpGrid:
        """The grid the shipped tables were measured on (``shared/gpu-timings``, 189 points
        per model, under a minute per model on an H100): what the measured step-time model
        interpolates."""
        return cls(tokens=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                           1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384),
                   decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                   contexts=(512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
                   prefill_chunks=(256, 512, 1024, 2048, 4096, 8192),
                   logits_requests=(1, 4, 16, 64, 128, 256))

    def attention_points(self, max_len: int) -> list[tuple[int, int, int]]:
        """``(requests, new, context)`` for every decode and prefill point that fits."""
        pts: list[tuple[int, int, int]] = []

        def add(p: tuple[int, int, int]) -> None:
            if p not in pts:
                pts.append(p)

        # a context past the model's limit is taken at the limit (gpt-oss: 131072 positions)
        for c in self.contexts:
            for b in self.decode_batches:
                cc = min(c, max_len - 1)
                if b * (cc + 1) <= self.max_kv_tokens:
                    add((b, 1, cc))
        for n in self.prefill_chunks:
            for c in (0, *self.contexts):
                cc = max(0, min(c, max_len - n))
                if cc + n <= min(max_len, self.max_kv_tokens):
                    add((1, n, cc))
        return pts


def largest_operands(model: ModelSpec, grid: OpGrid, dtype_bytes: int,
                     cache_bytes: int = DEFAULT_CACHE) -> int:
    """Bytes of the largest set of operands one point of ``grid`` holds at once (with its
    rotated copies): what the device's memory must hold, with room to spare."""
    def with_copies(b: float) -> float:
        return b * max(1, min(MAX_COPIES, math.ceil(CACHE_MULTIPLE * cache_bytes / b)))

    el = dtype_bytes
    sizes = [with_copies(model.attn_params * el), with_copies(model.hidden * model.vocab * el)]
    if model.num_experts:
        sizes.append(with_copies(model.num_experts * model.expert_params * el))
    for b, n, c in grid.attention_points(model.max_model_len):
        sizes.append(with_copies(2 * b * (c + n) * model.num_kv_heads * model.head_dim * el))
    return int(max(sizes))


def load_model(spec: str) -> ModelSpec:
    """A shipped model name, or the path of a Hugging Face ``config.json``."""
    p = Path(spec)
    if spec.endswith(".json") or p.is_file():
        try:
            cfg = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read model config {spec}: {exc}") from None
        return model_from_hf_config(p.stem, cfg)
    return get_model(spec)
