"""Contracts between the framework-free policies and the thin adapters that drive them.

The vLLM scheduler adapter (``mars.engine.sched``) never decides anything itself: it keeps one
record per call that *is* a :class:`CallView`, asks an :class:`OrderingPolicy` for an order,
and asks a :class:`RetentionPolicy` whether a finished round's KV blocks stay pinned while its
agent runs a tool. Policies see plain numbers, so they are unit-testable on hand-made inputs
(:class:`CallRecord`) and the same classes serve MARS and every baseline.

The two policy contracts are abstract base classes in the style of vLLM's ``RequestQueue``:
every method the adapter may call is declared here with a one-line docstring, and where a
policy may not care the default is a no-op. The adapter calls these methods directly; it
never probes a policy object for optional methods.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass


class CallView:
    """What a policy may read about one LLM call the engine holds (waiting or running).

    Abstract: the engine adapter's per-request record implements it (static fields set once,
    moving ones read through from vLLM's request), :class:`CallRecord` is a plain one for
    tests and tools. Declared attributes, all read-only for policies:
    """

    __slots__ = ()

    request_id: str
    session_id: str | None
    #: prompt length (tokens) at arrival
    prompt_tokens: int
    #: tokens whose KV is computed (prefill progress + decoded tokens)
    computed_tokens: int
    #: prefix-cache hit: expected (a lookup at arrival) while waiting, actual once admitted;
    #: never service this call paid for
    cached_tokens: int
    output_tokens: int
    max_tokens: int
    arrival_time: float
    #: when the call last got tokens scheduled (arrival_time if never)
    last_served: float
    num_blocks: int
    running: bool
    round: int | None


@dataclass(slots=True)
class CallRecord(CallView):
    """A plain :class:`CallView` (tests, offline tools); the fields are redeclared because a
    dataclass only takes fields from dataclass bases."""

    request_id: str
    session_id: str | None
    prompt_tokens: int
    computed_tokens: int
    cached_tokens: int
    output_tokens: int
    max_tokens: int
    arrival_time: float
    last_served: float
    num_blocks: int
    running: bool
    round: int | None = None


class OrderingPolicy(ABC):
    """Orders calls; the adapter serves the order front to back and preempts from the back.

    ``key`` may be called for every call on a tick, so it must be O(1); per-call state lives
    in the policy, is charged by ``on_scheduled`` / ``served`` and dropped by ``on_finished``.
    """

    name: str = "ordering"
    #: False for arrival order (vLLM's own): the adapter then leaves its queues alone
    reorders: bool = True

    @abstractmethod
    def key(self, call: CallView, now: float) -> tuple:
        """Sort key (ascending: front is served first, back is preempted first)."""

    def on_scheduled(self, call: CallView, tokens: int, now: float) -> None:
        """``tokens`` were computed for ``call`` (service, excluding prefix-cache hits)."""

    def served(self, call: CallView, tokens: int, now: float) -> tuple:
        """Charge ``tokens`` of service and return the new key (one call on the hot path)."""
        self.on_scheduled(call, tokens, now)
        return self.key(call, now)

    def horizon(self, call: CallView, now: float) -> tuple[float, float]:
        """(tokens, until): the key cannot change before that much service or that time.

        The default promises nothing, so the adapter re-keys the call on every tick.
        """
        return 0, 0.0

    def level_of(self, request_id: str) -> int | None:
        """The level of the latest key computed for the request (events), if levelled."""
        return None

    def on_finished(self, request_id: str, session_id: str | None, now: float) -> None:
        """The call left the engine (finished or aborted): drop per-call state."""

    def on_session_end(self, session_id: str, now: float) -> None:
        """The session's last round finished: drop per-session state."""


@dataclass(slots=True)
class PinCandidate:
    """A round that just ended while its session goes on to a tool."""

    session_id: str
    #: blocks that only this pin keeps resident (shared-prefix blocks held by other
    #: requests or pins stay cached anyway and are not charged to it)
    blocks: int
    context_tokens: int
    tool: str | None
    started: float
    #: of which the round's prompt (None: unknown); a host tier that stores prompts only
    #: (vLLM's default) holds these, the round's output is recomputed
    prompt_tokens: int | None = None


@dataclass(slots=True)
class KvPressure:
    """Block-pool state the retention rule prices memory with."""

    total_blocks: int
    free_blocks: int
    pinned_blocks: int
    #: blocks that waiting calls still need to be admitted (queued demand, cache hits and
    #: their own session's pinned context excluded)
    waiting_demand_blocks: int
    running: int = 0
    waiting: int = 0

    @property
    def utilisation(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 1.0


class RetentionPolicy(ABC):
    """Decides whether a finished round's KV stays pinned across its tool call, and how long.

    ``admit`` is asked once when the round ends (0 means do not pin); ``keep`` is asked
    periodically while the tool runs so a decision can change with pressure (MARS) or stay
    fixed (the baselines' one-off rules). The ``observe_*`` feeds are no-ops for rules that
    do not use them.
    """

    name: str = "retention"
    #: host memory holding released contexts (vLLM's offloading), once attached to a rule
    #: that prices it (:meth:`prices_host_tier`)
    host: "HostTier | None" = None

    @abstractmethod
    def admit(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        """Seconds to pin the candidate's blocks (0: release them now)."""

    @abstractmethod
    def keep(self, cand: PinCandidate, kv: KvPressure, now: float) -> bool:
        """Whether a pin granted earlier should still be held."""

    def decision_rule(self) -> str | None:
        """Which of its rules made the latest ``admit`` decision (for the ``pin`` event)."""
        return None

    def decision_counts(self) -> dict[str, int]:
        """How many ``admit`` decisions each of its rules made (on ``kv_snapshot`` events)."""
        return {}

    def reclaim_rank(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        """Order in which pins go when memory is needed (lowest first); default: oldest."""
        return cand.started

    def observe_tool(self, tool: str | None, duration_s: float) -> None:
        """A tool phase of this type lasted ``duration_s`` (gap between two rounds)."""

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` of prefill in ``seconds`` of step time."""

    def observe_queue_delay(self, seconds: float) -> None:
        """A later round that found no pin waited this long to be admitted."""

    def observe_session(self, total_turns: int) -> None:
        """A session finished after ``total_turns`` rounds."""

    def prices_host_tier(self) -> bool:
        """Whether this rule prices a context's coming back over the host link (its config's
        switch). Rules whose papers do not price that keep False (InferCept swaps and
        Continuum-Dy prices the reload, as their papers do; MARS's rule does)."""
        return False

    def attach_host_tier(self, tier: "HostTier") -> None:
        """The engine offloads KV to host memory (vLLM's ``--kv-offloading-size``): a
        released context can come back over the host link instead of being recomputed.
        Kept as :attr:`host` by the rules that price it."""
        if self.prices_host_tier():
            self.host = tier

    def observe_host_read(self, nbytes: int, seconds: float) -> None:
        """Loads from host memory moved ``nbytes`` in ``seconds`` (waits for the link
        included): the attached tier's read rate."""
        if self.host is not None:
            self.host.observe_read(nbytes, seconds)

    def forget(self, session_id: str) -> None:
        """The adapter released the session's pin (resumed, expired, pressure)."""


class MeasuredRate:
    """A rate (amount per second) that starts at a prior, is replaced by the first
    measurement and is then smoothed. Amounts and seconds are smoothed separately and the
    rate is their ratio, so a tiny, noisy measurement moves it less than a large one."""

    def __init__(self, prior_per_s: float, alpha: float = 0.2) -> None:
        if not (math.isfinite(prior_per_s) and prior_per_s > 0) or not 0 < alpha <= 1:
            raise ValueError("the prior rate must be > 0 and 0 < alpha <= 1")
        self.alpha = alpha
        self._amount, self._sec = float(prior_per_s), 1.0
        self._measured = False

    @property
    def per_s(self) -> float:
        return self._amount / self._sec

    def observe(self, amount: float, seconds: float) -> None:
        if amount <= 0 or not seconds or seconds <= 0 or not math.isfinite(seconds):
            return
        if not self._measured:
            self._amount, self._sec, self._measured = float(amount), float(seconds), True
            return
        a = self.alpha
        self._amount = (1 - a) * self._amount + a * amount
        self._sec = (1 - a) * self._sec + a * seconds


class HostTier:
    """What a released context's return from host memory costs, from measured quantities: the
    KV bytes per token of the layers that keep every token (the model's layout) plus a fixed
    term for sliding-window layers (only their window comes back), the host pool's size,
    what the host holds of a context (whole blocks; of the prompt only, as vLLM stores by
    default: the round's output is recomputed), and the host link's copy rate (a prior, the
    card's, replaced by the first measured loads and then smoothed, :class:`MeasuredRate`)."""

    def __init__(self, bytes_per_token: float, capacity_bytes: float,
                 read_bytes_per_s: float, alpha: float = 0.2, *, window_bytes: float = 0.0,
                 block_tokens: int = 1, prompt_only: bool = True) -> None:
        for name, v in (("bytes_per_token", bytes_per_token),
                        ("read_bytes_per_s", read_bytes_per_s)):
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not (capacity_bytes >= 0) or not 0 < alpha <= 1:
            raise ValueError("capacity_bytes must be >= 0 and 0 < alpha <= 1")
        if not (window_bytes >= 0) or block_tokens < 1:
            raise ValueError("window_bytes must be >= 0 and block_tokens >= 1")
        self.bytes_per_token = float(bytes_per_token)
        self.capacity_bytes = float(capacity_bytes)
        self.window_bytes = float(window_bytes)
        self.block_tokens = int(block_tokens)
        self.prompt_only = bool(prompt_only)
        self.rate = MeasuredRate(read_bytes_per_s, alpha)

    @property
    def read_bytes_per_s(self) -> float:
        return self.rate.per_s

    @property
    def capacity_tokens(self) -> int:
        """Tokens of context the host pool holds (of the full-attention layers, which
        keep every token)."""
        return int(self.capacity_bytes // self.bytes_per_token)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        self.rate.observe(nbytes, seconds)

    def held_tokens(self, context_tokens: int, prompt_tokens: int | None) -> int:
        """Tokens of a context the host holds: whole blocks, of the prompt when only
        prompts are stored."""
        held = context_tokens if (prompt_tokens is None or not self.prompt_only) \
            else min(prompt_tokens, context_tokens)
        return max(0, held) // self.block_tokens * self.block_tokens

    def read_s(self, tokens: int) -> float:
        """Seconds to read ``tokens`` of context back; ``inf`` when the host pool could not
        hold them (vLLM's host LRU would have dropped part of it)."""
        if tokens <= 0:
            return 0.0
        nbytes = tokens * self.bytes_per_token + self.window_bytes
        if nbytes > self.capacity_bytes:
            return math.inf
        return nbytes / self.read_bytes_per_s


def reload_s(host: HostTier | None, cand: PinCandidate,
             recompute_s: Callable[[int], float]) -> float:
    """What a released context costs its next round: its recompute, or, with a host tier,
    the read back of what the host holds and the recompute of the rest when that is
    cheaper (the rules that price a host tier share it: MARS's, Continuum-Dy's)."""
    ctx = cand.context_tokens
    if host is None:
        return recompute_s(ctx)
    held = host.held_tokens(ctx, cand.prompt_tokens)
    return min(recompute_s(ctx), host.read_s(held) + recompute_s(ctx - held))


class FcfsOrdering(OrderingPolicy):
    """Stock vLLM order: arrival time. Used by ``--policy fcfs`` and the retention baselines."""

    name = "fcfs"
    reorders = False

    def key(self, call: CallView, now: float) -> tuple:
        return (call.arrival_time,)


class NoRetention(RetentionPolicy):
    """Stock vLLM: a finished round's blocks go back to the pool (and its prefix cache)."""

    name = "none"

    def admit(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        return 0.0

    def keep(self, cand: PinCandidate, kv: KvPressure, now: float) -> bool:
        return False
