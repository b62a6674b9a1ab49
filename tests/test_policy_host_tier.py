"""The three-place retention rule (mars.policy.engine.host_tier): pinned, parked on the host
and read back before the tool returns, or dropped. Pure policy: no vLLM here."""

from __future__ import annotations

import math
import random

import pytest

from mars.policy.engine.base import KvPressure, PinCandidate
from mars.policy.engine.host_tier import (HostLink, HostPool, Place, ThreePlaceRetention)
from mars.policy.engine.retention import CostBenefitRetention, RetentionConfig

#: Qwen3-Coder-30B-A3B's KV per 16-token block in BF16: 48 layers x 4 KV heads x 128 x 2 x 2 B
BLOCK_BYTES = 16 * 48 * 4 * 128 * 2 * 2
#: a PCIe Gen5 x16 link at a round 25 GB/s each way (the tests' own number, not a claim)
LINK = HostLink(d2h_bytes_per_s=25e9, h2d_bytes_per_s=25e9, latency_s=1e-4)
ROOMY_HOST = HostPool(capacity_bytes=64 << 30)


def _rule(durations: list[float] | None = None, tool: str = "pytest", link=LINK):
    two = CostBenefitRetention(RetentionConfig(prefill_tokens_per_s=10_000.0))
    for d in durations or []:
        two.observe_tool(tool, d)
    return ThreePlaceRetention(two, link, BLOCK_BYTES)


def _busy_pool() -> KvPressure:
    """70 % of the pool spoken for: past the knee, so holding memory has a price."""
    return KvPressure(total_blocks=1000, free_blocks=300, pinned_blocks=100,
                      waiting_demand_blocks=0)


def _cand(blocks=100, tokens=1600, tool="pytest", started=0.0, sid="s1") -> PinCandidate:
    return PinCandidate(session_id=sid, blocks=blocks, context_tokens=tokens, tool=tool,
                        started=started)


def test_a_long_tool_under_pressure_parks_on_the_host_and_reads_back_before_it_returns():
    rule = _rule([10.0] * 20)
    p = rule.admit(_cand(), _busy_pool(), ROOMY_HOST, now=0.0)
    assert p.place is Place.HOST, p
    # dropping would recompute 1,600 tokens at 10K tok/s; pinning 10 s holds memory others want
    assert p.costs["dropped"] == pytest.approx(0.16)
    assert p.costs["host"] < p.costs["dropped"]
    # the read-back starts one read's time before the tool's (fixed) 10 s, not at the return
    nbytes = 100 * BLOCK_BYTES
    assert p.read_in_s == pytest.approx(10.0 - LINK.read_s(nbytes))
    assert rule.two_place.tau_of("s1") is None  # no pin is kept beside the host copy


def test_with_no_host_tier_the_rule_is_the_two_place_rule():
    """Three places only add an option: with no link, no host pool, or a full one, every
    answer is the two-place rule's (same place, same pin)."""
    rng = random.Random(7)
    durations = [rng.expovariate(1 / 6.0) for _ in range(40)]
    for link, host in ((None, ROOMY_HOST), (LINK, None), (LINK, HostPool(capacity_bytes=0))):
        three = _rule(durations, link=link)
        two = CostBenefitRetention(RetentionConfig(prefill_tokens_per_s=10_000.0))
        for d in durations:
            two.observe_tool("pytest", d)
        for i in range(200):
            total = 1000
            free = rng.randint(0, total)
            kv = KvPressure(total, free, 0, rng.randint(0, 400))
            c = _cand(blocks=rng.randint(1, 300), tokens=rng.randint(16, 64_000), sid=f"s{i}")
            tau = two.admit(c, kv, 0.0)
            p = three.admit(c, kv, host, now=0.0)
            assert p.place is (Place.PINNED if tau > 0 else Place.DROPPED), (i, p, tau)
            assert p.pin_s == pytest.approx(tau)
            assert "host" not in p.costs
            # later, under another pool: the two-place keep decides, from what is left
            now = rng.uniform(0.1, 30.0)
            kv2 = KvPressure(total, rng.randint(0, total), 0, rng.randint(0, 400))
            kept = tau > 0 and two.keep(c, kv2, now)
            q = three.reconsider(c, kv2, host, now=now)
            assert q.place is (Place.PINNED if kept else Place.DROPPED), (i, q, kept)
            if kept:
                assert q.pin_s == pytest.approx(tau - now)


def test_a_free_pool_keeps_pinning_rather_than_moving_blocks():
    """Below the knee a held block costs nobody anything: the pin is free, and the host
    would only add a read on the path (the llm-d lesson: do not move what need not move)."""
    rule = _rule([10.0] * 20)
    kv = KvPressure(total_blocks=1000, free_blocks=900, pinned_blocks=0, waiting_demand_blocks=0)
    p = rule.admit(_cand(), kv, ROOMY_HOST, now=0.0)
    assert p.place is Place.PINNED and p.pin_s > 10.0


def test_a_slow_link_and_short_tools_never_park_on_the_host():
    """A tool that returns in 50 ms is back before a 1 GB/s write of 157 MB lands: the host
    saves nothing, so the answer is the two-place one."""
    slow = HostLink(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)
    rule = _rule([0.05] * 20, link=slow)
    p = rule.admit(_cand(), _busy_pool(), ROOMY_HOST, now=0.0)
    assert p.place is not Place.HOST, p


def test_the_read_back_follows_the_tools_own_durations():
    """A tool that always takes 8 s is read back just before 8 s, one that takes 20 s just
    before 20 s. A tool that returns at 2 s or at 14 s, half and half: with a fast link the
    early returns eat one short read and the blocks are back for the late ones; with a slow
    link and a cheap pool the read is what costs, and it is done before the early returns."""
    r = LINK.read_s(100 * BLOCK_BYTES)
    for d in (8.0, 20.0):
        p = _rule([d] * 40).admit(_cand(), _busy_pool(), ROOMY_HOST, now=0.0)
        assert p.place is Place.HOST and p.read_in_s == pytest.approx(d - r)
    bimodal = [2.0] * 20 + [14.0] * 20
    fast = _rule(bimodal).admit(_cand(), _busy_pool(), ROOMY_HOST, now=0.0)
    assert fast.place is Place.HOST and fast.read_in_s == pytest.approx(14.0 - r)
    slow = HostLink(d2h_bytes_per_s=2e9, h2d_bytes_per_s=2e9)
    cheap = KvPressure(total_blocks=1000, free_blocks=450, pinned_blocks=100,
                       waiting_demand_blocks=0)  # 55 % spoken for: just past the knee
    rule = _rule(bimodal, link=slow)
    p = rule.admit(_cand(), cheap, ROOMY_HOST, now=0.0)
    assert p.place is Place.HOST and p.costs["host"] < p.costs["pinned"]
    assert p.read_in_s == pytest.approx(2.0 - slow.read_s(100 * BLOCK_BYTES))


def test_the_read_back_start_is_the_best_of_every_start_time():
    """The rule tries only starts derived from the tool's durations; a dense scan of every
    start time finds none cheaper."""
    rng = random.Random(11)
    for trial in range(20):
        left = sorted(rng.uniform(0.05, 30) for _ in range(rng.randint(1, 12)))
        rule = _rule()
        nbytes, blocks = rng.randint(1, 400) * BLOCK_BYTES, 100
        # up to p B = 50: past p B = 1 holding a block-second costs more than a second of
        # waiting, and the start "at the return" must win
        price = rng.choice([1e-5, 1e-4, 1e-3, 1e-2, 0.05, 0.5])
        backlog = rng.choice([0.0, 0.5])
        best, s_best = rule.host_cost(nbytes, blocks, price, left, backlog)
        w = backlog + LINK.write_s(nbytes)
        r = LINK.read_s(nbytes)

        def cost(s):
            total = 0.0
            for d in left:
                total += price * blocks * min(d, w)
                if d < w:
                    continue
                total += r if d < s else max(0.0, s + r - d) + price * blocks * (d - s)
            return total / len(left)

        assert cost(s_best) == pytest.approx(best)
        for i in range(3001):
            s = w + i * (31.0 - w) / 3000
            assert cost(s) >= best - 1e-9, (trial, s, cost(s), s_best, best)


def test_a_backlogged_link_delays_the_write_and_the_blocks_stay_meanwhile():
    rule = _rule([10.0] * 20)
    idle = rule.admit(_cand(), _busy_pool(), ROOMY_HOST, now=0.0)
    rule2 = _rule([10.0] * 20)
    queued = rule2.admit(_cand(), _busy_pool(),
                         HostPool(capacity_bytes=64 << 30, link_backlog_s=2.0), now=0.0)
    assert queued.costs["host"] > idle.costs["host"]  # 2 s more of holding the blocks


def test_a_pin_reconsidered_when_the_pool_fills_moves_to_the_host():
    """Pinned while the pool was free; 5 s into the tool a burst fills it: the two-place rule
    would now drop the pin, the third place parks the blocks and reads them back before the
    peers still running return (every tool left returns at 30 s)."""
    rule = _rule([2.0] * 20 + [30.0] * 20)
    c = _cand()
    free = KvPressure(total_blocks=1000, free_blocks=900, pinned_blocks=0,
                      waiting_demand_blocks=0)
    first = rule.admit(c, free, ROOMY_HOST, now=0.0)
    assert first.place is Place.PINNED
    burst = KvPressure(total_blocks=1000, free_blocks=100, pinned_blocks=100,
                       waiting_demand_blocks=500)
    later = rule.reconsider(c, _busy_pool(), ROOMY_HOST, now=5.0)
    assert later.place is Place.HOST, later
    assert later.read_in_s == pytest.approx(25.0 - LINK.read_s(100 * BLOCK_BYTES))
    assert rule.two_place.tau_of("s1") is None  # the pin is let go
    # a burst that prices even the write out: drop
    worst = _rule([2.0] * 20 + [30.0] * 20)
    worst.admit(c, free, ROOMY_HOST, now=0.0)
    assert worst.reconsider(c, burst, ROOMY_HOST, now=5.0).place is Place.DROPPED


def test_a_tool_that_outlived_every_peer_is_not_bet_on():
    rule = _rule([1.0] * 20)
    p = rule.reconsider(_cand(), _busy_pool(), ROOMY_HOST, now=3.0)
    assert p.place is Place.DROPPED and "host" not in p.costs


def test_a_write_no_return_outlasts_is_not_offered():
    """Tools return in 0.3 s; writing 5,000 tokens' blocks at 1 GB/s takes 0.49 s: the blocks
    would never leave the GPU, so "host" would be a pin by another name, past the two-place
    rule's say. It is not offered."""
    slow = HostLink(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9)
    rule = _rule([0.3] * 20, link=slow)
    c = _cand(blocks=313, tokens=5000)
    assert slow.write_s(313 * BLOCK_BYTES) > 0.3
    p = rule.admit(c, _busy_pool(), ROOMY_HOST, now=0.0)
    assert p.place is not Place.HOST and "host" not in p.costs, p


def test_zero_second_tools_count_at_admission():
    rule = _rule([0.0] * 20)
    assert rule.durations_left("pytest", elapsed=0.0) == [0.0] * 20


def test_with_no_observed_tools_the_prior_is_used_and_is_memoryless():
    rule = _rule()
    a = rule.admit(_cand(sid="a"), _busy_pool(), ROOMY_HOST, now=0.0)
    # b's tool has run 40 s already: under the memoryless prior it has as long left as a's
    b = rule.reconsider(_cand(sid="b", started=-40.0), _busy_pool(), ROOMY_HOST, now=0.0)
    assert a.place is b.place is Place.HOST
    assert math.isclose(a.read_in_s, b.read_in_s)
    left = rule.durations_left("pytest", elapsed=0.0)
    assert left == rule.durations_left("pytest", elapsed=40.0)  # memoryless
    assert len(left) == 64 and sum(left) / 64 == pytest.approx(5.0, rel=0.1)


def test_many_observed_durations_are_priced_through_a_bounded_set_of_quantiles():
    rng = random.Random(3)
    rule = _rule([rng.uniform(1, 20) for _ in range(500)])
    left = rule.durations_left("pytest", elapsed=0.0)
    assert len(left) == 64 and left == sorted(left) and 1 <= left[0] and left[-1] <= 20


@pytest.mark.parametrize("kw", [dict(d2h_bytes_per_s=0, h2d_bytes_per_s=1e9),
                                dict(d2h_bytes_per_s=1e9, h2d_bytes_per_s=-1),
                                dict(d2h_bytes_per_s=math.inf, h2d_bytes_per_s=1e9),
                                dict(d2h_bytes_per_s=1e9, h2d_bytes_per_s=1e9, latency_s=-1)])
def test_bad_links_are_refused(kw):
    with pytest.raises(ValueError):
        HostLink(**kw)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        HostPool(capacity_bytes=-1)
    with pytest.raises(ValueError):
        ThreePlaceRetention(CostBenefitRetention(), LINK, block_bytes=0)
