"""Timing one layer's operators of a model's real shapes with PyTorch, on a GPU without vLLM:
what the measured step-time model's tables are packed from (``scripts/pack_gpu_tables.py``)
and what ``mars emulate fit-ops`` fits the roofline's efficiencies to (any machine, no torch)::

    python3 -m mars.emulate.op_timing --model qwen3-coder-30b-a3b --out ops-qwen.json
    mars emulate fit-ops ops-qwen.json        # the profile follows the device name

What is timed, per layer (the step-time model's terms; the grids: :mod:`mars.emulate.op_grid`):

* ``projections``: the Q/K/V GEMM and the O GEMM of ``T`` tokens;
* ``moe``: the router GEMM and every expert's gate/up and down GEMMs for ``T`` tokens routed
  uniformly at random to ``k`` of ``E`` experts (``torch._grouped_mm`` where PyTorch has it,
  else one GEMM pair per expert); routing and sorting are outside the timed region, as vLLM's
  fused kernel folds the gather into its loads. A stand-in for vLLM's fused MoE kernel;
* ``attention``: ``scaled_dot_product_attention`` of ``B`` requests, each ``n`` new tokens over
  ``c`` cached ones (decode: ``n = 1``; a prefill chunk: causal, aligned to the end of the
  keys), grouped-query where the backend supports it;
* ``logits``: the LM head GEMM of ``R`` requests' last tokens;
* the device's own peaks: a large BF16 GEMM and a device-to-device copy.

Caveats, recorded in the docs: weights and KV are timed in the compute dtype (BF16;
gpt-oss's MXFP4 experts cannot run as MXFP4 in PyTorch, so the fit prices the bytes actually
moved and applies the fitted efficiencies to MXFP4 bytes); PyTorch's SDPA kernels stand in
for vLLM's attention backends; vLLM's host-side work (scheduling, sampling, output
processing) is not here, so the per-step, per-layer and per-request overheads are not fitted. Each operand is rotated over enough copies to exceed the device's last-level
cache several times, as in a real forward pass where other layers' weights evict it.

One time is taken by :mod:`mars.emulate.op_clock`. At module level this imports only the
standard library, ``op_grid``, ``op_clock`` and ``specs``; torch is imported when timing
starts, so it runs on a GPU machine that has PyTorch alone.

Past 600 lines on purpose: :class:`OpTimer`'s operators share one set of rotated operands,
one clock and one record of what was skipped and why, and what goes to the GPU machine is
kept to this module and the three it imports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mars.emulate.op_clock import DeviceClock, error_line
from mars.emulate.op_grid import (
    CACHE_MULTIPLE,
    DEFAULT_CACHE,
    DTYPE_BYTES,
    FA3_SPEEDUP,
    FORMAT,
    LAYER,
    MAX_EXPANDED_KV_BYTES,
    OpGrid,
    OpTiming,
    largest_operands,
    load_model,
)
from mars.emulate.specs import ModelSpec


class OpTimer:
    """Times one layer's operators of ``model`` on ``device`` (a torch device string)."""

    def __init__(self, model: ModelSpec, device: str = "cuda", dtype: str = "bfloat16",
                 grid: OpGrid | None = None, seed: int = 0,
                 progress: Callable[[str], None] | None = None, graphs: bool = True) -> None:
        import torch

        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        self.torch, self.model = torch, model
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("no CUDA device is visible to PyTorch (use --device cpu)")
        self.dtype, self.dtype_name = getattr(torch, dtype), dtype
        self.grid = grid or OpGrid()
        self.clock = DeviceClock(torch, self.device, graphs)
        torch.manual_seed(seed)  # operands are drawn on the device
        self.gen = torch.Generator(device="cpu").manual_seed(seed)  # routing
        self._weights: dict[str, list] = {}
        self.progress = progress or (lambda _msg: None)
        self.cache_bytes = self._cache_bytes()
        #: time attention with K/V expanded to the query heads even where the backend has
        #: a grouped-query path (a test of the fallback)
        self.force_expanded = False
        self.moe_impl = "grouped_mm" if hasattr(torch, "_grouped_mm") else "per-expert"
        #: the attention kernel the last :meth:`attention` kept
        self.last_kernel = ""

    # ------------------------------------------------------------------ helpers
    def _cache_bytes(self) -> int:
        if self.device.type == "cuda":
            props = self.torch.cuda.get_device_properties(self.device)
            return int(getattr(props, "L2_cache_size", 0) or DEFAULT_CACHE)
        return DEFAULT_CACHE

    def _rand(self, *shape: int):
        return self.torch.empty(*shape, device=self.device, dtype=self.dtype).normal_(0, 0.02)

    def _weight_set(self, name: str, make: Callable[[], Any], bytes_each: int) -> list:
        """Copies of one layer's weights, made once and kept for every point of the grid."""
        if name not in self._weights:
            self._weights[name] = [make() for _ in range(self._copies(bytes_each))]
        return self._weights[name]

    def _copies(self, bytes_each: int) -> int:
        """Copies of an operand to rotate over so the set exceeds the cache several times."""
        need = math.ceil(CACHE_MULTIPLE * self.cache_bytes / max(1, bytes_each))
        return max(1, min(self.grid.max_copies, need))

    def _time(self, fn: Callable[[int], Any], copies: int = 1) -> float:
        """Seconds per call; the timed calls walk through all ``copies`` of the operands
        (call ``i`` uses copy ``i % copies``), so none is still in the cache from the last
        call that used it."""
        g = self.grid
        with self.torch.inference_mode():
            return self.clock.per_call(fn, g.warmup, max(g.repeats, copies))

    def _free(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()

    def _drop(self, name: str) -> None:
        self._weights.pop(name, None)
        self._free()

    # ------------------------------------------------------------------ operators
    def projections(self, tokens: int) -> float:
        m, el = self.model, DTYPE_BYTES[self.dtype_name]
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        ws = self._weight_set("projections", lambda: (self._rand(m.hidden, q + 2 * kv),
                                                      self._rand(q, m.hidden)),
                              m.attn_params * el)
        x, a = self._rand(tokens, m.hidden), self._rand(tokens, q)

        def run(i: int):
            wqkv, wo = ws[i % len(ws)]
            return x @ wqkv, a @ wo

        return self._time(run, len(ws))

    def moe(self, tokens: int) -> float:
        torch, m = self.torch, self.model
        E, k, h, inter = m.num_experts, m.experts_per_token, m.hidden, m.expert_intermediate
        el = DTYPE_BYTES[self.dtype_name]
        # stored (expert, out, in) and used transposed, the layout grouped GEMMs take
        ws = self._weight_set("moe", lambda: (self._rand(E, 2 * inter, h),
                                              self._rand(E, h, inter), self._rand(h, E)),
                              E * m.expert_params * el)
        n = len(ws)
        x = self._rand(tokens, h)
        # a few routings, rotated like the other operands' copies: a small batch touches
        # only k experts, which one routing would leave in the cache from call to call
        touched = E * (1.0 - (1.0 - k / E) ** tokens) * m.expert_params * el
        routes = [self._routing(x, tokens) for _ in range(self._copies(int(touched)))]
        silu = torch.nn.functional.silu

        def grouped(i: int):
            w13, w2, wr = ws[i % n]
            xs, offs, _ = routes[i % len(routes)]
            x @ wr
            gu = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
            g, u = gu[:, :inter], gu[:, inter:]
            return torch._grouped_mm(silu(g) * u, w2.transpose(-2, -1), offs=offs)

        def per_expert(i: int):
            w13, w2, wr = ws[i % n]
            xs, _, bounds = routes[i % len(routes)]
            x @ wr
            outs = []
            for e in range(E):
                if bounds[e + 1] > bounds[e]:
                    gu = xs[bounds[e]:bounds[e + 1]] @ w13[e].t()
                    outs.append((silu(gu[:, :inter]) * gu[:, inter:]) @ w2[e].t())
            return outs

        fn = per_expert
        if self.moe_impl == "grouped_mm":
            try:
                grouped(0)
                fn = grouped
            except (RuntimeError, NotImplementedError, TypeError):
                self.moe_impl = "per-expert"
        return self._time(fn, max(n, len(routes)))

    def _routing(self, x, tokens: int):
        """Uniform random top-k routing of ``tokens`` rows of ``x``: the rows sorted by
        expert (one row per token and chosen expert), each expert's end offset (int32, on
        the device, as grouped GEMMs take it) and the same offsets as a list."""
        torch, m = self.torch, self.model
        E, k = m.num_experts, m.experts_per_token
        choice = torch.rand(tokens, E, generator=self.gen).topk(k, dim=1).indices.flatten()
        order = choice.argsort(stable=True)
        ends = torch.bincount(choice, minlength=E).cumsum(0)
        xs = x[order.to(self.device) // k].contiguous()
        return xs, ends.to(device=self.device, dtype=torch.int32), [0, *ends.tolist()]

    def attention(self, requests: int, new: int, context: int) -> tuple[float | str, bool]:
        """Seconds (or why the point was skipped), and whether K/V were read with their own
        heads (grouped-query) or had to be expanded to the query heads first, where the
        backend has no grouped-query path for the point (the kernel then reads that many
        times more K/V; the fit prices what was read).

        The fastest way this PyTorch has is kept (:attr:`last_kernel` says which): on CUDA
        each fused SDPA backend alone (FlashAttention, cuDNN, memory-efficient), and for a
        chunk over cached context also the split vLLM's kernels compute in one pass -- flash
        over the cache (non-causal) and over the chunk (causal), merged by log-sum-exp."""
        torch, m = self.torch, self.model
        F = torch.nn.functional
        keys = context + new
        el = DTYPE_BYTES[self.dtype_name]
        kv_bytes = 2 * requests * keys * m.num_kv_heads * m.head_dim * el
        rep = m.num_heads // m.num_kv_heads
        n = self._copies(kv_bytes)
        mask: Any = None
        causal = new > 1 and context == 0
        if new > 1 and context > 0:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(new, keys)  # a chunk's queries are the keys' last
        q = self._rand(requests, m.num_heads, new, m.head_dim)
        kvs = [(self._rand(requests, m.num_kv_heads, keys, m.head_dim),
                self._rand(requests, m.num_kv_heads, keys, m.head_dim)) for _ in range(n)]

        def call(i: int, gqa: bool):
            k, v = kvs[i % n]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  enable_gqa=gqa)

        self.last_kernel = ""
        with self._fast_attention():
            gqa = rep == 1 or not self.force_expanded
            if gqa and rep > 1:
                try:
                    call(0, True)
                except (RuntimeError, NotImplementedError, TypeError):
                    gqa = False
        if not gqa:
            if kv_bytes * rep > MAX_EXPANDED_KV_BYTES:
                return "no grouped-query kernel; expanded K/V too large", False
            kvs = [(k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1))
                   for k, v in kvs]
        best: float | None = None
        best_graphed = False
        why = "no attention kernel ran"
        for name, ctx in self._attention_backends():
            try:
                with ctx:
                    t = self._time(lambda i: call(i, gqa and rep > 1), n)
            except (RuntimeError, NotImplementedError) as exc:  # OOM, no kernel for it
                why = error_line(exc)
                continue
            if best is None or t < best:
                best, self.last_kernel, best_graphed = t, name, self.clock.graphed
        if new > 1 and context > 0 and requests == 1 \
                and kv_bytes * rep <= MAX_EXPANDED_KV_BYTES:
            try:
                t = self._split_attention(q, kvs, context, rep if gqa else 1)
                if best is None or t < best:
                    best, self.last_kernel, best_graphed = t, "split", self.clock.graphed
            except (RuntimeError, NotImplementedError, TypeError) as exc:
                why = error_line(exc)
        # the record's ``graph`` is the kept kernel's, not the last one tried (the run of
        # 2026-11-28 recorded the last backend's, which had no kernel for most points)
        self.clock.graphed = best_graphed
        self._free()
        return (best if best is not None else why), gqa

    def _attention_backends(self):
        """``(name, context manager)`` for each attention path to time."""
        import contextlib

        if self.device.type != "cuda":
            return [("sdpa", contextlib.nullcontext())]
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return [("flash", sdpa_kernel([SDPBackend.FLASH_ATTENTION])),
                ("cudnn", sdpa_kernel([SDPBackend.CUDNN_ATTENTION])),
                ("efficient", sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))]

    def _split_attention(self, q, kvs: list, context: int, rep: int) -> float:
        """The split, timed over rotated copies as the other kernels are (each call reads
        K/V no earlier call left in the cache); the expanded copies are made per copy."""
        fns = [self.split_attention_fn(q, kv, context, rep) for kv in kvs]
        return self._time(lambda i: fns[i % len(fns)](i), len(fns))

    def split_attention_fn(self, q, kv, context: int, rep: int):
        """One chunk over ``context`` cached keys as flash kernels compute it: the cached
        part without a mask, the chunk's own keys causally, the two merged by their
        log-sum-exps. K/V are expanded to the query heads outside the timed region (the
        flash op takes no grouped-query heads)."""
        torch = self.torch
        k, v = kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        kc, vc, kn, vn = k[:, :, :context], v[:, :, :context], k[:, :, context:], v[:, :, context:]
        op = (torch.ops.aten._scaled_dot_product_flash_attention if self.device.type == "cuda"
              else torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)

        def run(_i: int):
            o1, l1 = op(q, kc, vc, 0.0, False)[:2]
            o2, l2 = op(q, kn, vn, 0.0, True)[:2]
            mx = torch.maximum(l1, l2)
            w1, w2 = torch.exp(l1 - mx).unsqueeze(-1), torch.exp(l2 - mx).unsqueeze(-1)
            return (o1 * w1 + o2 * w2) / (w1 + w2)

        return run

    def _fast_attention(self):
        """On CUDA, only the fused attention kernels: an error rather than the math
        fallback, which materializes the score matrix (and would time something else)."""
        import contextlib

        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                            SDPBackend.EFFICIENT_ATTENTION])

    # ------------------------------------------------------------------ a whole layer
    def layer(self, requests: int, new: int, context: int) -> float:
        """One decoder layer's forward for ``requests`` x ``new`` tokens over ``context``
        cached: RMSNorm, the QKV GEMM, rotary, the new K/V written into the cache, attention,
        the O GEMM and residual; RMSNorm, router GEMM, softmax and top-k, the tokens
        permuted to their experts, the experts (grouped GEMMs, SiLU), the weighted sum back
        and residual. The operators above, plus what they leave out, in one forward: the
        sum of the operators is checked against it (``mars.emulate.table_check``)."""
        torch, m = self.torch, self.model
        F = torch.nn.functional
        h, H, KV, d = m.hidden, m.num_heads, m.num_kv_heads, m.head_dim
        T, keys = requests * new, context + new
        qd, kd = H * d, KV * d
        wqkv, wo = self._rand(h, qd + 2 * kd), self._rand(qd, h)
        g1, g2 = torch.ones(h, device=self.device, dtype=self.dtype), \
            torch.ones(h, device=self.device, dtype=self.dtype)
        kcache = self._rand(requests, KV, keys, d)
        vcache = self._rand(requests, KV, keys, d)
        pos = torch.arange(context, keys, device=self.device, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=self.device,
                                            dtype=torch.float32) / d))
        ang = torch.outer(pos, inv)
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(self.dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(self.dtype)
        mask: Any = None
        causal = new > 1 and context == 0
        if new > 1 and context > 0:
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(new, keys)
        moe = bool(m.num_experts)
        if moe:
            E, k, inter = m.num_experts, m.experts_per_token, m.expert_intermediate
            w13, w2 = self._rand(E, 2 * inter, h), self._rand(E, h, inter)
            wr = self._rand(h, E)
        else:
            inter = m.dense_intermediate
            w13, w2 = self._rand(2 * inter, h), self._rand(h, inter)
        x = self._rand(T, h)
        grouped = hasattr(torch, "_grouped_mm") and self.device.type == "cuda"

        def rot(t):
            t1, t2 = t[..., : d // 2], t[..., d // 2:]
            return t * cos + torch.cat([-t2, t1], -1) * sin

        def run(_i: int):
            y = F.rms_norm(x, (h,), g1)
            qkv = y @ wqkv
            q = rot(qkv[:, :qd].view(requests, new, H, d).transpose(1, 2))
            kn = rot(qkv[:, qd:qd + kd].view(requests, new, KV, d).transpose(1, 2))
            vn = qkv[:, qd + kd:].view(requests, new, KV, d).transpose(1, 2)
            kcache[:, :, context:].copy_(kn)
            vcache[:, :, context:].copy_(vn)
            a = F.scaled_dot_product_attention(q, kcache, vcache, attn_mask=mask,
                                               is_causal=causal, enable_gqa=KV != H)
            x1 = x + a.transpose(1, 2).reshape(T, qd) @ wo
            y2 = F.rms_norm(x1, (h,), g2)
            if not moe:
                gu = y2 @ w13.t()
                return x1 + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2.t()
            probs = torch.softmax((y2 @ wr).float(), -1)
            topw, topi = probs.topk(k, dim=-1)
            flat = topi.flatten()
            order = flat.argsort()
            xs = y2[order // k]
            counts = torch.bincount(flat, minlength=E)
            if grouped:
                offs = counts.cumsum(0).to(torch.int32)
                gu = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
                out = torch._grouped_mm(F.silu(gu[:, :inter]) * gu[:, inter:],
                                        w2.transpose(-2, -1), offs=offs)
            else:  # one GEMM pair per expert (CPU, or no grouped GEMM)
                bounds = [0, *counts.cumsum(0).tolist()]
                parts = []
                for e in range(E):
                    lo, hi = bounds[e], bounds[e + 1]
                    if hi > lo:
                        gu = xs[lo:hi] @ w13[e].t()
                        parts.append((F.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[e].t())
                out = torch.cat(parts) if parts else xs[:0]
            wsum = torch.zeros_like(y2)
            wsum.index_add_(0, order // k,
                            out * topw.flatten()[order].unsqueeze(-1).to(out.dtype))
            return x1 + wsum

        # the routing syncs the host (bincount, tolist): time it eagerly, as vLLM runs a
        # prefill layer; decodes in vLLM run as graphs, so the eager launch gaps are an
        # upper bound there (recorded: ``graph`` is False)
        graphs, self.clock.graphs = self.clock.graphs, False
        try:
            with self.torch.inference_mode(), self._fast_attention():
                t = self.clock.per_call(run, self.grid.warmup, self.grid.repeats)
        finally:
            self.clock.graphs = graphs
            self._free()
        return t

    def logits(self, requests: int) -> float:
        m = self.model
        w = self._weight_set("logits", lambda: self._rand(m.hidden, m.vocab),
                             m.hidden * m.vocab * DTYPE_BYTES[self.dtype_name])
        x = self._rand(requests, m.hidden)
        return self._time(lambda i: x @ w[i % len(w)], len(w))

    def peaks(self) -> dict[str, float]:
        """The device's own dense GEMM rate (FLOP/s) and copy bandwidth (bytes/s, read plus
        write): what the efficiencies are measured against besides the spec sheet."""
        # launched eagerly: under CUDA-graph capture the device-to-device copy read 2.4-2.6
        # TB/s where the same copy launched eagerly reads 3.0 / 4.2 (H100 / H200)
        graphs, self.clock.graphs = self.clock.graphs, False
        try:
            out = {"gemm_flops": self._peak_gemm(), "copy_bytes_per_s": self._peak_copy(),
                   "eager": True}
        finally:
            self.clock.graphs = graphs
        self._free()
        return out

    def _peak_gemm(self) -> float:
        N = self.grid.peak_gemm
        a, b = self._rand(N, N), self._rand(N, N)
        return 2 * N ** 3 / self._time(lambda _i: a @ b)

    def _peak_copy(self) -> float:
        el = DTYPE_BYTES[self.dtype_name]
        elems = self.grid.peak_copy_bytes // (2 * el)
        src = self._rand(elems)
        dst = self.torch.empty_like(src)
        return 2 * elems * el / self._time(lambda _i: dst.copy_(src))

    # ------------------------------------------------------------------ the whole grid
    def run(self, checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Every point of the grid. ``checkpoint`` gets the timings so far after each
        operator (``"complete": false``), so a run cut short on a lent machine keeps them."""
        g, m = self.grid, self.model
        records: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        att = g.attention_points(m.max_model_len)
        total = len(g.tokens) * (1 + bool(m.num_experts)) + len(att) \
            + len(g.logits_requests) + 1 + len(g.layers)
        done = 0

        def note(what: str) -> None:
            nonlocal done
            done += 1
            self.progress(f"[{done}/{total}] {what}")

        def result(complete: bool) -> dict[str, Any]:
            return {"format": FORMAT, "model": m.name, "model_spec": asdict(m),
                    "device": self.describe(), "dtype": self.dtype_name,
                    "dtype_bytes": DTYPE_BYTES[self.dtype_name], "moe_impl": self.moe_impl,
                    "peaks": peaks, "grid": asdict(g), "records": records,
                    "skipped_attention": skipped, "complete": complete,
                    "fa3_speedup_published": list(FA3_SPEEDUP),
                    # capture given up mid-run: every record after it is eager (its ``graph``)
                    "graphs_fell_back": self.clock.fallback}

        def saved() -> None:
            if checkpoint is not None:
                checkpoint(result(False))

        peaks = self.peaks()
        note("device peaks")
        def add(op: str, seconds: float, **where: Any) -> None:
            records.append(asdict(OpTiming(op, seconds, graph=self.clock.graphed, **where)))

        for t in g.tokens:
            add("projections", self.projections(t), tokens=t)
            note(f"projections T={t}")
        self._drop("projections")
        saved()
        if m.num_experts:
            for t in g.tokens:
                add("moe", self.moe(t), tokens=t)
                note(f"moe T={t}")
            self._drop("moe")
            saved()
        for b, n, c in att:
            s, gqa = self.attention(b, n, c)
            if isinstance(s, str):
                skipped.append({"requests": b, "new": n, "context": c, "why": s})
            else:
                add("attention", s, requests=b, new=n, context=c, gqa=gqa,
                    kernel=self.last_kernel)
            note(f"attention B={b} new={n} context={c}" + (f" (skipped: {s})"
                                                           if isinstance(s, str) else ""))
            saved()
        for r in g.logits_requests:
            add("logits", self.logits(r), requests=r)
            note(f"logits R={r}")
        self._drop("logits")
        saved()
        for b, n, c in g.layers:
            if c + n > m.max_model_len:
                continue
            try:
                add(LAYER, self.layer(b, n, c), requests=b, new=n, context=c,
                    tokens=b * n)
            except (RuntimeError, NotImplementedError) as exc:  # OOM
                skipped.append({"layer": True, "requests": b, "new": n, "context": c,
                                "why": f"{type(exc).__name__}: {str(exc)[:200]}"})
            note(f"layer B={b} new={n} context={c}")
            saved()
        return result(True)

    def describe(self) -> dict[str, Any]:
        torch = self.torch
        d: dict[str, Any] = {"type": self.device.type, "torch": torch.__version__,
                             "host": platform.node(), "cache_bytes": self.cache_bytes,
                             "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if self.device.type == "cuda":
            p = torch.cuda.get_device_properties(self.device)
            d.update(name=p.name, multiprocessors=p.multi_processor_count,
                     memory_bytes=p.total_memory, cuda=torch.version.cuda)
        else:
            d.update(name=platform.processor() or platform.machine(),
                     threads=torch.get_num_threads())
        return d


def build_parser(prog: str = "python -m mars.emulate.op_timing") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Time one layer's operators of a model's real shapes with "
        "PyTorch on this device (for `mars emulate fit-ops`). Minutes on an H100.")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="a shipped model (qwen3-coder-30b-a3b, gpt-oss-120b) or a config.json")
    p.add_argument("--out", required=True, metavar="FILE.json", help="timings to write")
    p.add_argument("--device", default="cuda", help="torch device (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES),
                   help="compute, weight and KV dtype (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a small grid (seconds on a small model; for a CPU and the tests)")
    p.add_argument("--dense", action="store_true",
                   help="the dense grid the shipped tables were measured on (189 points per "
                        "model; about a minute per model on an H100)")
    p.add_argument("--seed", type=int, default=0, help="routing and data seed")
    p.add_argument("--no-graphs", action="store_true",
                   help="launch eagerly on CUDA (default: replay the timed calls as a CUDA "
                        "graph, as vLLM runs decode steps)")


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix != ".json":
        raise SystemExit("--out must name a .json file")
    try:
        model = load_model(args.model)
        timer = OpTimer(model, args.device, args.dtype,
                        OpGrid.quick() if args.quick else
                        OpGrid.dense() if getattr(args, "dense", False) else OpGrid(),
                        args.seed,
                        progress=lambda msg: print(msg, file=sys.stderr, flush=True),
                        graphs=not args.no_graphs)
    except ValueError as exc:
        raise SystemExit(f"op timing: {exc}") from None
    big = largest_operands(model, timer.grid, DTYPE_BYTES[args.dtype], timer.cache_bytes)
    print(f"timing {model.name} on {args.device}: largest operand set {big / 2**30:.1f} GiB",
          file=sys.stderr, flush=True)
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(data: dict[str, Any]) -> None:
        # whole or not at all: a run killed mid-write keeps the last complete file
        data["elapsed_s"] = round(time.monotonic() - t0, 1)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, out)

    data = timer.run(checkpoint=write)
    write(data)
    print(f"{len(data['records'])} timings of {model.name} on {data['device'].get('name')} "
          f"in {data['elapsed_s']} s -> {out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(build_parser().parse_args()))
