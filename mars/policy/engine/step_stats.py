"""What the engine's own steps say about its speed: prefill throughput and decode step time.

Both are measured from step boundaries (the time from one ``schedule()`` to the next, with
the tokens the first one scheduled), never from a call's first schedule to its first token,
which would include queueing and batching. Steps without prefill give the decode step time.
Prefill-dominated steps (at least half the tokens are prefill, at least one block of them)
give the prefill rate as a *marginal* rate: the prefill tokens over the time they added to
the step, i.e. the step's time minus a decode step's. Every step pays a fixed cost (on a MoE
GPU model, reading the experts the batch touches) whether it carries a prefill chunk or not;
a rate of tokens over the whole step time would charge that cost to the prefill (and price
recomputation, :mod:`mars.policy.engine.retention`, by the size of the chunks that happened to run).
The coordinator charges bounded prefills the same added time. Both are EMAs of
their numerator and denominator separately, so a small, noisy step moves them less than a
large one; before the first sample they are ``None`` and nothing that reads them acts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class StepStats:
    alpha: float = 0.1
    #: smallest prefill (tokens) a step must carry to be a prefill sample
    min_prefill_tokens: int = 32
    _pf_tok: float = 0.0
    _pf_sec: float = 0.0
    _dec_sec: float = 0.0
    _dec_n: float = 0.0

    def observe(self, tokens: int, requests: int, seconds: float) -> tuple[int, float] | None:
        """One finished step: ``tokens`` scheduled for ``requests`` calls in ``seconds``.
        Returns ``(prefill tokens, seconds they added)`` when it was a prefill sample."""
        if seconds <= 0 or tokens <= 0:
            return None
        prefill = tokens - requests  # a decode adds 1 token, a prefill its chunk (≈ chunk - 1)
        a = self.alpha
        if prefill >= self.min_prefill_tokens and 2 * prefill >= tokens:
            # the time the prefill added over a decode step (all of it before one is known)
            added = seconds - self._dec_sec if self._dec_n else seconds
            if added <= 0:
                return None  # within a decode step's noise: says nothing about the rate
            if self._pf_sec == 0.0:
                self._pf_tok, self._pf_sec = float(prefill), added
            else:
                self._pf_tok += a * (prefill - self._pf_tok)
                self._pf_sec += a * (added - self._pf_sec)
            return prefill, added
        if prefill == 0:
            if self._dec_n == 0.0:
                self._dec_sec, self._dec_n = seconds, 1.0
            else:
                self._dec_sec += a * (seconds - self._dec_sec)
        return None

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self._pf_tok / self._pf_sec if self._pf_sec > 0 else None

    @property
    def decode_step_s(self) -> float | None:
        return self._dec_sec if self._dec_n else None


@dataclass(slots=True)
class DecodeCost:
    """A decode step's time against its batch: ``a + c x calls + b x context tokens``,
    fitted by least squares over recent decode steps (exponentially weighted).

    Why: one more session in the batch slows every call in it by what it adds to each step.
    How much that is, relative to the step, is what the control plane weighs against the
    door wait an earlier admission saves (:mod:`mars.policy.control.batch_cost`): at the
    batch's mean size and context, ``(c x calls + b x tokens) / step``, the share of the
    step that grows with the batch -- its elasticity in the number of calls, each call
    bringing the mean context. Two regressors because the step grows with both, by
    different mechanisms: each call's attention reads its own context (``b``), and an MoE
    touches more experts, and every call is sampled, per call whatever its context (``c``;
    on the emulated H100 NVL x Qwen3-Coder-30B the MoE layers take 2.5 ms at one call and
    9.1 ms at eight, ``mars emulate step``). Fitted on the context alone, the calls' part
    would go to the intercept wherever contexts vary more than the batch's size, and the
    share would be understated (0.42 where the step-time model gives 0.66, ILR-3). Where
    the two move together too closely to be told apart (a correlation above 0.99), the
    context's alone is used: when each call brings about the same context, either gives
    about the same share at the mean (exactly, when the context is proportional to the
    calls); the split between them is not identified there.

    Fitted, never assumed: on an emulated GPU it reads the step-time model, on hardware the
    steps' wall time. The EMA's memory (``alpha``) is long against a step (1/alpha steps,
    ~15 s of decoding at 15 ms a step) because the batch changes slowly: a short one would
    see no spread to fit a slope to. ``min_steps`` samples before it answers."""

    alpha: float = 0.001
    min_steps: int = 64
    _n: int = 0
    #: EMA means of calls (u), context tokens (x) and seconds (y), and their covariances
    _mu: float = 0.0
    _mx: float = 0.0
    _my: float = 0.0
    _cuu: float = 0.0
    _cxx: float = 0.0
    _cux: float = 0.0
    _cuy: float = 0.0
    _cxy: float = 0.0

    def observe(self, calls: int, context_tokens: int, seconds: float) -> None:
        """One decode step (no prefill in it) of ``calls`` reading ``context_tokens``."""
        if not (seconds > 0 and math.isfinite(seconds)) or context_tokens < 0 or calls < 1:
            return
        u, x, y = float(calls), float(context_tokens), seconds
        a = max(self.alpha, 1.0 / (self._n + 1))  # a plain mean until 1/alpha samples
        du, dx, dy = u - self._mu, x - self._mx, y - self._my
        self._mu += a * du
        self._mx += a * dx
        self._my += a * dy
        k = 1 - a
        self._cuu = k * (self._cuu + a * du * du)
        self._cxx = k * (self._cxx + a * dx * dx)
        self._cux = k * (self._cux + a * du * dx)
        self._cuy = k * (self._cuy + a * du * dy)
        self._cxy = k * (self._cxy + a * dx * dy)
        self._n += 1

    @property
    def mean_calls(self) -> float:
        return self._mu

    @property
    def mean_tokens(self) -> float:
        """The decode steps' context, averaged over the fit's memory."""
        return self._mx

    def fit(self) -> tuple[float, float, float] | None:
        """``(a, c, b)``: seconds of an empty step, per call and per context token; None
        before ``min_steps`` steps or while neither has varied."""
        if self._n < self.min_steps:
            return None
        uu, xx, ux = self._cuu, self._cxx, self._cux
        det = uu * xx - ux * ux
        # 1 - correlation^2 = det / (uu xx): told apart while the correlation is below 0.99
        if uu > 0 and xx > 0 and det > (1 - 0.99 ** 2) * uu * xx:
            c = (self._cuy * xx - self._cxy * ux) / det
            b = (self._cxy * uu - self._cuy * ux) / det
            if c < 0 or b < 0:  # noise, or one of them explains nothing: the other alone
                c, b = (0.0, max(0.0, self._cxy / xx)) if c < 0 else \
                    (max(0.0, self._cuy / uu), 0.0)
        elif xx > 0:
            c, b = 0.0, max(0.0, self._cxy / xx)
        elif uu > 0:
            c, b = max(0.0, self._cuy / uu), 0.0
        else:
            return None
        return max(0.0, self._my - c * self._mu - b * self._mx), c, b

    def batch_share(self, calls: float | None = None,
                    context_tokens: float | None = None) -> float | None:
        """The share of a decode step of ``calls`` over ``context_tokens`` that grows with
        the batch, in [0, 1]; None while unfitted. Default: at the decode steps' means over
        the fit's memory, not the latest step's -- a session admitted now joins the batch
        its peers make when they are in the engine, and at an instant between their rounds
        (the engine idle, every session in a tool) that batch is not empty but paused."""
        f = self.fit()
        if f is None:
            return None
        a, c, b = f
        u = self._mu if calls is None else calls
        grow = c * u + b * (self._mx if context_tokens is None else context_tokens)
        return grow / (a + grow) if a + grow > 0 else 0.0
