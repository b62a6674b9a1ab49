"""--policy NAME -> ordering, retention and mechanism switches."""

from __future__ import annotations


import pytest

from mars.policy.engine.base import FcfsOrdering, NoRetention, OrderingPolicy, RetentionPolicy
from mars.policy.engine.baselines import (
    AutellixPLAS,
    ContinuumDyRetention,
    ContinuumRetention,
    InferceptRetention,
    ProgramFCFS,
)
from mars.policy.engine.mlfq import WindowedMLFQ
from mars.policy.registry import POLICY_NAMES, PolicySpec, get_policy
from mars.policy.engine.hint import KvHintRetention
from mars.policy.engine.retention import CostBenefitRetention

EXPECTED = {
    # name: (ordering, retention, chunk_shrink, pin, sidecar_admission)
    "fcfs": (FcfsOrdering, NoRetention, False, False, False),
    "mars": (WindowedMLFQ, CostBenefitRetention, True, True, True),
    "mars_no_coord": (FcfsOrdering, CostBenefitRetention, True, True, True),
    "mars_no_ctrl": (WindowedMLFQ, CostBenefitRetention, True, True, False),
    "mars_no_cosched": (WindowedMLFQ, NoRetention, False, False, True),
    "autellix": (AutellixPLAS, NoRetention, False, False, False),
    "infercept": (FcfsOrdering, InferceptRetention, False, True, False),
    "continuum": (ProgramFCFS, ContinuumRetention, False, True, False),
    "continuum_dy": (ProgramFCFS, ContinuumDyRetention, False, True, False),
    "kv_hint": (FcfsOrdering, KvHintRetention, False, True, False),
}


def test_policy_names():
    assert set(POLICY_NAMES) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_spec_contents(name):
    ordering_cls, retention_cls, shrink, pin, admission = EXPECTED[name]
    spec = get_policy(name)
    assert isinstance(spec, PolicySpec) and spec.name == name
    ordering, retention = spec.build()
    assert type(ordering) is ordering_cls
    assert type(retention) is retention_cls
    assert isinstance(ordering, OrderingPolicy)
    assert isinstance(retention, RetentionPolicy)
    assert (spec.chunk_shrink, spec.pin, spec.sidecar_admission) == (shrink, pin, admission)
    # pinning is on exactly when the retention policy can pin
    assert spec.pin == (retention_cls is not NoRetention)


def test_factories_give_fresh_stateful_instances():
    spec = get_policy("mars")
    a, b = spec.ordering(), spec.ordering()
    assert a is not b


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError) as exc:
        get_policy("sjf")
    msg = str(exc.value)
    assert "sjf" in msg
    for name in POLICY_NAMES:
        assert name in msg


def test_only_mars_coordinator_yields_and_bounds_prefill():
    """Prefill yielding and bounded interference are MARS's coordinator: no baseline paper
    describes them, so no baseline gets them (Autellix orders, but does not yield)."""
    for name in POLICY_NAMES:
        spec = get_policy(name)
        mine = name in ("mars", "mars_no_ctrl", "mars_no_cosched")
        assert spec.prefill_yield == mine, name
        assert (spec.prefill_interference > 0) == mine, name
