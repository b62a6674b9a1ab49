"""The step-time model measured on real GPUs: operator timings, interpolated, per step.

The shipped H100 (SXM) and H200 profiles are tables of one layer's operators timed on those
cards at the models' real shapes (``../shared/gpu-timings``, the project's own harness
:mod:`mars.emulate.op_timing`; packaged in ``mars/emulate/gpu_tables/`` with their provenance).
A step's time is::

    layers x (projections(T) + experts(T)) + full layers x attention(batch)
      + sliding layers x attention(batch, window) + logits(R)
      + step + layers x per_layer + R x per_request        (host and untimed work)

each operator read off its table (:class:`mars.emulate.op_tables.OperatorTables`). What the
tables do not hold is added from other measurements and said so:

* **Overheads** (the scheduler, sampling, the layer norms, rotary, routing and the KV-cache
  write that the harness does not time): :data:`OVERHEADS`, from published vLLM
  measurements of these models (docs/emulation.md, *Measured profiles*).
* **MXFP4 experts** (gpt-oss): the harness times the experts in BF16, which moves 3.8x the
  weight bytes. The measured time is scaled by the roofline's ratio of MXFP4 to BF16 at the
  same token count: the memory-bound share shrinks with the bytes, the compute-bound share
  stays (dequantising in the kernel is taken as free).
* **Derived GPUs** (``h100-nvl`` from ``h100``, ``h200-nvl`` from ``h200``): no timings. Each
  operator's measured time on the base card is scaled by the roofline's ratio between the two
  cards at that point -- spec-sheet BF16 peak (clock and power limit) where the operator is
  compute-bound, HBM bandwidth where it is memory-bound. Marked derived everywhere.
* **FP8 KV cache** (``--kv-cache-dtype fp8``): attention scaled by the roofline's ratio of
  one-byte to two-byte KV.

GPUs nobody has timed keep the roofline (:class:`~mars.emulate.step_time.StepTimeModel`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from mars.emulate.op_tables import OperatorTables, Roofline, read_timings
from mars.emulate.specs import GpuSpec, ModelSpec, get_gpu, get_model
from mars.emulate.step_time import (BatchEntry, StepBreakdown, StepCoefficients, StepTimeModel,
                                    StepTimer)

TABLE_FORMAT = "mars-gpu-tables/1"

#: measured GPUs: the folder in ``gpu_tables/`` holding their timings
MEASURED = ("h100", "h200")
#: derived GPUs: the measured card each is scaled from (spec-sheet ratios, docs)
DERIVED = {"h100-nvl": "h100", "h200-nvl": "h200"}


@dataclass(frozen=True, slots=True)
class Overheads:
    """What the operator timings do not hold, in seconds: per step (the host's scheduling,
    input preparation, sampling and output processing, where async scheduling does not hide
    them), per layer, per request, and per token and layer (the work a prefill does beyond
    the timed operators: norms, rotary, activation, routing and the permutation of tokens to
    experts, and vLLM's own kernels where they run slower than the harness's stand-ins).
    Values and the published points they come from: :data:`OVERHEADS`, docs/emulation.md."""

    step_s: float = 0.0
    layer_s: float = 0.0
    request_s: float = 0.0
    token_layer_s: float = 0.0

    def seconds(self, layers: int, requests: int, tokens: int) -> float:
        return (self.step_s + layers * self.layer_s + requests * self.request_s
                + layers * tokens * self.token_layer_s)


@dataclass(frozen=True, slots=True)
class Mxfp4Kernel:
    """gpt-oss's experts are MXFP4; the harness timed them in BF16. The measured time is
    carried to MXFP4 by the roofline's ratio of the two formats (3.8x fewer weight bytes where
    the experts are memory-bound, the same work where they are compute-bound), run at
    ``relative_speed`` of the BF16 kernel's rate: vLLM's MXFP4 MoE on Hopper dequantises the
    weights inside the kernel, which costs in both regimes. The value is taken from
    published points (docs)."""

    relative_speed: float = 1.0


#: taken from published measurements (``python -m mars.engine.harness.serving_bench --fit``;
#: docs/emulation.md, *Measured profiles*): the step overhead from ``qwen-h200-c1-tpot``, the
#: per-token prefill cost from ``qwen-h100nvl-4096x8``; the rest of the published points
#: check them
OVERHEADS = Overheads(step_s=35.5e-6, layer_s=0.0, request_s=0.0, token_layer_s=211e-9)
#: from ``oss-h100-c4-tpot`` and ``oss-h100-sharegpt-itl`` together (the closest share to both)
MXFP4 = Mxfp4Kernel(relative_speed=0.7)


@contextlib.contextmanager
def taken_from(overheads: Overheads, mxfp4: Mxfp4Kernel):
    """Step models built inside use these instead of :data:`OVERHEADS` and :data:`MXFP4`
    (for taking them from published points: ``serving_bench --fit``)."""
    global OVERHEADS, MXFP4
    old = OVERHEADS, MXFP4
    OVERHEADS, MXFP4 = overheads, mxfp4
    try:
        yield
    finally:
        OVERHEADS, MXFP4 = old


def _table_doc(gpu: str, model: str) -> dict[str, Any] | None:
    f = resources.files("mars.emulate").joinpath("gpu_tables", gpu, f"{model}.json")
    if not f.is_file():
        return None
    doc = json.loads(f.read_text())
    if doc.get("format") != TABLE_FORMAT:
        raise ValueError(f"gpu_tables/{gpu}/{model}.json: not a {TABLE_FORMAT} document")
    return doc


@lru_cache(maxsize=None)
def shipped_tables(gpu: str, model: str) -> OperatorTables | None:
    """The packaged tables measured on ``gpu`` (a name in :data:`MEASURED`) for ``model``
    (their provenance stays in the file); None where nobody has timed the pair."""
    doc = _table_doc(gpu, model)
    if doc is None:
        return None
    return OperatorTables(get_model(model), get_gpu(gpu), read_timings(doc))


def measured_source(gpu: str, model: str) -> tuple[str, str] | None:
    """``(base GPU, "measured" | "derived")`` where a measured profile exists for the pair."""
    base = gpu if gpu in MEASURED else DERIVED.get(gpu)
    if base is None or shipped_tables(base, model) is None:
        return None
    return base, "measured" if base == gpu else "derived"


class MeasuredStepModel(StepTimer):
    """Step times from operator tables (module docstring). ``tables`` were measured on
    ``tables.gpu``; ``gpu`` may be another card (a derived profile), ``model`` may differ
    from the timed one only in its KV dtype."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, tables: OperatorTables,
                 overheads: Overheads | None = None, mxfp4: Mxfp4Kernel | None = None
                 ) -> None:
        overheads = overheads or OVERHEADS
        mxfp4 = mxfp4 or MXFP4
        if model.name != tables.model.name:
            raise ValueError(f"tables of {tables.model.name} cannot time {model.name}")
        self.model, self.gpu, self.tables, self.overheads = model, gpu, tables, overheads
        base = tables.gpu
        self.derived = gpu.name != base.name
        self.kind = (f"measured {base.name}" if not self.derived
                     else f"derived {gpu.name} (from measured {base.name})")
        timed = tables.model  # BF16 experts and KV, as the harness ran it
        self._base_roof = Roofline(timed, base)
        self._roof = Roofline(model, gpu)
        self._mxfp4 = model.num_experts and model.expert_weight_bytes != timed.weight_bytes
        self._mxfp4_speed = mxfp4.relative_speed
        self._kv_scaled = model.kv_bytes != timed.kv_bytes

    # ------------------------------------------------------------------ components
    def _scale(self, measured: float, base: float, target: float) -> float:
        return measured * target / base if base > 0 else measured

    def _projections(self, T: int) -> float:
        t = self.tables.projections(T)
        if self.derived:
            t = self._scale(t, self._base_roof.projections(T), self._roof.projections(T))
        return t

    def _experts(self, T: int) -> float:
        t = self.tables.experts(T)
        m = self.model
        if self._mxfp4 or self.derived:
            t = self._scale(t, self._base_roof.experts(T, self.tables.model.weight_bytes,
                                                       router=False),
                            self._roof.experts(T, m.expert_weight_bytes, router=False))
            if self._mxfp4:
                t /= self._mxfp4_speed
        return t

    def _logits(self, R: int) -> float:
        t = self.tables.logits(R)
        if self.derived:
            t = self._scale(t, self._base_roof.logits(R), self._roof.logits(R))
        return t

    def _attention(self, pairs: list[tuple[int, int]], window: int | None) -> float:
        t = self.tables.attention(pairs, window)
        if self.derived or self._kv_scaled:
            base = sum(self._base_roof.attention(1, n, c, window) for n, c in pairs)
            target = sum(self._roof.attention(1, n, c, window) for n, c in pairs)
            t = self._scale(t, base, target)
        return t

    # ------------------------------------------------------------------ the model
    def breakdown(self, batch: Iterable[BatchEntry] | Iterable[tuple[int, int]]
                  ) -> StepBreakdown:
        pairs = [(e.new, e.context) if isinstance(e, BatchEntry) else (int(e[0]), int(e[1]))
                 for e in batch]
        pairs = [(n, c) for n, c in pairs if n > 0]
        if not pairs:
            return StepBreakdown(0.0, 0.0, 0.0, 0.0, 0.0)
        m, o = self.model, self.overheads
        T, R = sum(n for n, _ in pairs), len(pairs)
        proj = m.num_layers * self._projections(T)
        mlp = m.num_layers * self._experts(T)
        attn = m.full_layers * self._attention(pairs, None)
        if m.sliding_layers:
            attn += m.sliding_layers * self._attention(pairs, m.sliding_window)
        logits = self._logits(R)
        overhead = o.seconds(m.num_layers, R, T)
        return StepBreakdown(proj, mlp, attn, logits, overhead)


def step_model_stamp(gpu: str, model: str, kind: str = "measured") -> str:
    """What a cached result computed with the step-time model of ``model`` on ``gpu`` depends
    on: ``"roofline"``, or the measured tables' content with the overheads and MXFP4 speed
    taken from published points (a re-timed table or a new overhead changes the stamp)."""
    src = measured_source(gpu, model) if kind == "measured" else None
    if src is None:
        return "roofline"
    import hashlib

    doc = json.dumps(_table_doc(src[0], model), sort_keys=True)
    extra = json.dumps([OVERHEADS.step_s, OVERHEADS.layer_s, OVERHEADS.request_s,
                        OVERHEADS.token_layer_s, MXFP4.relative_speed])
    digest = hashlib.sha256((doc + extra).encode()).hexdigest()[:16]
    return f"{src[1]} {src[0]} {digest}"


def step_model_for(model: ModelSpec, gpu: GpuSpec, coefficients: StepCoefficients | None = None,
                   kind: str = "measured") -> StepTimer:
    """The step-time model of ``model`` on ``gpu``: the measured (or derived) tables where
    they exist and ``kind`` is ``"measured"``, else the roofline (with ``coefficients``:
    a calibrated profile's fit, or the shipped defaults). Explicit coefficients always mean
    the roofline: they are its parameters."""
    if kind not in ("measured", "roofline"):
        raise ValueError(f"step_model must be 'measured' or 'roofline', got {kind!r}")
    if kind == "measured" and coefficients is None:
        src = measured_source(gpu.name, model.name)
        if src is not None and gpu == get_gpu(gpu.name):
            tables = shipped_tables(src[0], model.name)
            assert tables is not None
            return MeasuredStepModel(model, gpu, tables)
    return StepTimeModel(model, gpu, coefficients)
