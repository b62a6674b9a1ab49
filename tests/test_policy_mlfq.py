"""WindowedMLFQ: levels from size, service and waiting; eviction alignment; starvation bound."""

from __future__ import annotations

import math

import pytest

from mars.policy.engine.base import CallRecord, OrderingPolicy
from mars.policy.engine.mlfq import MLFQConfig, WindowedMLFQ


def call(rid: str, prompt: int, *, arrival: float = 0.0, last_served: float | None = None,
         blocks: int = 0, session: str | None = None, cached: int = 0,
         running: bool = False) -> CallView:
    return CallRecord(
        request_id=rid, session_id=session, prompt_tokens=prompt, computed_tokens=0,
        cached_tokens=cached, output_tokens=0, max_tokens=64, arrival_time=arrival,
        last_served=arrival if last_served is None else last_served, num_blocks=blocks,
        running=running)


def test_is_an_ordering_policy():
    pol = WindowedMLFQ()
    assert isinstance(pol, OrderingPolicy)
    assert pol.name == "mars"


@pytest.mark.parametrize("prompt,level", [
    (1, 0), (100, 0), (1024, 0), (1025, 1), (2048, 1), (2049, 2), (6000, 3), (16_000, 4),
    (100_000, 7), (260_000, 8), (10_000_000, 9),
])
def test_base_level_is_log2_of_prompt_over_base(prompt, level):
    pol = WindowedMLFQ()
    assert pol.base_level(prompt) == level
    assert pol.level(call("r", prompt), now=0.0) == level


def test_small_prompt_starts_ahead_of_large():
    pol = WindowedMLFQ()
    small = call("small", 300, arrival=5.0)   # arrived later
    large = call("large", 50_000, arrival=4.0)
    order = sorted([large, small], key=lambda c: pol.key(c, 5.0))
    assert [c.request_id for c in order] == ["small", "large"]
    assert pol.level_of("small") == 0 and pol.level_of("large") == 6


def test_demotion_after_quota_then_next_quota():
    pol = WindowedMLFQ(MLFQConfig(promote_after_s=0))
    c = call("r", 500)
    pol.on_scheduled(c, 1023, now=0.0)
    assert pol.level(c, 0.1) == 0          # quota(0) = 1024 not yet used up
    pol.on_scheduled(c, 1, now=0.1)
    assert pol.level(c, 0.2) == 1          # used up -> demoted one level
    pol.on_scheduled(c, 2047, now=0.2)
    assert pol.level(c, 0.3) == 1          # 1024 + 2047 < 1024 + 2048
    pol.on_scheduled(c, 1, now=0.3)
    assert pol.level(c, 0.4) == 2
    pol.on_scheduled(c, 10**9, now=0.4)
    assert pol.level(c, 0.5) == 9          # clamped at the lowest level


def test_quota_grows_with_level():
    pol = WindowedMLFQ()
    assert [pol.quota(lvl) for lvl in range(4)] == [1024, 2048, 4096, 8192]
    # a call's prefill alone never exhausts the quota of its own base level
    big = call("big", 8000)  # level 3, quota 8192
    pol.on_scheduled(big, 8000, now=0.0)
    assert pol.level(big, 0.0) == 3


def test_window_expiry_restores_level():
    pol = WindowedMLFQ(MLFQConfig(window_s=10.0, window_buckets=10, promote_after_s=0))
    c = call("r", 500)
    pol.on_scheduled(c, 600, now=0.5)      # bucket [0, 1)
    pol.on_scheduled(c, 600, now=5.5)      # bucket [5, 6)
    assert pol.windowed_service("r", 5.5) == 1200
    assert pol.level(c, 5.5) == 1
    assert pol.level(c, 10.99) == 1        # first bucket still inside the window
    assert pol.level(c, 11.0) == 0         # first bucket ended 10 s ago -> out
    assert pol.windowed_service("r", 11.0) == 600
    assert pol.windowed_service("r", 16.0) == 0


def test_promotion_one_level_per_period_and_reset_on_service():
    pol = WindowedMLFQ(MLFQConfig(promote_after_s=4.0))
    c = call("r", 20_000, arrival=0.0)     # base level 5
    assert pol.level(c, 0.0) == 5
    assert pol.level(c, 3.99) == 5
    assert pol.level(c, 4.0) == 4
    assert pol.level(c, 8.0) == 3
    assert pol.level(c, 19.99) == 1
    assert pol.level(c, 20.0) == 0
    assert pol.level(c, 100.0) == 0        # bounded at level 0
    served = call("r", 20_000, arrival=0.0, last_served=100.0)
    assert pol.level(served, 100.5) == 5   # served again: judged by size + service again


def test_promotion_bound_from_lowest_level():
    cfg = MLFQConfig(promote_after_s=4.0)
    pol = WindowedMLFQ(cfg)
    assert pol.promotion_bound_s == pytest.approx(36.0)   # (10 - 1) * 4
    c = call("r", 10_000_000, arrival=0.0)                 # lowest level
    pol.on_scheduled(c, 10**9, now=0.0)
    assert pol.level(c, 0.0) == 9
    stale = call("r", 10_000_000, arrival=0.0, last_served=0.0)
    assert pol.level(stale, pol.promotion_bound_s - 1e-6) == 1
    assert pol.level(stale, pol.promotion_bound_s) == 0
    assert WindowedMLFQ(MLFQConfig(promote_after_s=0)).promotion_bound_s == math.inf


def test_starved_call_goes_ahead_of_fresh_level0_calls():
    pol = WindowedMLFQ(MLFQConfig(promote_after_s=1.0))
    starved = call("starved", 5000, arrival=0.0)           # base 3
    fresh = [call(f"f{i}", 200, arrival=9.0 + i * 0.1) for i in range(3)]
    order = sorted(fresh + [starved], key=lambda c: pol.key(c, 10.0))
    assert order[0].request_id == "starved"
    assert pol.level_of("starved") == 0


def test_eviction_order_larger_initial_footprint_at_back_within_level():
    pol = WindowedMLFQ()
    now = 1.0
    running = [
        call("a", 600, arrival=0.1, last_served=now, blocks=20, running=True),
        call("b", 900, arrival=0.2, last_served=now, blocks=30, running=True),
        call("c", 700, arrival=0.3, last_served=now, blocks=50, running=True),
        call("d", 700, arrival=0.4, last_served=now, blocks=22, running=True),
        # lower priority (bigger prompt) but small footprint: still evicted first
        call("low", 40_000, arrival=0.0, last_served=now, blocks=5, running=True),
    ]
    order = [c.request_id for c in sorted(running, key=lambda c: pol.key(c, now))]
    # preemption takes from the back: lowest level first, then the larger prompt, then the
    # newer call; how far a call has grown since (c has decoded most) does not move it back,
    # which would evict the calls closest to completion
    assert order == ["a", "c", "d", "b", "low"]


def test_served_is_on_scheduled_then_key():
    fused, split = WindowedMLFQ(), WindowedMLFQ()
    for t, (prompt, tokens) in enumerate([(500, 300), (500, 900), (3000, 2000), (500, 5000)]):
        now = 10.0 + t * 3
        c = call(f"r{t % 2}", prompt, arrival=0.0, last_served=now, blocks=7, running=True)
        split.on_scheduled(c, tokens, now)
        assert fused.served(c, tokens, now) == split.key(c, now)
        assert fused.level_of(c.request_id) == split.level_of(c.request_id)
    c = call("idle", 500, arrival=0.0, last_served=0.0)
    assert fused.served(c, 0, 20.0) == split.key(c, 20.0)  # nothing served: plain key


def test_session_service_demotes_later_rounds_within_the_window():
    """Service is charged to the session: a session that just consumed a lot sinks below one
    that has not, until its service ages out of the window; a session-less call is its own."""
    pol = WindowedMLFQ(MLFQConfig(promote_after_s=0))
    r1 = call("s1-r1", 100_000, session="s1")
    pol.on_scheduled(r1, 400_000, now=0.0)               # heavy first round
    assert pol.level(r1, 1.0) == 9
    pol.on_finished("s1-r1", "s1", now=2.0)
    assert pol.level_of("s1-r1") is None
    r2 = call("s1-r2", 100_000, session="s1", arrival=3.0)
    other = call("s2-r1", 100_000, session="s2", arrival=3.0)
    assert pol.level(other, 3.0) == pol.base_level(100_000) == 7
    assert pol.level(r2, 3.0) == 9                       # s1's recent service counts
    small = call("s1-r3", 800, session="s1", arrival=4.0)
    assert pol.level(small, 4.0) > pol.level(call("x", 800), 4.0) == 0
    window = pol.config.window_s + pol.config.window_s / pol.config.window_buckets
    assert pol.level(r2, window + 0.1) == 7              # aged out: judged afresh
    pol.on_scheduled(small, 50_000, window + 0.2)
    assert pol.level(small, window + 0.3) > 0
    pol.on_session_end("s1", window + 0.4)
    assert pol.level(small, window + 0.5) == 0


def test_many_short_rounds_of_one_session_are_demoted():
    """What per-call accounting never did: an agent call (a few hundred tokens) stays far
    below its level's quota, but a session returning round after round adds up."""
    pol = WindowedMLFQ(MLFQConfig(promote_after_s=0))
    for k in range(12):
        c = call(f"busy-r{k}", 700, session="busy", arrival=float(k))
        pol.on_scheduled(c, 900, now=float(k))
        pol.on_finished(c.request_id, "busy", now=float(k) + 0.5)
    nxt = call("busy-r12", 700, session="busy", arrival=12.0)
    fresh = call("calm-r0", 700, session="calm", arrival=12.0)
    assert pol.level(fresh, 12.0) == 0 < pol.level(nxt, 12.0)
    scoped = WindowedMLFQ(MLFQConfig(promote_after_s=0, service_scope="call"))
    for k in range(12):
        c = call(f"busy-r{k}", 700, session="busy", arrival=float(k))
        scoped.on_scheduled(c, 900, now=float(k))
        scoped.on_finished(c.request_id, "busy", now=float(k) + 0.5)
    assert scoped.level(nxt, 12.0) == 0


def test_cached_tokens_are_not_service():
    pol = WindowedMLFQ(MLFQConfig(promote_after_s=0))
    # 40K of a 41K prompt hit the prefix cache: the engine schedules (and we charge) 1K
    c = CallRecord("r", None, 41_000, 41_000, 40_000, 0, 64, 0.0, 0.0, 1282, True)
    pol.on_scheduled(c, 1_000, now=0.0)
    assert pol.windowed_service("r", 0.0) == 1_000
    # the base level is judged by remaining (uncached) work: 1K tokens
    assert pol.level(c, 0.0) == 0
    # opt-out: the prompt length
    full = WindowedMLFQ(MLFQConfig(promote_after_s=0, discount_cached=False))
    assert full.level(c, 0.0) == pol.base_level(41_000)


def _simulate_flood(cfg: MLFQConfig, *, duration_s: float = 40.0, dt: float = 0.05,
                    budget: int = 400, large_at: float = 1.0,
                    large_prompt: int = 8000) -> tuple[list[float], float | None]:
    """Discrete-time engine: 2 small calls (196-token prompt, 4 output tokens) arrive every
    step -- in steady state exactly the 400-token step budget, so there are no leftovers --
    plus one ``large_prompt``-token call at ``large_at`` (once the flood is in steady state).
    Each step serves the policy's order front to back within the budget (chunked prefill, one
    token per decode). Returns the large call's service times and finish time."""
    pol = WindowedMLFQ(cfg)
    live: dict[str, dict] = {}
    large_served: list[float] = []
    large_finished = None
    seq = 0
    steps = int(duration_s / dt)
    for i in range(steps):
        now = i * dt
        if i == round(large_at / dt):
            live["large"] = dict(prompt=large_prompt, out=1, done=0, arrival=now, last=now)
        for _ in range(2):
            live[f"s{seq}"] = dict(prompt=196, out=4, done=0, arrival=now, last=now)
            seq += 1
        views = {
            rid: CallRecord(rid, rid, st["prompt"], st["done"], 0, max(0, st["done"] - st["prompt"]),
                          st["out"], st["arrival"], st["last"], (st["done"] + 31) // 32,
                          st["done"] > 0)
            for rid, st in live.items()}
        order = sorted(views.values(), key=lambda c: pol.key(c, now))
        left = budget
        for v in order:
            if left <= 0:
                break
            st = live[v.request_id]
            need = st["prompt"] - st["done"] if st["done"] < st["prompt"] else 1
            got = min(need, left)
            left -= got
            st["done"] += got
            st["last"] = now
            pol.on_scheduled(v, got, now)
            if v.request_id == "large":
                large_served.append(now)
            if st["done"] >= st["prompt"] + st["out"]:
                del live[v.request_id]
                pol.on_finished(v.request_id, v.session_id, now)
                if v.request_id == "large":
                    large_finished = now
    return large_served, large_finished


def test_flood_large_call_served_within_promotion_bound():
    cfg = MLFQConfig(promote_after_s=0.5)
    bound = WindowedMLFQ(cfg).promotion_bound_s
    assert bound == pytest.approx(4.5)
    dt = 0.05
    served, finished = _simulate_flood(cfg, dt=dt, large_at=1.0)
    assert served, "large call starved"
    assert served[0] - 1.0 <= bound + dt
    gaps = [b - a for a, b in zip(served, served[1:])]
    assert max(gaps) <= bound + dt
    assert finished is not None


def test_flood_lowest_level_call_reaches_front_exactly_at_bound():
    cfg = MLFQConfig(promote_after_s=0.5)
    bound = WindowedMLFQ(cfg).promotion_bound_s
    dt = 0.05
    # 600K tokens: base level 9, the lowest -- the worst case the bound is stated for
    served, _ = _simulate_flood(cfg, dt=dt, duration_s=12.0, large_prompt=600_000)
    assert served
    assert bound - dt <= served[0] - 1.0 <= bound + dt
    assert max(b - a for a, b in zip(served, served[1:])) <= bound + dt


def test_flood_without_promotion_starves_large_call():
    served, finished = _simulate_flood(MLFQConfig(promote_after_s=0), duration_s=10.0)
    assert served == [] and finished is None


def test_key_is_idempotent_and_state_dropped_on_finish():
    pol = WindowedMLFQ()
    c = call("r", 3000, blocks=7)
    pol.on_scheduled(c, 100, now=1.0)
    assert pol.key(c, 2.0) == pol.key(c, 2.0) == (2, 0, 3000, 0.0)
    pol.on_finished("r", None, now=3.0)
    assert pol.windowed_service("r", 3.0) == 0
    assert pol.level_of("r") is None


def test_horizon_is_a_promise_the_key_keeps():
    """Within the returned token and time horizon no amount of service moves the key; once
    the token horizon is used up, it may."""
    pol = WindowedMLFQ(MLFQConfig(promote_after_s=4.0))
    now = 100.0
    c = call("r", 600, arrival=now, last_served=now, blocks=3, running=True)
    k0 = pol.served(c, 100, now)
    tokens, until = pol.horizon(c, now)
    assert tokens == 1024 - 100 and now < until <= now + pol.config.window_s / 16
    t = now
    served = 0
    while served + 50 < tokens:
        t += 0.01
        served += 50
        assert pol.served(c, 50, t) == k0
    assert pol.served(c, tokens - served, t) != k0  # crossed the quota: demoted
    # an unserved waiting call: its horizon ends at the next promotion
    w = call("w", 5000, arrival=0.0, last_served=0.0)
    pol.key(w, 1.0)
    assert pol.horizon(w, 1.0)[1] <= 4.0
    assert pol.key(w, 4.0) != pol.key(w, 1.0)
