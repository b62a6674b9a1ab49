"""Contracts between the framework-free policies and the thin adapters that drive them.

The vLLM scheduler adapter (``mars.vllm_patches``) never decides anything itself: every step
it describes the calls it holds as :class:`CallView` records, asks an :class:`OrderingPolicy`
for an order, and asks a :class:`RetentionPolicy` whether a finished round's KV blocks stay
pinned while its agent runs a tool. Policies see plain numbers, so they are unit-testable on
hand-made inputs and the same classes serve MARS and every baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(slots=True)
class SessionMeta:
    """Per-call session metadata, as carried in ``vllm_xargs`` (``SamplingParams.extra_args``).

    ``job_id`` identifies the agent session across rounds; the engine-side request id must
    never be used for that (vLLM appends a random suffix to it).
    """

    job_id: str | None = None
    round: int | None = None
    last_round: bool = False
    #: tool the agent is expected to run after this round (the replay harness knows it)
    next_tool: str | None = None
    #: tool that ran just before this round (what the OpenHands integration knows)
    prev_tool: str | None = None

    KEYS = ("job_id", "round", "last_round", "next_tool", "prev_tool")

    @classmethod
    def from_extra_args(cls, extra: dict | None, fallback_session: str | None = None) -> "SessionMeta":
        """Parse leniently: metadata is advisory, a bad field must not fail the request."""
        extra = extra or {}
        job = extra.get("job_id") or fallback_session
        rnd = extra.get("round")
        try:
            rnd = int(rnd) if rnd is not None else None
        except (TypeError, ValueError):
            rnd = None
        last = extra.get("last_round", False)
        if isinstance(last, str):
            last = last.strip().lower() in ("1", "true", "yes")
        return cls(
            job_id=str(job) if job is not None else None,
            round=rnd,
            last_round=bool(last),
            next_tool=_opt_str(extra.get("next_tool")),
            prev_tool=_opt_str(extra.get("prev_tool")),
        )

    def to_extra_args(self) -> dict:
        out: dict = {}
        if self.job_id is not None:
            out["job_id"] = self.job_id
        if self.round is not None:
            out["round"] = self.round
        if self.last_round:
            out["last_round"] = True
        if self.next_tool:
            out["next_tool"] = self.next_tool
        if self.prev_tool:
            out["prev_tool"] = self.prev_tool
        return out


def _opt_str(v) -> str | None:
    return str(v) if v not in (None, "") else None


@dataclass(slots=True)
class CallView:
    """What a policy may know about one LLM call the engine holds (waiting or running)."""

    request_id: str
    session_id: str | None
    prompt_tokens: int
    #: tokens whose KV is computed (prefill progress + decoded tokens): the service received
    computed_tokens: int
    #: tokens that hit the prefix cache at admission (not service this call paid for)
    cached_tokens: int
    output_tokens: int
    max_tokens: int
    arrival_time: float
    #: when the call last got tokens scheduled (arrival_time if never)
    last_served: float
    num_blocks: int
    running: bool
    round: int | None = None


@runtime_checkable
class OrderingPolicy(Protocol):
    """Orders calls; the adapter serves the order front to back and preempts from the back.

    ``key`` is called once per call per step, so it must be O(1); per-call state lives in the
    policy and is updated by ``on_scheduled`` (service given this step) and dropped by
    ``on_finished``.
    """

    name: str

    def key(self, call: CallView, now: float) -> tuple: ...

    def on_scheduled(self, call: CallView, tokens: int, now: float) -> None: ...

    def on_finished(self, request_id: str, session_id: str | None, now: float) -> None: ...


@dataclass(slots=True)
class PinCandidate:
    """A round that just ended while its session goes on to a tool."""

    session_id: str
    blocks: int
    context_tokens: int
    tool: str | None
    started: float


@dataclass(slots=True)
class KvPressure:
    """Block-pool state the retention rule prices memory with."""

    total_blocks: int
    free_blocks: int
    pinned_blocks: int
    #: blocks that waiting calls still need to be admitted (queued demand)
    waiting_demand_blocks: int
    running: int = 0
    waiting: int = 0

    @property
    def utilisation(self) -> float:
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 1.0


@runtime_checkable
class RetentionPolicy(Protocol):
    """Decides whether a finished round's KV stays pinned across its tool call, and how long.

    ``admit`` is asked once when the round ends (0 means do not pin); ``keep`` is asked
    periodically while the tool runs so a decision can change with pressure (MARS) or stay
    fixed (the baselines' one-off rules). ``observe_tool`` feeds finished tool durations.
    """

    name: str

    def admit(self, cand: PinCandidate, kv: KvPressure, now: float) -> float: ...

    def keep(self, cand: PinCandidate, kv: KvPressure, now: float) -> bool: ...

    def observe_tool(self, tool: str | None, duration_s: float) -> None: ...


@dataclass(slots=True)
class FcfsOrdering:
    """Stock vLLM order: arrival time. Used by ``--policy fcfs`` and the retention baselines."""

    name: str = "fcfs"

    def key(self, call: CallView, now: float) -> tuple:
        return (call.arrival_time,)

    def on_scheduled(self, call: CallView, tokens: int, now: float) -> None:
        pass

    def on_finished(self, request_id: str, session_id: str | None, now: float) -> None:
        pass


@dataclass(slots=True)
class NoRetention:
    """Stock vLLM: a finished round's blocks go back to the pool (and its prefix cache)."""

    name: str = "none"

    def admit(self, cand: PinCandidate, kv: KvPressure, now: float) -> float:
        return 0.0

    def keep(self, cand: PinCandidate, kv: KvPressure, now: float) -> bool:
        return False

    def observe_tool(self, tool: str | None, duration_s: float) -> None:
        pass
