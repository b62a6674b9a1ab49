"""``--policy NAME`` -> the ordering, retention and mechanism switches that make up a system.

MARS's ablations (paper §6.5) each switch off one component: ``mars_no_coord`` the
Priority-Aware Coordinator (FCFS order), ``mars_no_ctrl`` the external admission controller,
``mars_no_cosched`` the Opportunistic Co-Scheduler (no chunk shrinking, no pinning). Baselines
run inside the same engine with the sidecar's admission off (§6.2: identical batch limits).
Factories, not instances, because policies are stateful and every engine needs its own.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Callable
from dataclasses import dataclass

from mars.policy.engine.base import FcfsOrdering, NoRetention, OrderingPolicy, RetentionPolicy
from mars.policy.engine.baselines import (
    AutellixPLAS,
    ContinuumDyRetention,
    ContinuumRetention,
    InferceptRetention,
    ProgramFCFS,
)
from mars.policy.engine.hint import KvHintRetention
from mars.policy.engine.mlfq import WindowedMLFQ
from mars.policy.engine.retention import CostBenefitRetention


@dataclass(frozen=True, slots=True)
class PolicySpec:
    name: str
    ordering: Callable[[], OrderingPolicy]
    retention: Callable[[], RetentionPolicy]
    #: shrink a prefill chunk to what the allocator can fit before preempting (§4.3)
    chunk_shrink: bool
    #: pin finished rounds' KV across tool calls (the retention policy is consulted)
    pin: bool
    #: the sidecar's external admission controller gates new sessions (§4.2)
    sidecar_admission: bool
    #: growth room (tokens per running call) kept free when admitting; 0 = vLLM's rule
    #: (:mod:`mars.policy.engine.headroom`; part of the co-scheduler, like chunk shrinking)
    admit_headroom_tokens: int = 0
    #: a running prefill ranked below admissible waiting calls leaves them its tokens (part
    #: of MARS's Priority-Aware Coordinator; no baseline paper describes it)
    prefill_yield: bool = False
    #: while higher-priority calls decode, a lower-priority running prefill adds at most this
    #: many decode steps' worth of time to a step (coordinator; 0 = unbounded, vLLM's rule)
    prefill_interference: float = 0.0

    def build(self) -> tuple[OrderingPolicy, RetentionPolicy]:
        return self.ordering(), self.retention()


_SPECS: dict[str, PolicySpec] = {
    s.name: s
    for s in (
        PolicySpec("fcfs", FcfsOrdering, NoRetention,
                   chunk_shrink=False, pin=False, sidecar_admission=False),
        PolicySpec("mars", WindowedMLFQ, CostBenefitRetention,
                   chunk_shrink=True, pin=True, sidecar_admission=True,
                   admit_headroom_tokens=8, prefill_yield=True, prefill_interference=1.0),
        PolicySpec("mars_no_coord", FcfsOrdering, CostBenefitRetention,
                   chunk_shrink=True, pin=True, sidecar_admission=True,
                   admit_headroom_tokens=8),
        PolicySpec("mars_no_ctrl", WindowedMLFQ, CostBenefitRetention,
                   chunk_shrink=True, pin=True, sidecar_admission=False,
                   admit_headroom_tokens=8, prefill_yield=True, prefill_interference=1.0),
        PolicySpec("mars_no_cosched", WindowedMLFQ, NoRetention,
                   chunk_shrink=False, pin=False, sidecar_admission=True,
                   prefill_yield=True, prefill_interference=1.0),
        PolicySpec("autellix", AutellixPLAS, NoRetention,
                   chunk_shrink=False, pin=False, sidecar_admission=False),
        PolicySpec("infercept", FcfsOrdering, InferceptRetention,
                   chunk_shrink=False, pin=True, sidecar_admission=False),
        PolicySpec("continuum", ProgramFCFS, ContinuumRetention,
                   chunk_shrink=False, pin=True, sidecar_admission=False),
        PolicySpec("continuum_dy", ProgramFCFS, ContinuumDyRetention,
                   chunk_shrink=False, pin=True, sidecar_admission=False),
        # llm-d's whole-context retention hint (mars.policy.engine.hint) on vLLM's order
        PolicySpec("kv_hint", FcfsOrdering, KvHintRetention,
                   chunk_shrink=False, pin=True, sidecar_admission=False),
    )
}

POLICY_NAMES: tuple[str, ...] = tuple(_SPECS)


def get_policy(name: str) -> PolicySpec:
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}") from None


def with_config(policy, overrides: dict | None):
    """The same policy class rebuilt with some config fields overridden (``--mars-config``).

    Raises ``ValueError`` naming the bad field, so the CLI can reject a typo before the
    engine starts.
    """
    if not overrides:
        return policy
    cfg = getattr(policy, "config", None)
    if not dataclasses.is_dataclass(cfg):
        raise ValueError(f"policy {policy.name!r} has no tunable parameters")
    try:
        return type(policy)(dataclasses.replace(cfg, **overrides))
    except TypeError as exc:
        fields = ", ".join(f.name for f in dataclasses.fields(cfg))
        raise ValueError(f"{exc}; valid fields of {type(cfg).__name__}: {fields}") from None
