"""MARS's retention rule: keep a finished round's KV pinned across its tool call only while the
expected warm-resume benefit outweighs the price of the memory it holds (paper §4.3,
Opportunistic Co-Scheduler).

The paper models retention as "a run-time decision between two quantities: the benefit of a
warm resume if the tool returns soon, and the opportunity cost of holding memory that could
otherwise be reused". Baselines (InferCept, Continuum) decide once, when the tool is called;
MARS re-evaluates while the tool runs, so a pin taken when memory was free is dropped when a
burst arrives, and a tool that has outlived its peers stops holding memory.

Rule (``CostBenefitRetention``), for a candidate with ``B`` blocks and ``C`` context tokens::

    R          = C / prefill_tokens_per_s                       # recompute time, s
    spoken     = (total - free + waiting_demand) / total
    rho        = min(rho_cap, max(0, spoken - free_knee) / (1 - free_knee))
    price      = price_scale * (rho / (1 - rho)) ** pressure_exponent / total   # per block-s
    net(tau)   = P(D <= tau) * R  -  B * tau * price
    tau*       = argmax_{tau in grid, tau <= max_tau_s} net(tau)   (0 if no net(tau) > 0)

``keep`` uses the conditional probability given the tool has already run ``e`` seconds,
``P(D <= e + x | D > e)``, over the remaining horizon ``x <= tau* - e`` and the *current*
price; it returns False once no horizon has a positive net, or ``tau*`` has passed.

Why this price: ``spoken`` is the fraction of the pool that is spoken for (in use, pinned, or
wanted by queued calls). Below ``free_knee`` the free pool covers every demand with margin, so
a held block delays nobody and costs nothing; above it ``rho`` rescales the remaining headroom
to [0, 1) and ``rho/(1-rho)`` is ~0 just past the knee, 1 half-way to full, and diverges as
free blocks run out or as queued demand approaches the free blocks -- the usual congestion
shape. Dividing by ``total`` makes ``price_scale`` a per-pool quantity: holding the whole pool
for one second at ``rho = 0.5`` costs ``price_scale`` seconds of others' latency. Because both
``R`` and the cost are linear in the context size, the decision reduces to
``P(tau) * T_pool > tau * price_scale * g(rho)`` with ``T_pool = pool tokens / prefill rate``,
so it behaves the same on a 100K-block H100 pool and a 2K-block CPU pool.

With a host tier (vLLM's offloading stores every computed block to host memory and loads a
released context back on its next round's prefix hit), a release no longer means a
recompute: ``R`` becomes the cheaper of the recompute and the read over the host link
(``tokens x KV bytes per token / measured copy rate`` for what the host holds -- the
prompt's whole blocks, as vLLM stores by default -- plus the recompute of the rest,
:class:`~mars.policy.engine.base.HostTier`), so the rule pins only what is worth more than
that -- on a pool under
pressure, little. This is the two-place rule over three places with the read-back at the
return (vLLM's load on hit); reading back *before* the return is
:mod:`mars.policy.engine.host_tier`'s.

Contract with the adapter: the :class:`KvPressure` passed to ``admit`` and ``keep`` describes
the pool with the candidate's own blocks *held* (not free): at ``admit`` its round has just
finished and its blocks are not yet released, and while pinned they are pinned.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections import deque
from dataclasses import dataclass

from mars.policy.engine.base import (KvPressure, MeasuredRate, PinCandidate,
                                     RetentionPolicy, reload_s)

ALL_TOOLS = "*"


class ToolDurationModel:
    """Empirical tool-duration distributions, per tool type and over all tools.

    Memory is bounded: the last ``max_samples`` durations per tool and the last
    ``4 * max_samples`` over all tools. A tool with fewer than ``min_samples`` samples borrows
    the all-tool distribution; if that has fewer than ``min_samples`` too, the prior is used:
    an exponential distribution with mean ``prior_mean_s``. The prior is memoryless, so its
    conditional return probability does not change as a tool keeps running -- it claims no
    knowledge it does not have.
    """

    def __init__(self, max_samples: int = 512, min_samples: int = 8,
                 prior_mean_s: float = 5.0) -> None:
        if max_samples < 1 or min_samples < 1 or prior_mean_s <= 0:
            raise ValueError("max_samples, min_samples and prior_mean_s must be positive")
        self.max_samples = max_samples
        self.min_samples = min_samples
        self.prior_mean_s = prior_mean_s
        self._samples: dict[str, deque[float]] = {ALL_TOOLS: deque(maxlen=4 * max_samples)}
        #: the same samples kept sorted (updated in place: a round ends on every few engine
        #: steps under load, and re-sorting on each query showed in the step time)
        self._sorted: dict[str, list[float]] = {ALL_TOOLS: []}

    # ------------------------------------------------------------------ feeding
    def observe(self, tool: str | None, duration_s: float) -> None:
        if duration_s is None or not math.isfinite(duration_s) or duration_s < 0:
            return
        d = float(duration_s)
        key = tool or None
        if key is not None and key != ALL_TOOLS:
            dq = self._samples.get(key)
            if dq is None:
                dq = self._samples[key] = deque(maxlen=self.max_samples)
                self._sorted[key] = []
            self._add(dq, self._sorted[key], d)
        self._add(self._samples[ALL_TOOLS], self._sorted[ALL_TOOLS], d)

    @staticmethod
    def _add(dq: deque[float], srt: list[float], d: float) -> None:
        if dq.maxlen is not None and len(dq) == dq.maxlen:
            old = dq[0]
            del srt[bisect_left(srt, old)]
        dq.append(d)
        insort(srt, d)

    # ------------------------------------------------------------------ queries
    def count(self, tool: str | None = None) -> int:
        """Samples held for ``tool`` (``None``: over all tools)."""
        dq = self._samples.get(tool if tool else ALL_TOOLS)
        return len(dq) if dq is not None else 0

    def source(self, tool: str | None, min_samples: int | None = None) -> str:
        """Which distribution answers for ``tool``: ``"tool"``, ``"all"`` or ``"prior"``."""
        m = self.min_samples if min_samples is None else min_samples
        if tool and tool != ALL_TOOLS and self.count(tool) >= m:
            return "tool"
        if self.count(None) >= m:
            return "all"
        return "prior"

    def prob_within(self, tool: str | None, t: float, min_samples: int | None = None) -> float:
        """P(D <= t) for the tool (empirical CDF, with the fallbacks described above)."""
        if t < 0:
            return 0.0
        src = self.source(tool, min_samples)
        if src == "prior":
            return 1.0 - math.exp(-t / self.prior_mean_s)
        s = self._sorted_samples(tool if src == "tool" else ALL_TOOLS)
        return bisect_right(s, t) / len(s)

    def prob_returns_within(self, tool: str | None, elapsed: float, extra: float,
                            min_samples: int | None = None) -> float:
        """P(D <= elapsed + extra | D > elapsed): the tool has run ``elapsed`` s already.

        If every observed duration is <= ``elapsed`` the empirical survival is 0; the tool has
        outlived all its peers and we answer 0 (it is an outlier, do not bet memory on it).
        """
        if extra <= 0:
            return 0.0
        if elapsed <= 0:
            return self.prob_within(tool, extra, min_samples)
        src = self.source(tool, min_samples)
        if src == "prior":
            return 1.0 - math.exp(-extra / self.prior_mean_s)
        s = self._sorted_samples(tool if src == "tool" else ALL_TOOLS)
        n = len(s)
        done = bisect_right(s, elapsed)
        alive = n - done
        if alive <= 0:
            return 0.0
        return (bisect_right(s, elapsed + extra) - done) / alive

    def mean(self, tool: str | None, min_samples: int = 1) -> float:
        """Running mean duration (tool, else all tools, else the prior mean)."""
        src = self.source(tool, min_samples)
        if src == "prior":
            return self.prior_mean_s
        dq = self._samples[tool if src == "tool" else ALL_TOOLS]
        return sum(dq) / len(dq)

    def _sorted_samples(self, key: str) -> list[float]:
        return self._sorted[key]

    def sorted_samples(self, tool: str | None) -> list[float]:
        """The durations held for ``tool`` (``None``: all tools), ascending (do not modify)."""
        return self._sorted.get(tool if tool else ALL_TOOLS, [])


class PrefillRate(MeasuredRate):
    """Prefill throughput, used to price recomputation of a context: the configured rate is
    only a guess, the first measured prefill replaces it, later ones are smoothed
    (:class:`~mars.policy.engine.base.MeasuredRate`)."""

    def __init__(self, tokens_per_s: float, alpha: float = 0.2) -> None:
        if tokens_per_s <= 0 or not 0 < alpha <= 1:
            raise ValueError("tokens_per_s must be > 0 and 0 < alpha <= 1")
        super().__init__(tokens_per_s, alpha)

    @property
    def tokens_per_s(self) -> float:
        return self.per_s

    def recompute_s(self, tokens: int) -> float:
        return max(0, tokens) / self.per_s


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Knobs of MARS's cost/benefit retention rule (see the module docstring)."""

    #: initial prefill throughput guess; the adapter refines it with ``observe_prefill``
    prefill_tokens_per_s: float = 10_000.0
    prefill_ema_alpha: float = 0.2
    #: seconds of others' latency that holding the whole pool for 1 s costs at rho = 0.5
    price_scale: float = 1.0
    #: steepness of the congestion price
    pressure_exponent: float = 2.0
    #: rho is clamped here so the price stays finite (at 0.99 it is ~9.8e3 x price_scale)
    rho_cap: float = 0.99
    #: fraction of the pool that may be spoken for before holding memory costs anything
    free_knee: float = 0.5
    #: candidate pin durations, seconds
    tau_grid_s: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
    max_tau_s: float = 60.0
    #: tool-duration model
    min_samples: int = 8
    max_samples: int = 512
    prior_mean_s: float = 5.0
    #: when vLLM offloads to host memory, price a release as the read back over the host
    #: link (False: as a recompute, the two-place rule blind to the host tier; an ablation)
    host_tier: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.host_tier, bool):
            raise ValueError(f"host_tier must be true or false, got {self.host_tier!r}")
        if not self.tau_grid_s or min(self.tau_grid_s) <= 0:
            raise ValueError("tau_grid_s must hold positive durations")
        if not 0 < self.rho_cap < 1:
            raise ValueError("rho_cap must be in (0, 1)")


def block_price(kv: KvPressure, price_scale: float, exponent: float, rho_cap: float,
                free_knee: float = 0.0) -> float:
    """Price of holding one block for one second, in seconds of benefit (module docstring)."""
    total = kv.total_blocks
    if total <= 0:
        return math.inf
    spoken = (total - kv.free_blocks + max(0, kv.waiting_demand_blocks)) / total
    rho = (spoken - free_knee) / (1.0 - free_knee)
    if rho <= 0:
        return 0.0
    rho = min(rho, rho_cap)
    return price_scale * (rho / (1.0 - rho)) ** exponent / total


@dataclass(slots=True)
class _PinDecision:
    tau: float
    started: float


class CostBenefitRetention(RetentionPolicy):
    """The MARS retention policy (``--policy mars``). See the module docstring for the rule."""

    name = "mars"

    def __init__(self, config: RetentionConfig | None = None,
                 durations: ToolDurationModel | None = None) -> None:
        self.config = cfg = config or RetentionConfig()
        self.durations = durations or ToolDurationModel(
            cfg.max_samples, cfg.min_samples, cfg.prior_mean_s)
        self.prefill = PrefillRate(cfg.prefill_tokens_per_s, cfg.prefill_ema_alpha)
        self._grid = tuple(sorted({t for t in cfg.tau_grid_s if t < cfg.max_tau_s}
                                  | {cfg.max_tau_s}))
        self._pins: dict[str, _PinDecision] = {}

    # ------------------------------------------------------------------ feeding
    def prices_host_tier(self) -> bool:
        return self.config.host_tier

    def miss_s(self, cand: PinCandidate) -> float:
        """What a released context costs its next round: the recompute, or, when cheaper,
        the read back from host memory of what the host holds and the recompute of the
        rest (vLLM stores prompts: the round's output is recomputed)."""
        return reload_s(self.host, cand, self.prefill.recompute_s)

    def observe_tool(self, tool: str | None, duration_s: float) -> None:
        self.durations.observe(tool, duration_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A measured prefill (tokens computed, wall seconds) refines the recompute estimate."""
        self.prefill.observe(tokens, seconds)

    # ------------------------------------------------------------------ rule
    def price(self, kv: KvPressure) -> float:
        cfg = self.config
        return block_price(kv, cfg.price_scale, cfg.pressure_exponent, cfg.rho_cap,
                           cfg.free_knee)

    def net_gain(self, cand: PinCandidate, kv: KvPressure, tau: float,
                 elapsed: float = 0.0) -> float:
        """Expected benefit minus cost of holding ``cand`` for ``tau`` more seconds."""
        return self._net(cand, tau, elapsed, self.miss_s(cand),
                         cand.blocks * self.price(kv))

    def _net(self, cand: PinCandidate, tau: float, elapsed: float, recompute_s: float,
             hold_per_s: float) -> float:
        p = self.durations.prob_returns_within(cand.tool, elapsed, tau)
        return p * recompute_s - hold_per_s * tau

    def best_tau(self, cand: PinCandidate, kv: KvPressure, elapsed: float = 0.0,
                 horizon: float | None = None) -> tuple[float, float]:
        """(tau, net) maximising the net gain (ties: the shorter tau); (0, 0) if none is > 0.

        At admission (``horizon`` None) the candidates are the grid up to ``max_tau_s``. While
        the tool runs, ``horizon`` is what is left of the pin: the candidates are the grid
        points below it plus the horizon itself, so the whole remaining pin is always judged.
        """
        if horizon is None:
            cands = self._grid
        else:
            cands = [t for t in self._grid if t < horizon]
            cands.append(horizon)
        # net_gain(tau) for every candidate, with what does not depend on tau computed once
        recompute = self.miss_s(cand)
        hold = cand.blocks * self.price(kv)
        best_tau, best_net = 0.0, 0.0
        for tau in cands:
            net = self._net(cand, tau, elapsed, recompute, hold)
            if net > best_net:
                best_tau, best_net = tau, net
        return best_tau, best_net

    # ------------------------------------------------------------------ contract
    def admit(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        self._prune(now)
        if cand.blocks <= 0:
            return 0.0
        tau, _ = self.best_tau(cand, kv)
        if tau > 0:
            self._pins[cand.session_id] = _PinDecision(tau, cand.started)
        else:
            self._pins.pop(cand.session_id, None)
        return tau

    def keep(self, cand: PinCandidate, kv: KvPressure, now: float) -> bool:
        pin = self._pins.get(cand.session_id)
        tau = pin.tau if pin is not None else self.config.max_tau_s
        elapsed = max(0.0, now - cand.started)
        remaining = tau - elapsed
        if remaining <= 0:
            self._pins.pop(cand.session_id, None)
            return False
        _, net = self.best_tau(cand, kv, elapsed=elapsed, horizon=remaining)
        if net <= 0:
            self._pins.pop(cand.session_id, None)
            return False
        return True

    def reclaim_rank(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        """The pin's best net gain over what is left of it: the least valuable goes first."""
        pin = self._pins.get(cand.session_id)
        tau = pin.tau if pin is not None else self.config.max_tau_s
        elapsed = max(0.0, now - cand.started)
        if tau - elapsed <= 0:
            return -math.inf
        return self.best_tau(cand, kv, elapsed=elapsed, horizon=tau - elapsed)[1]

    def tau_of(self, session_id: str) -> float | None:
        """The pin duration decided at ``admit`` (None if not pinned by this policy)."""
        pin = self._pins.get(session_id)
        return pin.tau if pin is not None else None

    def forget(self, session_id: str) -> None:
        """The adapter released the pin (next round arrived, memory needed)."""
        self._pins.pop(session_id, None)

    def _prune(self, now: float) -> None:
        if len(self._pins) > 64:
            dead = [s for s, p in self._pins.items() if p.started + p.tau <= now]
            for s in dead:
                del self._pins[s]
