"""ToolDurationModel and MARS's cost/benefit retention rule."""

from __future__ import annotations

import math

import pytest

from mars.policy.engine.base import KvPressure, PinCandidate, RetentionPolicy
from mars.policy.engine.retention import (
    CostBenefitRetention,
    PrefillRate,
    RetentionConfig,
    ToolDurationModel,
    block_price,
)

TOTAL = 10_000


def kv(free: int, *, pinned: int = 0, waiting: int = 0, total: int = TOTAL) -> KvPressure:
    return KvPressure(total_blocks=total, free_blocks=free, pinned_blocks=pinned,
                      waiting_demand_blocks=waiting)


def cand(tool: str | None = "t", *, blocks: int = 2000, ctx: int = 32_000,
         started: float = 0.0, session: str = "s") -> PinCandidate:
    return PinCandidate(session_id=session, blocks=blocks, context_tokens=ctx, tool=tool,
                        started=started)


# ---------------------------------------------------------------------- duration model


def test_prob_within_is_empirical_cdf_of_the_tool():
    m = ToolDurationModel(min_samples=4)
    for d in (1.0, 2.0, 3.0, 4.0):
        m.observe("bash", d)
    assert m.source("bash") == "tool"
    assert m.prob_within("bash", 0.5) == 0.0
    assert m.prob_within("bash", 2.0) == 0.5
    assert m.prob_within("bash", 3.5) == 0.75
    assert m.prob_within("bash", 10.0) == 1.0


def test_fallback_to_all_tools_then_prior():
    m = ToolDurationModel(min_samples=4, prior_mean_s=5.0)
    # nothing known: exponential prior with mean 5 s
    assert m.source("x") == "prior"
    assert m.prob_within("x", 5.0) == pytest.approx(1 - math.exp(-1))
    for _ in range(4):
        m.observe("fast", 0.5)
    m.observe("slow", 100.0)
    # "slow" has 1 sample < 4: answered by all five samples (4 fast, 1 slow)
    assert m.source("slow") == "all"
    assert m.prob_within("slow", 1.0) == pytest.approx(0.8)
    assert m.source("fast") == "tool"
    assert m.prob_within("fast", 1.0) == 1.0
    # a never-seen tool also borrows the all-tool distribution
    assert m.prob_within("new", 1.0) == pytest.approx(0.8)
    # the caller may demand more evidence (Continuum-Dy uses 100)
    assert m.source("fast", min_samples=100) == "prior"


def test_memory_is_bounded_to_recent_samples():
    m = ToolDurationModel(max_samples=512, min_samples=1)
    for _ in range(600):
        m.observe("t", 100.0)
    for _ in range(512):
        m.observe("t", 1.0)
    assert m.count("t") == 512
    assert m.prob_within("t", 2.0) == 1.0       # the old long samples are gone
    for _ in range(1000):
        m.observe("u", 1.0)
    assert m.count(None) == 4 * 512                # all-tool history is bounded too


def test_conditional_return_probability():
    m = ToolDurationModel(min_samples=1)
    for d in (1.0, 2.0, 3.0, 4.0, 10.0):
        m.observe("t", d)
    # after 2.5 s, three of the five samples are still running: 3, 4 and 10
    assert m.prob_returns_within("t", 2.5, 1.0) == pytest.approx(1 / 3)
    assert m.prob_returns_within("t", 2.5, 2.0) == pytest.approx(2 / 3)
    assert m.prob_returns_within("t", 0.0, 2.0) == m.prob_within("t", 2.0) == 0.4
    # outlived every sample: no reason to believe it returns soon
    assert m.prob_returns_within("t", 11.0, 30.0) == 0.0
    # prior is memoryless
    p = ToolDurationModel(prior_mean_s=5.0)
    assert p.prob_returns_within("x", 50.0, 5.0) == pytest.approx(p.prob_within("x", 5.0))


def test_mean_and_bad_samples_ignored():
    m = ToolDurationModel(min_samples=1)
    m.observe("t", 1.0)
    m.observe("t", 3.0)
    m.observe("t", -1.0)
    m.observe("t", float("nan"))
    assert m.mean("t") == 2.0
    assert m.mean("other") == 2.0                 # all tools
    assert ToolDurationModel(prior_mean_s=7.0).mean("t") == 7.0


def test_prefill_rate_ema():
    r = PrefillRate(10_000.0, alpha=0.5)
    assert r.recompute_s(20_000) == pytest.approx(2.0)
    r.observe(4_000, 2.0)                          # first measurement replaces the guess
    assert r.tokens_per_s == pytest.approx(2_000.0)
    r.observe(8_000, 2.0)                          # (0.5*4000+0.5*8000)/(0.5*2+0.5*2)
    assert r.tokens_per_s == pytest.approx(3_000.0)
    r.observe(0, 1.0)
    r.observe(100, 0.0)
    assert r.tokens_per_s == pytest.approx(3_000.0)


# ---------------------------------------------------------------------- price


def test_price_is_near_zero_when_free_and_steep_under_pressure():
    price = lambda k: block_price(k, 1.0, 2.0, 0.99)  # noqa: E731
    idle = price(kv(free=9_900))
    half = price(kv(free=5_000))
    tight = price(kv(free=500))
    assert idle < 2e-4 / TOTAL
    assert half == pytest.approx(1.0 / TOTAL)
    assert tight > 300 * half
    # queued demand counts as spoken-for memory
    assert price(kv(free=5_000, waiting=3_000)) > 10 * half
    # demand beyond the free blocks hits the cap
    assert price(kv(free=5_000, waiting=6_000)) == pytest.approx((0.99 / 0.01) ** 2 / TOTAL)


def test_price_is_zero_below_the_knee_and_rescaled_above_it():
    price = lambda k: block_price(k, 1.0, 2.0, 0.99, free_knee=0.5)  # noqa: E731
    assert price(kv(free=6_000)) == 0.0               # 40% spoken for
    assert price(kv(free=5_000)) == 0.0               # exactly at the knee
    assert price(kv(free=2_500)) == pytest.approx(1.0 / TOTAL)   # half-way from knee to full
    assert price(kv(free=5_000, waiting=2_500)) == pytest.approx(1.0 / TOTAL)


# ---------------------------------------------------------------------- the rule


def _policy_with(samples: dict[str, list[float]], **cfg) -> CostBenefitRetention:
    pol = CostBenefitRetention(RetentionConfig(**cfg))
    for tool, ds in samples.items():
        for d in ds:
            pol.observe_tool(tool, d)
    return pol


def test_is_a_retention_policy():
    pol = CostBenefitRetention()
    assert isinstance(pol, RetentionPolicy)
    assert pol.name == "mars"


def test_short_tool_on_idle_pool_is_pinned_until_it_returns():
    pol = _policy_with({"t": [0.8] * 20})
    tau = pol.admit(cand(), kv(free=7_000), now=0.0)
    assert tau == 1.0          # P reaches 1 at 1 s; longer only costs more
    assert pol.tau_of("s") == 1.0


def test_more_pressure_smaller_tau():
    pol = _policy_with({"t": [0.4, 0.9, 1.5, 3.0, 6.0, 12.0, 25.0, 50.0] * 4})
    taus = [pol.admit(cand(), kv(free=f), now=0.0)
            for f in (8_000, 7_000, 6_000, 5_000, 4_000, 3_000, 2_000, 1_000, 200)]
    assert all(a >= b for a, b in zip(taus, taus[1:])), taus
    assert taus[0] >= 30.0
    assert taus[-1] == 0.0
    # queued demand alone also shrinks it
    assert pol.admit(cand(), kv(free=7_000, waiting=6_500), now=0.0) < taus[1]


def test_more_short_samples_larger_tau():
    taus = []
    for n_short in (0, 5, 10, 15, 20):
        pol = _policy_with({"t": [0.5] * n_short + [300.0] * (20 - n_short)})
        taus.append(pol.admit(cand(), kv(free=3_000), now=0.0))
    assert all(a <= b for a, b in zip(taus, taus[1:])), taus
    assert taus[0] == 0.0 and taus[-1] > 0.0


def test_evidence_of_short_tool_beats_prior_under_pressure():
    prior_only = CostBenefitRetention()
    assert prior_only.admit(cand(), kv(free=1_000), now=0.0) == 0.0   # 90% spoken for
    pol = _policy_with({"t": [0.5] * 50})
    assert pol.admit(cand(), kv(free=1_000), now=0.0) == 0.5


def test_long_tools_are_not_pinned():
    pol = _policy_with({"t": [300.0] * 50})
    assert pol.admit(cand(), kv(free=9_000), now=0.0) == 0.0
    assert pol.tau_of("s") is None


def test_bigger_recompute_justifies_pin():
    pol = _policy_with({"t": [3.0] * 20})
    k = kv(free=1_250)
    assert pol.admit(cand(), k, now=0.0) == 0.0
    pol.observe_prefill(1_000, 1.0)                # prefill 10x slower than assumed
    assert pol.admit(cand(), k, now=0.0) == 4.0


def test_keep_turns_false_when_pressure_rises_mid_tool():
    pol = _policy_with({"t": [1.0, 2.0, 4.0, 8.0, 16.0] * 4})
    c = cand(started=0.0)
    tau = pol.admit(c, kv(free=8_000), now=0.0)
    assert tau >= 16.0
    assert pol.keep(c, kv(free=8_000), now=3.0) is True
    assert pol.keep(c, kv(free=100, waiting=5_000), now=3.5) is False
    assert pol.tau_of("s") is None


def test_keep_false_when_tau_expires_or_tool_outlives_samples():
    pol = _policy_with({"t": [0.8] * 20})
    c = cand(started=10.0)
    assert pol.admit(c, kv(free=7_000), now=10.0) == 1.0
    assert pol.keep(c, kv(free=7_000), now=10.5) is True
    assert pol.keep(c, kv(free=7_000), now=11.0) is False   # tau reached
    pol2 = _policy_with({"t": [1.0, 2.0, 3.0] * 5})
    c2 = cand(started=0.0)
    assert pol2.admit(c2, kv(free=9_000), now=0.0) >= 4.0
    assert pol2.keep(c2, kv(free=9_000), now=2.5) is True
    # ran longer than every observed duration: expected gain is 0 even on an idle pool
    assert pol2.keep(c2, kv(free=9_000), now=3.5) is False


def test_keep_uses_conditional_probability():
    # half the calls return within 1 s, the other half take 40 s
    samples = {"t": [0.8] * 10 + [40.0] * 10}
    c = cand(started=0.0)
    busy = kv(free=3_000)
    # decided on a busy pool: only the quick half is worth betting on
    assert _policy_with(samples).admit(c, busy, now=0.0) == 1.0
    # decided on an idle pool: pin long enough to cover the slow half too
    pol = _policy_with(samples)
    assert pol.admit(c, kv(free=8_000), now=0.0) == 60.0
    # the pool gets busy; right after the call a quick return is still likely...
    assert pol.keep(c, busy, now=0.2) is True
    # ...but after 1.5 s only the 40 s tail is left, not worth the memory at this pressure
    assert pol.keep(c, kv(free=8_000), now=1.5) is True
    assert pol.keep(c, busy, now=1.5) is False


def test_zero_block_candidate_not_pinned():
    pol = _policy_with({"t": [0.5] * 20})
    assert pol.admit(cand(blocks=0, ctx=0), kv(free=9_000), now=0.0) == 0.0


def test_tau_bounded_by_max_tau():
    pol = _policy_with({"t": [45.0] * 20}, max_tau_s=30.0)
    assert pol.admit(cand(), kv(free=9_900), now=0.0) == 0.0
    pol = _policy_with({"t": [45.0] * 20}, max_tau_s=60.0)
    assert pol.admit(cand(), kv(free=9_900), now=0.0) == 60.0


def test_sorted_samples_follow_the_bounded_window():
    import random

    m = ToolDurationModel(max_samples=5, min_samples=1)
    rng = random.Random(3)
    for _ in range(200):
        m.observe(rng.choice(["a", "b"]), rng.random() * 10)
        for key, dq in m._samples.items():
            assert m._sorted_samples(key) == sorted(dq)


# ---------------------------------------------------------------------- a host tier


def test_a_host_tier_prices_a_release_as_the_read_back_and_pins_less_under_pressure():
    """With vLLM offloading to host memory a released context returns over the host link:
    the miss costs ``tokens x bytes/token / read rate``, not a recompute, so the same pool
    pressure that is worth a pin against a 3.2 s recompute is not worth one against a 0.1 s
    read; on a free pool (no price) the pin stays, as memory nobody wants costs nothing."""
    from mars.policy.engine.base import HostTier

    samples = {"t": [0.4, 0.9, 1.5, 3.0, 6.0, 12.0, 25.0, 50.0] * 4}
    blind, aware = _policy_with(samples), _policy_with(samples)
    # 98,304 bytes per token (Qwen3-Coder-30B's KV), 64 GiB of host memory, 30 GB/s, 16-token
    # blocks, prompts only stored (vLLM's default)
    tier = HostTier(98_304, 64 * 2**30, 30e9, block_tokens=16)
    aware.attach_host_tier(tier)
    c = cand(ctx=32_000)
    assert blind.miss_s(c) == pytest.approx(3.2)  # 32K tokens at the 10K tok/s guess
    assert aware.miss_s(c) == pytest.approx(32_000 * 98_304 / 30e9)
    # of a round's 32,000 tokens the prompt was 31,500: its 1,968 whole blocks come back,
    # the last 12 prompt tokens and the 500 of output are recomputed
    c_out = PinCandidate(session_id="o", blocks=2000, context_tokens=32_000, tool="t",
                         started=0.0, prompt_tokens=31_500)
    assert aware.miss_s(c_out) == pytest.approx(31_488 * 98_304 / 30e9 + 512 / 10_000)
    pressured = kv(free=3_000)
    assert blind.admit(c, pressured, now=0.0) > 0
    assert aware.admit(c, pressured, now=0.0) == 0.0
    assert aware.admit(cand(session="idle"), kv(free=9_000), now=0.0) > 0
    # a context the host pool cannot hold is a recompute again
    assert aware.miss_s(cand(ctx=10_000_000)) == pytest.approx(1_000.0)
    # sliding-window layers: only their window comes back, a fixed term
    windowed = HostTier(49_152, 64 * 2**30, 30e9, window_bytes=128 * 49_152)
    assert windowed.read_s(32_000) == pytest.approx((32_000 + 128) * 49_152 / 30e9)
    assert windowed.read_s(0) == 0.0
    # measured loads replace the prior, then are smoothed
    tier.observe_read(int(1e9), 0.1)
    assert tier.read_bytes_per_s == pytest.approx(1e10)
    tier.observe_read(int(1e9), 0.2)
    assert 5e9 < tier.read_bytes_per_s < 1e10
    # the ablation: the same rule blind to the host tier
    off = CostBenefitRetention(RetentionConfig(host_tier=False))
    off.attach_host_tier(tier)
    assert off.miss_s(c) == pytest.approx(3.2)
    with pytest.raises(ValueError, match="true or false"):
        RetentionConfig(host_tier="false")


@pytest.mark.parametrize("args", [(0, 1, 1), (1, 1, 0), (math.nan, 1, 1), (1, -1, 1)])
def test_a_host_tier_with_bad_sizes_is_refused(args):
    from mars.policy.engine.base import HostTier

    with pytest.raises(ValueError):
        HostTier(*args)
