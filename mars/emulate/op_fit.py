"""Fitting a GPU profile's efficiency factors to operator timings of the model's real shapes.

:mod:`mars.emulate.op_timing` times, on a GPU with PyTorch, one layer's projections, experts
and attention and the LM head at the model's real shapes. This module finds the GEMM, MoE,
attention and memory efficiencies under which the step-time model's **own terms**
(:class:`~mars.emulate.step_time.StepTimeModel`, evaluated for one layer) predict those
timings best, with the same robust objective as the engine calibration
(:mod:`mars.emulate.fit`): the pseudo-Huber loss of the log ratio, so a 20 µs decode GEMM
counts as much as a 40 ms prefill attention. Each operator class weighs the same in the
objective, however many points it has.

Each efficiency is capped at 1 of the GPU's spec-sheet peak (the shipped profile's
:class:`~mars.emulate.specs.GpuSpec`): a fitted profile stays a statement about that card.
The timings are priced with the bytes that were actually moved (BF16 weights and KV, or
expanded K/V heads where the attention backend had no grouped-query path), so the fitted
efficiencies carry over to the real dtypes (gpt-oss's MXFP4 experts, an FP8 KV cache). The
fixed overheads (per step, layer, request) are vLLM's host-side work, which no kernel timing
sees: they are kept as shipped.

Framework-free: reads the timings JSON, needs no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mars.emulate.fit import LOSS_SCALE, nelder_mead, robust_loss, summarize
from mars.emulate.op_grid import FORMAT as TIMINGS_FORMAT, LAYER, OPS, OpTiming
from mars.emulate.specs import GpuSpec, ModelSpec
from mars.emulate.step_time import StepCoefficients, StepTimeModel

#: the fitted efficiencies, and the operators that identify each
FITTED = ("gemm_efficiency", "moe_efficiency", "attention_efficiency", "memory_efficiency")
_FLOOR = 1e-4
FIT_FORMAT = "mars-op-fit/1"
#: timings that must depend on an efficiency for it to be fitted (else it stays shipped)
MIN_BINDING = 2


@dataclass(frozen=True)
class OpTimings:
    """A timings file: the model timed, the bytes per element it was timed with, the device,
    and the records."""

    model: ModelSpec
    dtype_bytes: float
    records: tuple[OpTiming, ...]
    device: dict[str, Any] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)
    moe_impl: str = ""
    #: False when the run was cut short (the file holds the operators timed so far)
    complete: bool = True
    #: attention points that could not be timed, and why
    skipped: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OpTimings:
        if not isinstance(d, dict) or d.get("format") != TIMINGS_FORMAT:
            raise ValueError(f"not operator timings (expected \"format\": \"{TIMINGS_FORMAT}\"; "
                             "make them with `python -m mars.emulate.op_timing`)")
        try:
            spec = dict(d["model_spec"])
            spec["sliding_layer_ids"] = tuple(spec.get("sliding_layer_ids") or ())
            model = ModelSpec(**spec)
            el = float(d["dtype_bytes"])
            recs = []
            for r in d["records"]:
                t = OpTiming(**r)
                if t.op == LAYER:  # a whole layer: the operators' check, not fitted
                    continue
                if t.op not in OPS:
                    raise ValueError(f"unknown operator {t.op!r}")
                if not (isinstance(t.seconds, (int, float)) and math.isfinite(t.seconds)
                        and t.seconds > 0):
                    raise ValueError(f"{t.op}: seconds must be a positive number")
                recs.append(t)
        except KeyError as exc:
            raise ValueError(f"operator timings lack {exc}") from None
        except TypeError as exc:
            raise ValueError(f"operator timings: {exc}") from None
        if not recs:
            raise ValueError("operator timings hold no records")
        return cls(model, el, tuple(recs), dict(d.get("device") or {}),
                   dict(d.get("peaks") or {}), str(d.get("moe_impl") or ""),
                   bool(d.get("complete", True)),
                   tuple(dict(x) for x in d.get("skipped_attention") or ()))

    @classmethod
    def load(cls, path: str | Path) -> OpTimings:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


class OpPredictor:
    """The step-time model's prediction of one timed operator: its term for one layer, with
    the bytes per element the timing moved."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, dtype_bytes: float) -> None:
        one = replace(model, num_layers=1, sliding_layers=0, sliding_window=None,
                      sliding_layer_ids=(), weight_bytes=dtype_bytes,
                      expert_weight_bytes=dtype_bytes, kv_bytes=dtype_bytes)
        self.models = {True: one, False: replace(one, num_kv_heads=one.num_heads)}
        self.gpu = gpu

    def works(self, records: Sequence[OpTiming]) -> list:
        stm = {g: StepTimeModel(m, self.gpu) for g, m in self.models.items()}
        return [stm[r.gqa].work(r.batch()) for r in records]

    def predict(self, coef: StepCoefficients, records: Sequence[OpTiming],
                works: Sequence | None = None) -> list[float]:
        stm = {g: StepTimeModel(m, self.gpu, coef) for g, m in self.models.items()}
        works = works if works is not None else self.works(records)
        out = []
        for r, w in zip(records, works):
            b = stm[r.gqa].time_of(w)
            out.append({"projections": b.projections, "moe": b.mlp, "attention": b.attention,
                        "logits": b.logits}[r.op])
        return out


@dataclass(frozen=True)
class OpFit:
    """Fitted efficiencies, and the error per operator before (shipped) and after."""

    gpu: GpuSpec
    model: ModelSpec
    coefficients: StepCoefficients
    base: StepCoefficients
    #: op -> summary of |predicted / measured - 1| ("mean", "median", "p90", "max")
    errors: dict[str, dict[str, float]]
    errors_before: dict[str, dict[str, float]]
    samples: int
    fitted: tuple[str, ...]
    #: efficiencies kept at their shipped value: fewer than :data:`MIN_BINDING` timings
    #: depend on them (say, attention compute with only decodes timed)
    kept: tuple[str, ...] = ()

    def emulate_config(self) -> dict[str, Any]:
        """What ``mars-vllm serve --emulate GPU:MODEL --emulate-config`` takes."""
        return {"coefficients": {k: round(getattr(self.coefficients, k), 4)
                                 for k in self.fitted}}

    def as_dict(self, timings: OpTimings | None = None) -> dict[str, Any]:
        d = {"format": FIT_FORMAT, "gpu": self.gpu.name, "model": self.model.name,
             "samples": self.samples, "fitted": list(self.fitted), "kept": list(self.kept),
             "emulate_config": self.emulate_config(),
             "abs_relative_error": _rounded(self.errors),
             "abs_relative_error_shipped": _rounded(self.errors_before)}
        if timings is not None:
            d.update(device=timings.device, peaks=timings.peaks, moe_impl=timings.moe_impl,
                     dtype_bytes=timings.dtype_bytes)
        return d


def _rounded(e: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {op: {k: round(v, 4) for k, v in s.items()} for op, s in e.items()}


def _errors(pred: Sequence[float], records: Sequence[OpTiming]) -> dict[str, dict[str, float]]:
    out = {}
    for op in OPS:
        errs = [p / r.seconds - 1 for p, r in zip(pred, records) if r.op == op]
        if errs:
            out[op] = summarize(errs)
    return out


def fit_op_efficiencies(timings: OpTimings, gpu: GpuSpec,
                        base: StepCoefficients | None = None,
                        loss_scale: float = LOSS_SCALE) -> OpFit:
    """The efficiencies (each in (0, 1] of ``gpu``'s peaks) that minimize the mean over
    operator classes of the mean robust loss of log(predicted / measured). An efficiency no
    timed operator depends on (MoE on a dense model) keeps its shipped value."""
    base = base or StepCoefficients()
    recs = list(timings.records)
    if len(recs) < 2 * len(FITTED):
        raise ValueError(f"{len(recs)} timings; the fit needs at least {2 * len(FITTED)}")
    pred = OpPredictor(timings.model, gpu, timings.dtype_bytes)
    works = pred.works(recs)
    logs = [math.log(r.seconds) for r in recs]
    ops = {r.op for r in recs}
    weights = [1.0 / sum(1 for q in recs if q.op == r.op) / len(ops) for r in recs]

    def search(names: tuple[str, ...]) -> StepCoefficients:
        def coef_of(x: Sequence[float]) -> StepCoefficients:
            return replace(base, **{k: min(1.0, max(_FLOOR, math.exp(v)))
                                    for k, v in zip(names, x)})

        def loss(x: list[float]) -> float:
            p = pred.predict(coef_of(x), recs, works)
            return sum(w * robust_loss(math.log(t) - lt, loss_scale)
                       for w, t, lt in zip(weights, p, logs))

        best_x, best_v = None, math.inf
        for start in (0.5, 0.1):
            x, v = nelder_mead(loss, [math.log(start)] * len(names))
            x, v = nelder_mead(loss, x, step=0.3)  # restart: Nelder-Mead can stall
            if v < best_v:
                best_x, best_v = x, v
        return coef_of(best_x)

    # an efficiency no timing depends on at the optimum (each term is a max of compute and
    # memory) would be fitted to nothing: keep it shipped and fit the others again
    fitted = FITTED
    coef = search(fitted)
    for _ in range(len(FITTED)):
        binding = _binding_counts(pred, coef, recs, works, fitted)
        weak = tuple(k for k in fitted if binding[k] < MIN_BINDING)
        if not weak:
            break
        fitted = tuple(k for k in fitted if k not in weak)
        coef = replace(search(fitted) if fitted else base,
                       **{k: getattr(base, k) for k in FITTED if k not in fitted})
    return OpFit(gpu, timings.model, coef, base,
                 _errors(pred.predict(coef, recs, works), recs),
                 _errors(pred.predict(base, recs, works), recs), len(recs), fitted,
                 tuple(k for k in FITTED if k not in fitted))


def _binding_counts(pred: OpPredictor, coef: StepCoefficients, recs: Sequence[OpTiming],
                    works: Sequence, names: Sequence[str]) -> dict[str, int]:
    """For each efficiency, the timings whose prediction moves when it moves (by 1 %)."""
    at = pred.predict(coef, recs, works)
    out = {}
    for k in names:
        moved = pred.predict(replace(coef, **{k: getattr(coef, k) * 0.99}), recs, works)
        out[k] = sum(1 for a, b in zip(at, moved) if abs(b / a - 1) > 1e-4)
    return out
