"""Fitting the step-time model's coefficients to measured engine steps.

``mars emulate calibrate`` times real engine steps of known batches; this module finds the
:class:`~mars.emulate.step_time.StepCoefficients` under which *the same* model
(:class:`~mars.emulate.step_time.StepTimeModel`, roofline terms with ``max``) predicts them
best. The objective is the mean robust (pseudo-Huber) loss of the log ratio of predicted to
measured time: a relative error, so a 1 ms decode counts as much as a 200 ms prefill chunk,
and squared for errors up to ~10 % but only linear beyond, so that steps slowed by something
else on a shared machine do not pull the fit.

What is fitted: the GEMM, attention and memory efficiencies (relative to the device's measured
peaks, capped at 1), the per-step and per-request overheads, the attention occupancy
(parallelism and exponent; the query tile is chosen from a few sizes by the same objective, as
it changes the batches' work) and the last-level cache (size and read-rate ratio). The
per-layer overhead is not separately identifiable on one model (it is ``layers x`` a
constant, like the per-step one), so it is fixed at 0 and the step overhead carries it. The
MoE efficiency is never fitted (kept at its default): the embedded model is dense, so nothing
measured here prices experts. The search is Nelder--Mead on the logarithms (no SciPy
dependency), restarted from a few deterministic starts; the result is deterministic
for the same samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from mars.emulate.specs import GpuSpec, ModelSpec
from mars.emulate.step_time import StepCoefficients, StepTimeModel, StepWork

#: the fitted fields, in the order of the search vector (all searched as logarithms but the
#: exponent)
FITTED = ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "step_overhead_s",
          "request_overhead_s", "attention_parallelism", "attention_occupancy_exponent",
          "cache_bytes", "cache_bandwidth_ratio")
_EFFICIENCIES = {"gemm_efficiency", "attention_efficiency", "memory_efficiency"}
_MAX_EXPONENT = 2.0
#: efficiencies may exceed the measured peaks during the search (a CPU's caches beat its
#: copy bandwidth on small KV); the result moves the excess into the device's peaks
_SEARCH_CAP = 100.0
#: query tiles tried (tokens): attention kernels tile queries by 8 to 128
QUERY_TILES = (8, 16, 32, 64)
#: where the cache size starts when the device's is unknown (bytes)
_CACHE_START = 32 * 2**20
#: the cache may be read at most this many times faster than memory
_MAX_CACHE_RATIO = 50.0
_FLOOR = 1e-7  # smallest efficiency the search may reach (StepCoefficients needs > 0)
#: bound of a search coordinate (log of a coefficient): e^100 ~ 1e43, beyond any physical
#: coefficient, far below float overflow (e^709)
_MAX_LOG = 100.0


@dataclass(frozen=True, slots=True)
class Measured:
    """One measured step as run: ``(new, context)`` for each request, and its seconds."""

    batch: tuple[tuple[int, int], ...]
    seconds: float
    #: requests the step finished (their KV freed in the step's host work)
    finished: int = 0

    @property
    def kind(self) -> str:
        """``decode`` (every request one token), ``prefill`` (none), else ``mixed``."""
        ones = [n == 1 for n, _ in self.batch]
        return "decode" if all(ones) else "mixed" if any(ones) else "prefill"


@dataclass(frozen=True)
class FitResult:
    """The fitted coefficients, the device they are relative to, and how well they fit."""

    coefficients: StepCoefficients
    #: the device the coefficients are relative to (the measured peaks, raised where the
    #: engine was seen to exceed them)
    gpu: GpuSpec
    #: |predicted / measured - 1| over the samples: mean, median, P90, max, per kind
    errors: dict[str, float]
    samples: int

    def as_dict(self) -> dict:
        return {"samples": self.samples, "fitted": list(FITTED),
                "abs_relative_error": {k: round(v, 4) for k, v in self.errors.items()}}


def _exp(v: float) -> float:
    """``exp`` of a search coordinate, finite wherever the search wanders. A direction the
    samples barely constrain (an overhead that no step shows, under the robust loss's
    linear tail) lets Nelder-Mead walk a coordinate past 709, where ``math.exp``
    overflows: `mars emulate calibrate` once died of that on a noisy machine instead of
    fitting."""
    return math.exp(min(_MAX_LOG, max(-_MAX_LOG, v)))


def _coefficients(x: Sequence[float], base: StepCoefficients) -> StepCoefficients:
    vals = {}
    for name, v in zip(FITTED, x):
        if name == "attention_occupancy_exponent":
            vals[name] = min(_MAX_EXPONENT, max(0.0, v))
            continue
        if name == "cache_bandwidth_ratio":
            vals[name] = min(_MAX_CACHE_RATIO, _exp(max(0.0, v)))
            continue
        e = _exp(v)
        vals[name] = min(_SEARCH_CAP, max(_FLOOR, e)) if name in _EFFICIENCIES else e
    return _Unchecked(base, layer_overhead_s=0.0, **vals)


class _Unchecked:
    """StepCoefficients' fields without its (0, 1] check on efficiencies, for the search."""

    def __init__(self, base: StepCoefficients, **vals: float) -> None:
        for f in base.__dataclass_fields__:
            setattr(self, f, vals.get(f, getattr(base, f)))

    def checked(self, gpu: GpuSpec) -> tuple[StepCoefficients, GpuSpec]:
        """Valid coefficients and the device they hold on: an efficiency above 1 raises the
        peak it is relative to (the products, which are all the model uses, are kept)."""
        vals = {f: getattr(self, f) for f in StepCoefficients.__dataclass_fields__}
        f_scale = max(1.0, vals["gemm_efficiency"], vals["attention_efficiency"],
                      vals["moe_efficiency"])
        b_scale = max(1.0, vals["memory_efficiency"])
        for k in ("gemm_efficiency", "attention_efficiency", "moe_efficiency"):
            vals[k] /= f_scale
        vals["memory_efficiency"] /= b_scale
        return StepCoefficients(**vals), replace(
            gpu, bf16_tflops=gpu.bf16_tflops * f_scale, fp8_tflops=gpu.fp8_tflops * f_scale,
            hbm_tb_s=gpu.hbm_tb_s * b_scale)


def relative_errors(model: ModelSpec, gpu: GpuSpec, coef: StepCoefficients,
                    samples: Sequence[Measured]) -> list[float]:
    """predicted / measured - 1 for each sample."""
    stm = StepTimeModel(model, gpu, coef)
    return [stm.step_time(s.batch) / s.seconds - 1.0 for s in samples]


def summarize(errors: Sequence[float], kinds: Sequence[str] = ()) -> dict[str, float]:
    a = sorted(abs(e) for e in errors)
    if not a:
        return {}
    out = {"mean": sum(a) / len(a), "median": a[len(a) // 2],
           "p90": a[min(len(a) - 1, int(0.9 * len(a)))], "max": a[-1]}
    for kind in sorted(set(kinds) - {""}):
        ks = [abs(e) for e, k in zip(errors, kinds) if k == kind]
        out[f"mean_{kind}"] = sum(ks) / len(ks)
    return out


def nelder_mead(f: Callable[[list[float]], float], x0: Sequence[float], step: float = 1.0,
                iters: int = 3000, tol: float = 1e-10,
                atol: float = 1e-12) -> tuple[list[float], float]:
    """Minimize ``f`` from ``x0`` (standard coefficients: reflect 1, expand 2, contract 1/2,
    shrink 1/2). Returns the best point and its value."""
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=vals.__getitem__)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) <= tol * abs(vals[0]) + atol:
            break
        centroid = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        worst = pts[-1]

        def toward(t: float) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centroid, worst)]

        xr = toward(-1.0)
        fr = f(xr)
        if fr < vals[0]:
            xe = toward(-2.0)
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = toward(0.5 if fr >= vals[-1] else -0.5)
            fc = f(xc)
            if fc < min(fr, vals[-1]):
                pts[-1], vals[-1] = xc, fc
            else:
                best = pts[0]
                pts = [best] + [[b + 0.5 * (p - b) for b, p in zip(best, q)] for q in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    i = min(range(n + 1), key=vals.__getitem__)
    return pts[i], vals[i]


def robust_loss(r, scale: float):
    """Pseudo-Huber loss of a log ratio: ``r^2`` for ``|r| << scale``, growing only linearly
    beyond. A step slowed by something else on the machine (another process, a page fault)
    is a large positive ``r`` that squared error would let pull the whole fit; this counts
    it as one sample among many. ``scale = inf``: plain squared error. ``r`` may be an array."""
    if math.isinf(scale):
        return r * r
    return 2 * scale * scale * ((1 + (r / scale) ** 2) ** 0.5 - 1)


#: log-ratio scale of the robust loss: errors up to ~10 % count as squared error
LOSS_SCALE = 0.1


def fit_coefficients(model: ModelSpec, gpu: GpuSpec, samples: Sequence[Measured],
                     base: StepCoefficients = StepCoefficients(),
                     cache_hint_bytes: float = 0.0,
                     loss_scale: float = LOSS_SCALE) -> FitResult:
    """The coefficients that minimize the mean robust loss of the log ratio over ``samples``.
    ``cache_hint_bytes``, the device's last-level cache as reported (0: unknown), is where
    the search starts the cache size; the fit moves it to what the steps show."""
    good = [s for s in samples if s.seconds > 0 and any(n > 0 for n, _ in s.batch)]
    if len(good) < 2 * len(FITTED):
        raise ValueError(f"{len(good)} usable samples; the fit needs at least {2 * len(FITTED)}")
    logs = np.log([s.seconds for s in good])
    # the smallest step bounds the overheads; start them at fractions of it
    t_min = min(s.seconds for s in good)
    best_c, best_v = None, math.inf
    for tile in QUERY_TILES:
        tiled = replace(base, attention_query_tile=tile)
        # every sample priced at once (the model's formula over arrays): the search
        # evaluates thousands of coefficient sets
        works = StepWork.stack([StepTimeModel(model, gpu, tiled).work(s.batch) for s in good])

        def loss(x: list[float]) -> float:
            stm = StepTimeModel(model, gpu, _coefficients(x, tiled))
            with np.errstate(all="ignore"):
                t = stm.time_of(works).total
                ok = (t > 0) & (t < math.inf)
                r = np.log(np.where(ok, t, 1.0)) - logs
            return float(np.where(ok, robust_loss(r, loss_scale), 1e6).mean())

        for eff in (1e-1, 1e-2):
            for par in (8.0, 64.0):
                x0 = [math.log(eff)] * 3 + [math.log(0.5 * t_min), math.log(0.05 * t_min),
                                            math.log(par), 0.8,
                                            math.log(cache_hint_bytes or _CACHE_START),
                                            math.log(2.0)]
                x, v = nelder_mead(loss, x0)
                x, v = nelder_mead(loss, x, step=0.3)  # restart: Nelder-Mead can stall
                if v < best_v:
                    best_c, best_v = _coefficients(x, tiled), v
    coef, device = best_c.checked(gpu)
    errs = relative_errors(model, device, coef, good)
    return FitResult(coef, device, summarize(errs, [s.kind for s in good]), len(good))
