"""The paper's baselines (§6.2), as policies behind the same contracts as MARS.

Each class reimplements the published *rule* on the information a CallView / PinCandidate /
KvPressure carries, so every system runs inside the same modified vLLM with the same batch
limits (the paper's fairness condition). Where a paper leaves a detail open, the class
docstring says what was chosen.

* :class:`AutellixPLAS` -- Autellix (Luo et al., arXiv 2502.13965): program-level
  least-attained-service ordering.
* :class:`InferceptRetention` -- InferCept (Abhyankar et al., ICML 2024): min-waste
  preserve-vs-discard at each tool boundary.
* :class:`ContinuumRetention` -- Continuum (Li et al., arXiv 2511.02230), fixed TTL.
* :class:`ContinuumDyRetention` -- Continuum's dynamic TTL heuristic.
* :class:`ProgramFCFS` -- Continuum's program-level first-come-first-serve order.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass

from mars.policy.engine.base import (CallView, KvPressure, OrderingPolicy, PinCandidate,
                                     RetentionPolicy, reload_s)
from mars.policy.engine.retention import PrefillRate, ToolDurationModel

# ====================================================================== Autellix PLAS


@dataclass(frozen=True, slots=True)
class PLASConfig:
    """Autellix PLAS knobs. Autellix measures attained service in time; we count tokens (the
    quantity our engine reports per step) for the queue position and keep seconds for the
    starvation ratio, which compares two times."""

    #: number of discretised queues K (queue 0 is served first)
    num_queues: int = 8
    #: service quantum of queue 0 in tokens; queue i has quantum_tokens * quantum_growth**i
    quantum_tokens: int = 4096
    quantum_growth: float = 2.0
    #: anti-starvation: a program whose waiting time / service time >= beta goes to queue 0
    beta: float = 4.0
    #: service time floor in the ratio, seconds (a program never served has ratio W/this)
    min_service_s: float = 0.05
    #: a step is credited as the time since the previous step, capped here (idle gaps are not
    #: service) and defaulting to default_step_s for the first step
    max_step_s: float = 0.5
    default_step_s: float = 0.05

    def __post_init__(self) -> None:
        if self.num_queues < 1 or self.quantum_tokens < 1 or self.quantum_growth < 1:
            raise ValueError("num_queues >= 1, quantum_tokens >= 1, quantum_growth >= 1")
        if self.beta <= 0:
            raise ValueError("beta must be > 0")


class _Program:
    __slots__ = ("service_tokens", "service_s", "wait_done_s", "live")

    def __init__(self) -> None:
        self.service_tokens = 0
        self.service_s = 0.0
        self.wait_done_s = 0.0
        self.live = 0


class _PlasCall:
    __slots__ = ("program", "arrival", "service_s")

    def __init__(self, program: str, arrival: float) -> None:
        self.program = program
        self.arrival = arrival
        self.service_s = 0.0


class AutellixPLAS(OrderingPolicy):
    """Program-level least-attained-service (``--policy autellix``).

    A call's queue is decided by the attained service of its whole *program* (the agent
    session, ``session_id``): the tokens computed for all its calls so far, across rounds,
    kept after a round finishes. Queue ``i`` holds programs whose service lies between the
    sums of the first ``i`` and ``i+1`` quanta, so a program is demoted each time it uses up
    a queue's quantum; calls are FCFS (call arrival) inside a queue.

    Anti-starvation (Autellix §4): a call is placed in queue 0 while its program's
    ``W / T >= beta``, where ``W`` is the program's total waiting time (time its calls spent
    in the engine without being scheduled: finished calls plus the current one) and ``T`` its
    total service time (wall time of the engine steps in which its calls had tokens
    scheduled). The boost therefore lasts until the program's service catches up with its
    waiting, with no separate reset rule.

    Choices where the paper is open: service counted in tokens for the queues (the engine's
    unit), the step-time estimate of ``T`` (see :class:`PLASConfig`), and a call without a
    session being its own one-call program.
    """

    name = "autellix"

    def __init__(self, config: PLASConfig | None = None) -> None:
        self.config = cfg = config or PLASConfig()
        acc, bounds = 0.0, []
        for i in range(cfg.num_queues - 1):
            acc += cfg.quantum_tokens * cfg.quantum_growth**i
            bounds.append(acc)
        #: queue i holds service in [bounds[i-1], bounds[i])
        self._bounds = tuple(bounds)
        self._programs: dict[str, _Program] = {}
        self._calls: dict[str, _PlasCall] = {}
        self._last_step: float | None = None
        self._step_dt = cfg.default_step_s

    def queue_of_service(self, service_tokens: int) -> int:
        return bisect_right(self._bounds, service_tokens)

    def program_service(self, session_id: str) -> int:
        prog = self._programs.get(session_id)
        return prog.service_tokens if prog is not None else 0

    def starvation_ratio(self, call: CallView, now: float) -> float:
        pid = call.session_id or call.request_id
        prog = self._programs.get(pid)
        st = self._calls.get(call.request_id)
        cur_wait = now - call.arrival_time - (st.service_s if st is not None else 0.0)
        w = (prog.wait_done_s if prog is not None else 0.0) + max(0.0, cur_wait)
        t = prog.service_s if prog is not None else 0.0
        return w / max(t, self.config.min_service_s)

    def key(self, call: CallView, now: float) -> tuple:
        pid = call.session_id or call.request_id
        prog = self._programs.get(pid)
        if prog is None or prog.service_tokens == 0:
            return (0, call.arrival_time)
        q = bisect_right(self._bounds, prog.service_tokens)
        if q and self.starvation_ratio(call, now) >= self.config.beta:
            q = 0
        return (q, call.arrival_time)

    def on_scheduled(self, call: CallView, tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        cfg = self.config
        if self._last_step is None:
            self._last_step = now
        elif now > self._last_step:
            self._step_dt = min(now - self._last_step, cfg.max_step_s)
            self._last_step = now
        pid = call.session_id or call.request_id
        prog = self._programs.get(pid)
        if prog is None:
            prog = self._programs[pid] = _Program()
        st = self._calls.get(call.request_id)
        if st is None:
            st = self._calls[call.request_id] = _PlasCall(pid, call.arrival_time)
            prog.live += 1
        prog.service_tokens += tokens
        prog.service_s += self._step_dt
        st.service_s += self._step_dt

    def on_finished(self, request_id: str, session_id: str | None, now: float) -> None:
        st = self._calls.pop(request_id, None)
        if st is None:
            return
        prog = self._programs.get(st.program)
        if prog is None:
            return
        prog.wait_done_s += max(0.0, now - st.arrival - st.service_s)
        prog.live -= 1
        if session_id is None and prog.live <= 0:
            # a session-less call is its own program; nothing will resume it
            self._programs.pop(st.program, None)

    def on_session_end(self, session_id: str, now: float) -> None:
        """The session ended for good; drop its attained service."""
        self._programs.pop(session_id, None)

    @property
    def num_programs(self) -> int:
        """Programs whose attained service is kept (bounded by live sessions)."""
        return len(self._programs)


# ====================================================================== Continuum's order


class ProgramFCFS(OrderingPolicy):
    """Continuum's program-level first-come-first-serve (``--policy continuum`` and
    ``continuum_dy``): calls are ordered by the arrival of their *program's* first call (the
    agent session), then by their own arrival, so a returning multi-turn program keeps its
    place instead of queueing behind programs that started after it. A call without a session
    is its own program. The adapter serves the order front to back and preempts from the back
    (the newest program first), as vLLM's FCFS does with request arrival.

    Choice where the paper is open: a program's first arrival is remembered until its session
    ends (``last_round``), or for ``forget_after_s`` after its latest call (sessions that never
    say they ended must not grow the table for ever).
    """

    name = "program_fcfs"

    def __init__(self, forget_after_s: float = 3600.0) -> None:
        self.forget_after_s = forget_after_s
        #: session -> (first arrival, latest arrival)
        self._programs: dict[str, list[float]] = {}

    def key(self, call: CallView, now: float) -> tuple:
        sid = call.session_id
        if sid is None:
            return (call.arrival_time, call.arrival_time)
        prog = self._programs.get(sid)
        if prog is None:
            prog = self._programs[sid] = [call.arrival_time, call.arrival_time]
            if len(self._programs) > 4096:
                self._prune(now)
        elif call.arrival_time > prog[1]:
            prog[1] = call.arrival_time
        return (prog[0], call.arrival_time)

    def horizon(self, call: CallView, now: float) -> tuple[float, float]:
        return math.inf, math.inf  # a call's key never changes

    def on_session_end(self, session_id: str, now: float) -> None:
        self._programs.pop(session_id, None)

    @property
    def num_programs(self) -> int:
        return len(self._programs)

    def _prune(self, now: float) -> None:
        cutoff = now - self.forget_after_s
        for sid in [s for s, (_, last) in self._programs.items() if last < cutoff]:
            del self._programs[sid]


# ====================================================================== one-shot retention


class _OneShotRetention(RetentionPolicy):
    """Retention decided once at admit; ``keep`` only checks the pin has not expired."""

    name = "oneshot"

    def __init__(self, durations: ToolDurationModel, prefill: PrefillRate) -> None:
        self.durations = durations
        self.prefill = prefill
        #: session -> time the pin expires (started + tau)
        self._deadline: dict[str, float] = {}

    def decide(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        raise NotImplementedError

    def admit(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        if len(self._deadline) > 256:
            # entries of pins the adapter released early (next round, pressure) without telling
            for sid in [s for s, d in self._deadline.items() if d <= now]:
                del self._deadline[sid]
        tau = max(0.0, float(self.decide(cand, kv, now))) if cand.blocks > 0 else 0.0
        if tau > 0:
            self._deadline[cand.session_id] = cand.started + tau
        else:
            self._deadline.pop(cand.session_id, None)
        return tau

    def keep(self, cand: PinCandidate, kv: KvPressure, now: float) -> bool:
        deadline = self._deadline.get(cand.session_id)
        if deadline is None:
            return False
        if now < deadline:
            return True
        self._deadline.pop(cand.session_id, None)
        return False

    def observe_tool(self, tool: str | None, duration_s: float) -> None:
        self.durations.observe(tool, duration_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill.observe(tokens, seconds)

    def forget(self, session_id: str) -> None:
        self._deadline.pop(session_id, None)


# ---------------------------------------------------------------------- InferCept


@dataclass(frozen=True, slots=True)
class InferceptConfig:
    prefill_tokens_per_s: float = 10_000.0
    prefill_ema_alpha: float = 0.2
    #: cap on the break-even pin (InferCept has none; inf reproduces it)
    max_tau_s: float = math.inf
    #: expected duration of a tool never seen, when no tool has been seen either
    prior_mean_s: float = 5.0
    max_samples: int = 512
    #: InferCept's third option, swap, when the engine has a host tier (vLLM's KV
    #: offloading); False: discard or preserve only, as without one
    swap: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.swap, bool):
            raise ValueError(f"swap must be true or false, got {self.swap!r}")


class InferceptRetention(_OneShotRetention):
    """InferCept's min-waste rule (``--policy infercept``), decided once per tool call.

    Waste is memory x time. Preserving holds the context's ``B`` blocks for the tool's
    duration: ``W_preserve = B * E[D]``. Discarding means recomputing the context on return,
    which takes ``R = context_tokens / prefill rate`` during which the context's blocks *and*
    the co-running batch's blocks ``B_batch`` are tied up: ``W_discard = R * (B + B_batch)``.
    Preserve iff ``W_preserve <= W_discard`` i.e. ``E[D] <= tau_be`` with the break-even
    retention time ``tau_be = W_discard / B = R * (B + B_batch) / B``; pin for ``tau_be``.

    ``E[D]`` is the running mean of the tool's observed durations (all tools' if the tool was
    never seen, ``prior_mean_s`` if nothing was). ``B_batch = total - free - pinned - B``
    (the candidate's blocks are still held at admit).

    Swap, InferCept's third option, when the engine offloads to host memory
    (:meth:`attach_host_tier`; ``swap``): the paper charges a swap the time it stalls the
    running batch, ``2 T_swap(C_i) C_batch``, because vLLM's swaps then ran on the compute
    stream. vLLM 0.32's offloading copies on a stream of its own and stores each prompt's
    blocks as they are computed, so nothing waits for the write and only the returning
    request waits for its read: ``W_swap = T_read(held) * B + R(rest) * (B + B_batch)``,
    where ``held`` is what the host holds of the context (vLLM stores prompts: the round's
    output is recomputed, a discard's waste). Preserve iff ``W_preserve`` is the least of
    the three, pinned for ``min(W_discard, W_swap) / B``; otherwise the blocks are released
    and vLLM loads what the host holds on the next round's prefix hit (swap) or it is
    recomputed (discard): both are a release here.
    """

    name = "infercept"

    def __init__(self, config: InferceptConfig | None = None,
                 durations: ToolDurationModel | None = None) -> None:
        self.config = cfg = config or InferceptConfig()
        super().__init__(durations or ToolDurationModel(cfg.max_samples, 1, cfg.prior_mean_s),
                         PrefillRate(cfg.prefill_tokens_per_s, cfg.prefill_ema_alpha))

    def prices_host_tier(self) -> bool:
        return self.config.swap

    def break_even_s(self, cand: PinCandidate, kv: KvPressure) -> float:
        """The pin that wastes what the cheaper of discard and swap would."""
        own = max(1, cand.blocks)
        batch = max(0, kv.total_blocks - kv.free_blocks - kv.pinned_blocks - cand.blocks)
        ctx = cand.context_tokens
        waste = self.prefill.recompute_s(ctx) * (own + batch)  # discard
        host = self.host
        if host is not None:
            held = host.held_tokens(ctx, cand.prompt_tokens)
            swap = (host.read_s(held) * own
                    + self.prefill.recompute_s(ctx - held) * (own + batch))
            waste = min(waste, swap)
        return waste / own

    def decide(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        tau_be = self.break_even_s(cand, kv)
        expected = self.durations.mean(cand.tool, min_samples=1)
        if expected <= tau_be:
            return min(tau_be, self.config.max_tau_s)
        return 0.0


# ---------------------------------------------------------------------- Continuum


@dataclass(frozen=True, slots=True)
class ContinuumConfig:
    ttl_s: float = 2.0
    #: pin only tools whose running mean duration is <= this
    threshold_s: float = 2.0
    #: pin when nothing at all has been observed yet (Continuum pins by default)
    pin_unknown: bool = True
    max_samples: int = 512


class ContinuumRetention(_OneShotRetention):
    """Continuum with a fixed time-to-live (``--policy continuum``), as the MARS paper ran it.

    Pin for ``ttl_s`` when the tool's running mean duration is <= ``threshold_s``, else do not
    pin. A tool never seen is judged by the all-tool mean; before any tool has returned the
    round is pinned (``pin_unknown``), matching Continuum's pin-by-default behaviour. Release
    at TTL expiry (``keep``), on the next round or under memory pressure (the adapter).
    """

    name = "continuum"

    def __init__(self, config: ContinuumConfig | None = None,
                 durations: ToolDurationModel | None = None) -> None:
        self.config = cfg = config or ContinuumConfig()
        super().__init__(durations or ToolDurationModel(cfg.max_samples, 1),
                         PrefillRate(10_000.0))

    def decide(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        cfg = self.config
        if self.durations.count(None) == 0:
            return cfg.ttl_s if cfg.pin_unknown else 0.0
        return cfg.ttl_s if self.durations.mean(cand.tool, min_samples=1) <= cfg.threshold_s \
            else 0.0


# ---------------------------------------------------------------------- Continuum-Dy


@dataclass(frozen=True, slots=True)
class ContinuumDyConfig:
    #: mean of the exponential tool-duration prior while fewer than min_samples durations
    #: (all tools) have been seen (the cold start)
    cold_mean_s: float = 1.0
    #: samples needed to trust a CDF (per tool; all tools for leaving the cold start)
    min_samples: int = 100
    max_samples: int = 512
    prefill_tokens_per_s: float = 10_000.0
    prefill_ema_alpha: float = 0.2
    #: eta before two distinct (done, left) pairs exist
    default_eta: float = 1.0
    #: T-bar before any post-eviction queueing delay was observed
    default_queue_delay_s: float = 0.0
    #: with a host tier (vLLM's KV offloading), ``reload(r)`` is the cheaper of recomputing
    #: the context and reading back what the host holds (the paper: "the potential cost of
    #: recomputation or reloading (if CPU offloading enabled)"); False: recompute only
    offload: bool = True
    queue_delay_samples: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.offload, bool):
            raise ValueError(f"offload must be true or false, got {self.offload!r}")


class ContinuumDyRetention(_OneShotRetention):
    """Continuum's dynamic TTL (``--policy continuum_dy``), decided once at admit::

        tau* = argmax_{tau in {0} U C}  P(D_f <= tau) * (T_bar * eta + reload(r)) - tau

    ``P`` is the empirical CDF of tool ``f``'s durations (the all-tool CDF while ``f`` has
    fewer than ``min_samples``) and ``C`` the distinct observed durations of that CDF (where
    the empirical CDF steps; any other tau scores less than the sample below it); ``T_bar`` the
    mean queueing delay a call suffered after its KV was evicted (``observe_queue_delay``);
    ``reload(r)`` the recompute time of the context (``context_tokens / prefill rate``), or,
    when the engine offloads to host memory (:meth:`attach_host_tier`; ``offload``), the
    read back of what the host holds and the recompute of the rest if that is cheaper, as
    the paper prices a reload "if CPU offloading [is] enabled";
    ``eta = -corr(turns done, turns left)`` over the (done, left) pairs ``(d, T-d), d = 1..T``
    of every finished session of ``T`` turns (``observe_session``), clamped to [0, 1] (a
    positive correlation would mean "more done, more left", which gives no reason to pin). The
    cost term is ``tau`` itself, in seconds, as in the published heuristic; ties go to the
    shorter TTL.

    **Cold start** (fewer than ``min_samples`` tool durations over all tools): the rule still
    decides, with tool durations assumed exponential with mean ``cold_mean_s`` (1 s), ``eta``
    = 1 and ``T_bar`` starting at 0. For an exponential the argmax has a closed form:
    ``tau* = m ln(V / m)`` if the value ``V`` exceeds the mean ``m``, else 0. (Stated after the
    paper's revision as reconstructed by a third party -- 100 samples, Exp(1 s), eta = 1; the
    authors' preview code has no estimator at all. Earlier we used a fixed 2 s TTL here, which
    made continuum_dy identical to continuum in any run with fewer than 100 tool calls.)
    Which rule decided each pin is on its ``pin`` event (``rule``: ``cold_start`` /
    ``dynamic``); every decision, pinned or not, is counted in :attr:`decisions`, which the
    engine's ``kv_snapshot`` events carry (``retention_decisions``).
    """

    name = "continuum_dy"

    def __init__(self, config: ContinuumDyConfig | None = None,
                 durations: ToolDurationModel | None = None) -> None:
        self.config = cfg = config or ContinuumDyConfig()
        super().__init__(durations or ToolDurationModel(cfg.max_samples, cfg.min_samples),
                         PrefillRate(cfg.prefill_tokens_per_s, cfg.prefill_ema_alpha))
        self._queue_delays: deque[float] = deque(maxlen=cfg.queue_delay_samples)
        # running sums for the Pearson correlation of (done, left)
        self._n = 0
        self._sd = self._sl = self._sdd = self._sll = self._sdl = 0.0
        #: how many admit decisions each rule made (reported per run)
        self.decisions = {"cold_start": 0, "dynamic": 0}
        self._last_rule: str | None = None

    # ------------------------------------------------------------------ feeding
    def prices_host_tier(self) -> bool:
        return self.config.offload

    def observe_queue_delay(self, seconds: float) -> None:
        if seconds is not None and math.isfinite(seconds) and seconds >= 0:
            self._queue_delays.append(float(seconds))

    def observe_session(self, total_turns: int) -> None:
        t = int(total_turns)
        for d in range(1, t + 1):
            left = t - d
            self._n += 1
            self._sd += d
            self._sl += left
            self._sdd += d * d
            self._sll += left * left
            self._sdl += d * left

    # ------------------------------------------------------------------ estimates
    @property
    def eta(self) -> float:
        n = self._n
        if n < 2:
            return self.config.default_eta
        cov = self._sdl - self._sd * self._sl / n
        vd = self._sdd - self._sd * self._sd / n
        vl = self._sll - self._sl * self._sl / n
        if vd <= 1e-12 or vl <= 1e-12:
            return self.config.default_eta
        corr = cov / math.sqrt(vd * vl)
        return min(1.0, max(0.0, -corr))

    @property
    def mean_queue_delay_s(self) -> float:
        q = self._queue_delays
        return sum(q) / len(q) if q else self.config.default_queue_delay_s

    def reload_s(self, cand: PinCandidate) -> float:
        """``reload(r)``: the recompute, or with a host tier the cheaper read back."""
        return reload_s(self.host, cand, self.prefill.recompute_s)

    def value_s(self, cand: PinCandidate) -> float:
        """What a warm resume is worth: ``T_bar * eta + reload(r)``."""
        return self.mean_queue_delay_s * self.eta + self.reload_s(cand)

    def decide(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        cfg = self.config
        value = self.value_s(cand)
        if self.durations.count(None) < cfg.min_samples:
            self._last_rule = "cold_start"
            self.decisions["cold_start"] += 1
            m = cfg.cold_mean_s
            return m * math.log(value / m) if value > m else 0.0
        self._last_rule = "dynamic"
        self.decisions["dynamic"] += 1
        src = self.durations.source(cand.tool, cfg.min_samples)
        samples = self.durations.sorted_samples(cand.tool if src == "tool" else None)
        n = len(samples)
        best_tau, best = 0.0, 0.0  # tau = 0 scores exactly 0
        i = 0
        while i < n:
            tau = samples[i]
            while i + 1 < n and samples[i + 1] == tau:
                i += 1
            score = (i + 1) / n * value - tau  # P(D <= tau) at the step's top
            if score > best:
                best_tau, best = tau, score
            i += 1
        return best_tau

    def decision_rule(self) -> str | None:
        return self._last_rule

    def decision_counts(self) -> dict[str, int]:
        return dict(self.decisions)
