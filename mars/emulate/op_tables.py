"""One GPU x model's operator timings as curves: seconds per layer for any batch.

The harness (:mod:`mars.emulate.op_timing`) times one layer's operators on the GPU at the
model's real shapes over a grid of sizes. This module turns those points into functions of
the sizes a step really has, interpolating the measurements along their own axes
(:mod:`mars.emulate.interp`: monotone, C1, on log-log axes):

* ``projections``, ``experts`` (the MoE) -- one curve each over the step's tokens ``T``;
* ``logits`` -- one curve over the requests ``R`` (one last token each);
* ``attention`` -- two tables. Decodes: a curve over the batch ``B`` for each timed context
  ``c`` (``B`` requests of one new token over ``c`` cached), interpolated between contexts on
  log-log axes. Chunks: a curve over ``c`` for each timed chunk ``n`` (one request, ``n`` new
  tokens over ``c`` cached; the decode table's ``B = 1`` row is the ``n = 1`` curve),
  interpolated between chunk sizes on log-log axes.

A step's attention is priced as vLLM launches it -- one kernel over the whole batch: its
decodes as one group (``B`` of them at their mean context; decode attention reads
``sum c_i`` of KV either way), each prefill chunk on its own, and the fixed latency of one
launch (the smallest time measured) counted once rather than per part.

**Outside the measured range** (a 16K-token chunk, a 256K context, a 1,024-request decode)
the time is the nearest measured point's, scaled by the roofline's ratio between the two
points (:class:`Roofline`: spec-sheet peaks, the shipped efficiencies): the measured level,
the roofline's slope. Such lookups are counted (:attr:`OperatorTables.outside`) and reported.
Below the range (a 100-token context) the scaled time never drops under the smallest one
measured for the operator: a kernel launch does not get cheaper.

Sliding-window layers (gpt-oss: 128 tokens) read at most the window: they are priced at the
full-attention point with the window's keys, scaled by the roofline's ratio of the two.

Framework-free (standard library only).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from mars.emulate.interp import LogCurve, log_lerp
from mars.emulate.op_grid import OpTiming
from mars.emulate.specs import GpuSpec, ModelSpec
from mars.emulate.step_time import StepCoefficients

#: the harness's operator names, and the names used here
OPS = ("projections", "moe", "attention", "logits")


class Roofline:
    """Per-layer roofline times of the operators (spec-sheet peaks, the shipped efficiency
    factors): used only for *ratios* -- to carry a measured time past the measured range, to
    a sliding window, or to another GPU or weight format -- never as a time of its own."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec,
                 coef: StepCoefficients | None = None) -> None:
        c = coef or StepCoefficients()
        self.m = model
        self.f_gemm = gpu.flops * c.gemm_efficiency
        self.f_moe = gpu.flops * c.moe_efficiency
        self.f_attn = gpu.flops * c.attention_efficiency
        self.bw = gpu.bandwidth * c.memory_efficiency

    def projections(self, tokens: float) -> float:
        m = self.m
        return max(2 * tokens * m.attn_params / self.f_gemm,
                   m.attn_params * m.weight_bytes / self.bw)

    def experts(self, tokens: float, weight_bytes: float | None = None,
                router: bool = True) -> float:
        """The MoE's router and experts (``router=False``: the experts alone, whose ratio
        between two weight formats never falls as tokens grow)."""
        m = self.m
        wb = m.expert_weight_bytes if weight_bytes is None else weight_bytes
        if not m.num_experts:
            return max(2 * tokens * m.dense_mlp_params / self.f_gemm,
                       m.dense_mlp_params * m.weight_bytes / self.bw)
        E, k = m.num_experts, m.experts_per_token
        touched = E * (1.0 - (1.0 - k / E) ** tokens)
        r = max(2 * tokens * m.router_params / self.f_gemm,
                m.router_params * m.weight_bytes / self.bw) if router else 0.0
        return r + max(2 * tokens * k * m.expert_params / self.f_moe,
                            touched * m.expert_params * wb / self.bw)

    def logits(self, requests: float) -> float:
        m = self.m
        return max(2 * requests * m.vocab * m.hidden / self.f_gemm,
                   m.vocab * m.hidden * m.weight_bytes / self.bw)

    def attention(self, requests: float, new: float, context: float,
                  window: int | None = None, kv_bytes: float | None = None) -> float:
        """``requests`` x ``new`` queries over ``context`` cached keys (causal within the
        chunk), optionally within a sliding ``window``."""
        m = self.m
        n, c = new, context
        if window:
            sc = min(c, window)
            pairs = n * min(sc + (n + 1) / 2, window)
            kv = min(c + n, window + n)
        else:
            pairs = n * (c + (n + 1) / 2)
            kv = c + n
        per_token = 2 * m.num_kv_heads * m.head_dim * (m.kv_bytes if kv_bytes is None
                                                       else kv_bytes)
        return requests * max(4 * m.num_heads * m.head_dim * pairs / self.f_attn,
                              kv * per_token / self.bw)


#: one measured point: the harness's own record type (``mars-op-timings/1``)
Timing = OpTiming



def timing_from_record(r: dict[str, Any]) -> OpTiming:
    """A record of a timing file or a packaged table (fields beyond the sizes ignored)."""
    return OpTiming(str(r["op"]), float(r["seconds"]), int(r.get("tokens", 0)),
                    int(r.get("requests", 0)), int(r.get("new", 0)), int(r.get("context", 0)))


class _Rows:
    """A table as curves: one :class:`LogCurve` over the inner size per value of the outer
    size, log-log linear between outer values. ``inner`` may be 0 (a chunk with no cached
    context), so curves run over ``inner + offset(outer)``."""

    def __init__(self, rows: dict[int, list[tuple[float, float]]], offset) -> None:
        self.outer = sorted(rows)
        self.offset = offset
        self.curves = {o: LogCurve([x + offset(o) for x, _ in pts], [t for _, t in pts])
                       for o, pts in rows.items()}

    def bracket(self, outer: float) -> tuple[int, int]:
        """The two measured outer values around ``outer`` (one, where it is measured or
        beyond the ends)."""
        o = self.outer
        if outer <= o[0]:
            return o[0], o[0]
        if outer >= o[-1]:
            return o[-1], o[-1]
        i = bisect.bisect_left(o, outer)
        if o[i] == outer:
            return o[i], o[i]
        return o[i - 1], o[i]


class OperatorTables:
    """Seconds per layer of each operator of ``model`` on the GPU the ``timings`` were
    measured on, for any sizes (module docstring). ``gpu`` is that GPU's spec (peaks for
    the roofline's ratios outside the measured range)."""

    def __init__(self, model: ModelSpec, gpu: GpuSpec, timings: Iterable[Timing]) -> None:
        self.model, self.gpu = model, gpu
        self.roof = Roofline(model, gpu)
        by_op: dict[str, list[Timing]] = {op: [] for op in OPS}
        #: whole-layer timings, where the run has them: a check of the operators' sum
        self.layers: list[Timing] = []
        for t in timings:
            if t.op == "layer":
                self.layers.append(t)
                continue
            if t.op not in by_op:
                raise ValueError(f"unknown operator {t.op!r} in the timings")
            if not (t.seconds > 0 and math.isfinite(t.seconds)):
                raise ValueError(f"{t.op}: timings must be positive seconds, got {t.seconds!r}")
            by_op[t.op].append(t)
        need = ("projections", "attention", "logits") + (("moe",) if model.num_experts else ())
        missing = [op for op in need if not by_op[op]]
        if missing:
            raise ValueError(f"timings of {model.name} lack {', '.join(missing)}")
        self.points = by_op
        self._proj = LogCurve([t.tokens for t in by_op["projections"]],
                              [t.seconds for t in by_op["projections"]])
        self._moe = LogCurve([t.tokens for t in by_op["moe"]],
                             [t.seconds for t in by_op["moe"]]) if by_op["moe"] else None
        self._logits = LogCurve([t.requests for t in by_op["logits"]],
                                [t.seconds for t in by_op["logits"]])
        dec: dict[int, list[tuple[float, float]]] = {}
        chunks: dict[int, list[tuple[float, float]]] = {}
        for t in by_op["attention"]:
            if t.new == 1:
                dec.setdefault(t.context, []).append((t.requests, t.seconds))
                if t.requests == 1:
                    chunks.setdefault(1, []).append((t.context, t.seconds))
            elif t.requests == 1:
                chunks.setdefault(t.new, []).append((t.context, t.seconds))
        if not dec or not chunks:
            raise ValueError(f"attention timings of {model.name} need decodes and chunks")
        self._dec = _Rows(dec, lambda _c: 0)  # outer: context, inner: requests
        self._chunk = _Rows(chunks, lambda n: n)  # outer: chunk, inner: context + chunk
        self.floors = {op: min((t.seconds for t in pts), default=0.0)
                       for op, pts in by_op.items()}
        #: lookups outside the measured range, by operator (priced by the roofline's ratio)
        self.outside: Counter[str] = Counter()

    @property
    def attention_floor(self) -> float:
        """The fastest attention ever measured: one kernel launch's latency."""
        return self.floors["attention"]

    # ------------------------------------------------------------------ lookups
    def _carry(self, op: str, t: float, edge: float, value: float, roof) -> float:
        """``t``, measured at ``edge``, carried to ``value`` outside the measured range by
        the roofline's ratio (never under the operator's fastest time below the range);
        counted in :attr:`outside`."""
        self.outside[op] += 1
        scaled = t * roof(value) / roof(edge)
        return max(scaled, self.floors[op]) if value < edge else scaled

    def _curve(self, op: str, curve: LogCurve, size: float, roof) -> float:
        if curve.inside(size):
            return curve(size)
        edge = curve.lo if size < curve.lo else curve.hi
        return self._carry(op, curve(edge), edge, size, roof)

    def projections(self, tokens: int) -> float:
        return self._curve("projections", self._proj, tokens, self.roof.projections)

    def experts(self, tokens: int) -> float:
        """The MoE (router and experts) or the dense MLP, timed as the harness ran it
        (BF16 weights)."""
        if self._moe is None:
            raise ValueError(f"{self.model.name}: no expert timings (a dense MLP is not timed)")
        return self._curve("moe", self._moe, tokens,
                           lambda T: self.roof.experts(T, self.model.weight_bytes))

    def logits(self, requests: int) -> float:
        return self._curve("logits", self._logits, requests, self.roof.logits)

    # ------------------------------------------------------------------ attention
    def decode(self, requests: float, context: float) -> float:
        """``requests`` decodes (one new token each) over ``context`` cached tokens."""
        rows = self._dec
        a, b = rows.bracket(context)
        ta = self._row(rows, a, requests, lambda r: self.roof.attention(r, 1, a))
        if a == b:
            return self._outer_edge(a, context, ta, lambda c: self.roof.attention(requests, 1, c))
        tb = self._row(rows, b, requests, lambda r: self.roof.attention(r, 1, b))
        return log_lerp(context, a, ta, b, tb)

    def chunk(self, new: int, context: float) -> float:
        """One request's ``new`` tokens (causal among themselves) over ``context`` cached."""
        rows = self._chunk
        a, b = rows.bracket(new)
        ta = self._row(rows, a, context + a, lambda k: self.roof.attention(1, a, k - a))
        if a == b:
            return self._outer_edge(a, new, ta, lambda n: self.roof.attention(1, n, context))
        tb = self._row(rows, b, context + b, lambda k: self.roof.attention(1, b, k - b))
        return log_lerp(new, a, ta, b, tb)

    def _row(self, rows: _Rows, outer: int, inner: float, roof) -> float:
        return self._curve("attention", rows.curves[outer], inner, roof)

    def _outer_edge(self, edge: float, value: float, t: float, roof) -> float:
        return t if value == edge else self._carry("attention", t, edge, value, roof)

    def attention(self, batch: Sequence[tuple[int, int]], window: int | None = None) -> float:
        """One layer's attention over a step's ``(new, context)`` pairs (module docstring);
        ``window``: a sliding-window layer's window."""
        parts: list[float] = []
        dec_n = 0
        dec_ctx = 0.0
        for n, c in batch:
            if n <= 0:
                continue
            if n == 1:
                dec_n += 1
                dec_ctx += min(c, window) if window else c
            elif window:
                sc = min(c, window)
                full = self.chunk(n, sc)
                parts.append(full * self.roof.attention(1, n, c, window)
                             / self.roof.attention(1, n, sc))
            else:
                parts.append(self.chunk(n, c))
        if dec_n:
            parts.append(self.decode(dec_n, dec_ctx / dec_n))
        if not parts:
            return 0.0
        return max(max(parts), sum(parts) - (len(parts) - 1) * self.attention_floor)


def read_timings(data: dict[str, Any]) -> list[Timing]:
    """The measured points of a ``mars-op-timings/1`` (or packaged table) document."""
    recs = data.get("records")
    if not isinstance(recs, list) or not recs:
        raise ValueError("timings have no records")
    try:
        return [timing_from_record(r) for r in recs]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad timing record: {exc}") from None
