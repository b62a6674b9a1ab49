"""The time of one engine step on an emulated GPU, from the batch it runs.

A step runs, for every scheduled request, ``new`` tokens (a prefill chunk, or 1 for a decode)
that attend to ``context`` tokens already in the KV cache. Its time is a roofline per
component -- each takes the longer of its compute at an efficiency-derated peak and its memory
traffic at a derated bandwidth -- plus fixed overheads::

    per layer:
      projections  max(2 T P_attn / (F e_gemm),            P_attn b_w / (B e_mem))
      MLP (dense)  max(2 T P_mlp / (F e_gemm),             P_mlp b_w / (B e_mem))
      MLP (MoE)    max(2 T k P_exp / (F e_moe),            E_t P_exp b_e / (B e_mem))
                   E_t = E (1 - (1 - k/E)^T)       experts touched by T tokens (uniform routing)
      attention    max(sum 4 n_i a_i H d / (F e_attn),     sum (c_i + n_i) kv_layer / (B e_mem))
                   a_i = c_i + (n_i + 1) / 2 (causal), both capped at the window on sliding layers
    logits         max(2 R V h / (F e_gemm),               V h b_w / (B e_mem))
    overheads      step + layers * per_layer + R * per_request

Attention is divided by its occupancy ``min(1, Q / P) ** g`` when ``P > 0``: the kernel runs
at its full rate only when the batch gives it at least ``P`` query tiles of ``q`` tokens
(``Q = sum ceil(n_i / q)``); a lone decode, or a short chunk over a long context, leaves the
device's parallel units idle. Off (``P = 0``) in the shipped GPU profiles, where split-KV
decoding keeps small batches memory-bound; fitted by ``mars emulate calibrate``, where the
measured engine shows it (docs/emulation.md). KV reads run ``r`` times faster for the part of
the step's KV that fits a last-level cache of ``S`` bytes (it stays cached between steps);
off (``S = 0``) in the GPU profiles, fitted on a CPU, where it decides decode times.

with ``T`` the step's tokens, ``R`` its requests, ``F`` / ``B`` the GPU's dense BF16 peak and HBM
bandwidth. What each coefficient is and where its value comes from: docs/emulation.md (every
default cites a spec sheet, a published measurement or another simulator's published fitted
coefficient). The expected-experts term is inference-sim's ``nEff`` (``sim/latency/
roofline.go``); the overheads are its fitted H100 vLLM coefficients.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mars.emulate.specs import ACTIVATION_RESERVE_GIB, GpuSpec, ModelSpec, kv_budget_bytes


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One scheduled request: ``new`` tokens computed this step over ``context`` cached ones."""

    new: int
    context: int


@dataclass(frozen=True, slots=True)
class StepCoefficients:
    """Efficiency factors and fixed overheads (defaults and sources: docs/emulation.md)."""

    #: achieved fraction of dense BF16 peak in the dense projections and the logits GEMM
    gemm_efficiency: float = 0.6
    #: achieved fraction of peak in the MoE experts' grouped GEMMs (many small GEMMs: lower)
    moe_efficiency: float = 0.25
    #: achieved fraction of peak in attention (FlashAttention over the context)
    attention_efficiency: float = 0.5
    #: achieved fraction of peak HBM bandwidth
    memory_efficiency: float = 0.8
    #: fixed cost per step, per layer and per request (seconds)
    step_overhead_s: float = 126e-6
    layer_overhead_s: float = 32.1e-6
    request_overhead_s: float = 4.42e-6
    #: attention occupancy: query tiles the device needs to run attention at full rate
    #: (0: always full), the tile (tokens), and how time grows below it (exponent)
    attention_parallelism: float = 0.0
    attention_query_tile: int = 16
    attention_occupancy_exponent: float = 1.0
    #: KV that stays in the device's last-level cache between steps (bytes; 0: none) and how
    #: much faster it is read from there than from memory
    cache_bytes: float = 0.0
    cache_bandwidth_ratio: float = 1.0

    def __post_init__(self) -> None:
        effs = (self.gemm_efficiency, self.moe_efficiency, self.attention_efficiency,
                self.memory_efficiency)
        if not all(0 < e <= 1 for e in effs):
            raise ValueError("efficiency factors must lie in (0, 1]")
        if not all(math.isfinite(v) for v in (*effs, self.step_overhead_s, self.layer_overhead_s,
                                               self.request_overhead_s,
                                               self.attention_parallelism,
                                               self.attention_occupancy_exponent)):
            raise ValueError("coefficients must be finite numbers")
        if min(self.step_overhead_s, self.layer_overhead_s, self.request_overhead_s) < 0:
            raise ValueError("overheads must be >= 0")
        if not isinstance(self.attention_query_tile, int) or \
                isinstance(self.attention_query_tile, bool):
            raise ValueError("attention_query_tile must be an integer")
        if self.attention_parallelism < 0 or self.attention_query_tile < 1 \
                or not 0 <= self.attention_occupancy_exponent <= 4:
            raise ValueError("attention occupancy: parallelism >= 0, query tile >= 1, "
                             "exponent in [0, 4]")
        if not (math.isfinite(self.cache_bytes) and math.isfinite(self.cache_bandwidth_ratio)
                and self.cache_bytes >= 0 and self.cache_bandwidth_ratio >= 1):
            raise ValueError("cache: bytes >= 0 and bandwidth ratio >= 1 (finite)")


@dataclass(frozen=True, slots=True)
class StepWork:
    """One step's batch as the model sees it: tokens, requests, and the (query, key) pairs
    and KV tokens read by full-attention and sliding-window layers."""

    tokens: int
    requests: int
    full_pairs: float
    full_kv: float
    slide_pairs: float = 0.0
    slide_kv: float = 0.0
    #: query tiles (sum of ceil(new / tile)): the attention kernel's parallel work
    query_tiles: int = 0

    @classmethod
    def stack(cls, works: "Sequence[StepWork]") -> "StepWork":
        """Many steps as one of NumPy arrays, for :meth:`StepTimeModel.time_of` to price all
        at once. Every step must have tokens (an empty step costs nothing and has no place
        in a fit)."""
        import numpy as np

        if not works or any(w.tokens <= 0 for w in works):
            raise ValueError("stack needs steps that each compute tokens")
        return cls(*(np.array([getattr(w, f) for w in works], dtype=float)
                     for f in cls.__dataclass_fields__))


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    """Seconds per component (for docs, tests and the emulator's events)."""

    projections: float
    mlp: float
    attention: float
    logits: float
    overhead: float

    @property
    def total(self) -> float:
        return self.projections + self.mlp + self.attention + self.logits + self.overhead


def _array_minmax():
    """Element-wise max and min, for steps stacked in arrays (NumPy imported only then)."""
    import numpy as np

    return np.maximum, np.minimum


class StepTimer(ABC):
    """The time of one engine step from its batch: what the emulated executor, the
    simulator, the ideal latencies and the published-point checks ask of a step-time model.

    Two implementations: :class:`StepTimeModel`, the roofline with efficiency factors (any GPU
    from its spec sheet; fitted to a CPU engine by ``mars emulate calibrate``), and
    :class:`mars.emulate.measured.MeasuredStepModel`, operator timings measured on the GPU
    and interpolated (the shipped H100 and H200 profiles, docs/emulation.md)."""

    model: ModelSpec
    gpu: GpuSpec

    @abstractmethod
    def breakdown(self, batch) -> StepBreakdown:
        """Seconds per component for one step over ``batch`` ((new, context) pairs or
        :class:`BatchEntry`)."""

    #: what the model is, for logs and reports ("roofline", "measured h100 ...")
    kind: str = "roofline"

    def step_time(self, batch: Iterable[BatchEntry] | Iterable[tuple[int, int]]) -> float:
        """Seconds for one step over ``batch`` ((new, context) pairs or BatchEntry)."""
        return self.breakdown(batch).total

    def prefill_time(self, prompt: int, chunk: int | None = None) -> float:
        """Time to prefill ``prompt`` tokens alone, in chunks of ``chunk`` (None: one step)."""
        chunk = chunk or prompt
        done, t = 0, 0.0
        while done < prompt:
            n = min(chunk, prompt - done)
            t += self.step_time([(n, done)])
            done += n
        return t

    def decode_step(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` requests, each over ``context`` tokens."""
        return self.step_time([(1, context)] * batch)

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9,
                           reserve_gib: float = ACTIVATION_RESERVE_GIB) -> int:
        """Context tokens the KV cache holds (full-attention layers), as vLLM sizes the pool
        (:func:`~mars.emulate.specs.kv_budget_bytes`); 0 when the weights do not fit."""
        try:
            free = kv_budget_bytes(self.model, self.gpu, gpu_memory_utilization, reserve_gib)
        except ValueError:
            return 0
        per = self.model.kv_bytes_per_token()
        return math.floor(free / per) if per > 0 else 0


class StepTimeModel(StepTimer):
    """The roofline: each component at the longer of its compute and its memory traffic,
    at efficiency-derated peaks, plus fixed overheads (the module docstring)."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec,
                 coefficients: StepCoefficients | None = None) -> None:
        self.model, self.gpu = model, gpu
        self.coef = c = coefficients or StepCoefficients()
        m = model
        F, B = gpu.flops, gpu.bandwidth
        self._f_gemm = F * c.gemm_efficiency
        self._f_moe = F * c.moe_efficiency
        self._f_attn = F * c.attention_efficiency
        self._bw = B * c.memory_efficiency
        # per-layer constants
        self._attn_w = m.attn_params * m.weight_bytes
        self._mlp_dense_w = (m.dense_mlp_params + m.router_params) * m.weight_bytes
        self._expert_w = m.expert_params * m.expert_weight_bytes
        self._kv_layer = m.kv_bytes_per_token_layer()
        self._attn_flop = 4 * m.num_heads * m.head_dim  # per (query token, key token) pair
        self._logits_w = m.vocab * m.hidden * m.weight_bytes
        self._window = m.sliding_window or 0
        self._fixed = c.step_overhead_s + m.num_layers * c.layer_overhead_s

    # ------------------------------------------------------------------ the model
    def breakdown(self, batch) -> StepBreakdown:
        return self.time_of(self.work(batch))

    def work(self, batch) -> "StepWork":
        """The batch reduced to what its time depends on (a calibration fit evaluates
        many coefficient sets on the same batches)."""
        m = self.model
        T = R = Q = 0
        full_pairs = full_kv = 0.0
        slide_pairs = slide_kv = 0.0
        W = self._window
        q = self.coef.attention_query_tile
        for e in batch:
            n, ctx = (e.new, e.context) if isinstance(e, BatchEntry) else e
            if n <= 0:
                continue
            T += n
            R += 1
            Q += -(-n // q)
            full_pairs += n * (ctx + (n + 1) / 2)
            full_kv += ctx + n
            if m.sliding_layers:
                # each query attends to at most W keys; the window's KV is what is read
                sc = min(ctx, W)
                slide_pairs += n * min(sc + (n + 1) / 2, W)
                slide_kv += min(ctx + n, W + n)
        return StepWork(T, R, full_pairs, full_kv, slide_pairs, slide_kv, Q)

    def time_of(self, w: "StepWork") -> StepBreakdown:
        """The step's time per component. ``w``'s fields may be NumPy arrays (one entry per
        step, every step with tokens: :meth:`StepWork.stack`): the breakdown is then of
        arrays, by the same formula. A calibration fit prices hundreds of measured steps
        under each of thousands of coefficient sets, and a loop over them in Python was most
        of ``mars emulate calibrate``'s time."""
        m, c = self.model, self.coef
        T, R = w.tokens, w.requests
        scalar = isinstance(T, (int, float))
        if scalar and T == 0:
            return StepBreakdown(0.0, 0.0, 0.0, 0.0, 0.0)
        mx, mn = (max, min) if scalar else _array_minmax()
        L, bw = m.num_layers, self._bw
        proj = L * mx(2 * T * m.attn_params / self._f_gemm, self._attn_w / bw)
        # dense FFN and router: every token, every weight
        mlp = L * mx(2 * T * (m.dense_mlp_params + m.router_params) / self._f_gemm,
                     self._mlp_dense_w / bw)
        if m.num_experts:
            E, k = m.num_experts, m.experts_per_token
            touched = E * (1.0 - (1.0 - k / E) ** T)
            mlp = mlp + L * mx(2 * T * k * m.expert_params / self._f_moe,
                               touched * self._expert_w / bw)
        af = self._attn_flop
        kv_bw = self._kv_bandwidth(w, mn)
        attn = m.full_layers * mx(af * w.full_pairs / self._f_attn,
                                  w.full_kv * self._kv_layer / kv_bw)
        if m.sliding_layers:
            attn = attn + m.sliding_layers * mx(af * w.slide_pairs / self._f_attn,
                                                w.slide_kv * self._kv_layer / kv_bw)
        P = c.attention_parallelism
        if P > 0:
            # below P query tiles the kernel runs at the occupancy's share (1 at or above P)
            attn = attn / mn(mx(w.query_tiles, 1) / P, 1.0) ** c.attention_occupancy_exponent
        logits = mx(2 * R * m.vocab * m.hidden / self._f_gemm, self._logits_w / bw)
        overhead = self._fixed + R * c.request_overhead_s
        return StepBreakdown(proj, mlp, attn, logits, overhead)

    def _kv_bandwidth(self, w: "StepWork", mn=min) -> float:
        """The rate the step's KV is read at. Every step re-reads each running request's
        context, so when all of it fits in the device's last-level cache it stays there
        between steps and is read at the cache's rate; the part beyond the cache comes from
        memory. Matters on a CPU (tens of MiB of cache against a few MiB of KV per 10 K
        tokens of a small model); a GPU's L2 holds a negligible share of a 30B model's KV,
        and the shipped GPU profiles leave it off (``cache_bytes = 0``)."""
        c, bw = self.coef, self._bw
        if c.cache_bytes <= 0 or c.cache_bandwidth_ratio <= 1:
            return bw
        m = self.model
        total = (m.full_layers * w.full_kv + m.sliding_layers * w.slide_kv) * self._kv_layer
        if isinstance(total, (int, float)) and total <= 0:
            return bw  # (stacked steps all have tokens, so KV to read)
        hot = mn(total, c.cache_bytes)
        return total / (hot / (bw * c.cache_bandwidth_ratio) + (total - hot) / bw)
