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
