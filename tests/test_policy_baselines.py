"""Baselines: Autellix PLAS, InferCept, Continuum, Continuum-Dy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mars.policy.engine.base import (CallRecord, CallView, KvPressure, OrderingPolicy, PinCandidate,
                                     RetentionPolicy)
from mars.policy.engine.baselines import (
    AutellixPLAS,
    ContinuumConfig,
    ContinuumDyConfig,
    ContinuumDyRetention,
    ContinuumRetention,
    InferceptRetention,
    PLASConfig,
)


def call(rid: str, session: str | None, *, arrival: float = 0.0, prompt: int = 1000) -> CallView:
    return CallRecord(request_id=rid, session_id=session, prompt_tokens=prompt, computed_tokens=0,
                    cached_tokens=0, output_tokens=0, max_tokens=64, arrival_time=arrival,
                    last_served=arrival, num_blocks=0, running=False)


def kv(free: int, *, pinned: int = 0, waiting: int = 0, total: int = 10_000) -> KvPressure:
    return KvPressure(total_blocks=total, free_blocks=free, pinned_blocks=pinned,
                      waiting_demand_blocks=waiting)


def cand(tool: str | None = "t", *, blocks: int = 2000, ctx: int = 32_000,
         started: float = 0.0, session: str = "s") -> PinCandidate:
    return PinCandidate(session_id=session, blocks=blocks, context_tokens=ctx, tool=tool,
                        started=started)


# ====================================================================== Autellix PLAS


def test_plas_protocol_and_queue_bounds():
    pol = AutellixPLAS()
    assert isinstance(pol, OrderingPolicy) and pol.name == "autellix"
    # quanta 4096, 8192, 16384, ...: queue i ends at 4096 * (2**(i+1) - 1)
    assert pol.queue_of_service(0) == 0
    assert pol.queue_of_service(4095) == 0
    assert pol.queue_of_service(4096) == 1
    assert pol.queue_of_service(12_287) == 1
    assert pol.queue_of_service(12_288) == 2
    assert pol.queue_of_service(10**9) == 7


def test_plas_program_service_across_rounds_orders_calls():
    pol = AutellixPLAS(PLASConfig(beta=1e9))          # no anti-starvation here
    r1 = call("a-r1", "a", arrival=0.0)
    pol.on_scheduled(r1, 60_000, now=0.0)
    pol.on_scheduled(r1, 40_000, now=0.1)
    pol.on_finished("a-r1", "a", now=0.2)
    assert pol.program_service("a") == 100_000        # kept after the round finished
    a2 = call("a-r2", "a", arrival=1.0)               # arrives first...
    b1 = call("b-r1", "b", arrival=2.0)               # ...but b has attained nothing
    order = sorted([a2, b1], key=lambda c: pol.key(c, 2.0))
    assert [c.request_id for c in order] == ["b-r1", "a-r2"]
    assert pol.key(a2, 2.0)[0] == 4                   # 100K lies in queue 4


def test_plas_fcfs_inside_a_queue_and_demotion():
    pol = AutellixPLAS(PLASConfig(beta=1e9))
    x = call("x", "x", arrival=1.0)
    y = call("y", "y", arrival=2.0)
    assert sorted([y, x], key=lambda c: pol.key(c, 3.0)) == [x, y]
    pol.on_scheduled(x, 4095, now=3.0)
    assert pol.key(x, 3.1)[0] == 0                    # quantum of queue 0 not used up
    pol.on_scheduled(x, 1, now=3.1)
    assert pol.key(x, 3.2)[0] == 1                    # used up -> demoted
    assert sorted([x, y], key=lambda c: pol.key(c, 3.2)) == [y, x]


def test_plas_sessionless_call_is_its_own_program():
    pol = AutellixPLAS()
    c = call("solo", None)
    pol.on_scheduled(c, 50_000, now=0.0)
    assert pol.program_service("solo") == 50_000
    pol.on_finished("solo", None, now=1.0)
    assert pol.program_service("solo") == 0


def test_plas_anti_starvation_promotes_to_top_queue():
    pol = AutellixPLAS(PLASConfig(beta=4.0, default_step_s=0.05))
    r1 = call("a-r1", "a", arrival=0.0)
    pol.on_scheduled(r1, 100_000, now=0.0)            # one step: 0.05 s of service
    pol.on_finished("a-r1", "a", now=0.05)            # no waiting in round 1
    a2 = call("a-r2", "a", arrival=10.0)
    b = call("b-r1", "b", arrival=10.05)
    pol.on_scheduled(call("warm", "w", arrival=10.05), 10_000, now=10.05)  # w gets served
    w = call("warm", "w", arrival=10.05)
    # at 10.1: a waited 0.1 s for 0.05 s of service -> ratio 2 < beta: stays in queue 4
    assert pol.starvation_ratio(a2, 10.1) == pytest.approx(2.0)
    assert pol.key(a2, 10.1)[0] == 4
    # at 10.3: ratio 6 >= beta -> queue 0, FCFS with the other queue-0 call (a arrived first)
    assert pol.key(a2, 10.3)[0] == 0
    order = sorted([w, b, a2], key=lambda c: pol.key(c, 10.3))
    assert order[0].request_id == "a-r2"
    assert order[-1].request_id == "warm"             # 10K attained -> queue 1


# ====================================================================== InferCept


def test_infercept_break_even_and_decision():
    pol = InferceptRetention()
    assert isinstance(pol, RetentionPolicy) and pol.name == "infercept"
    k = kv(free=5_000, pinned=1_000)                  # batch holds 10000-5000-1000-2000
    c = cand()
    # R = 32000 / 10000 = 3.2 s; tau_be = R * (2000 + 2000) / 2000
    assert pol.break_even_s(c, k) == pytest.approx(6.4)
    for _ in range(5):
        pol.observe_tool("t", 5.0)                    # mean 5 <= 6.4 -> preserve
    assert pol.admit(c, k, now=0.0) == pytest.approx(6.4)
    # a bigger co-running batch raises the cost of recomputing, so the break-even grows
    assert pol.break_even_s(c, kv(free=1_000, pinned=1_000)) == pytest.approx(3.2 * 4)
    for _ in range(20):
        pol.observe_tool("slow", 9.0)                 # mean 9 > 6.4 -> discard
    assert pol.admit(cand("slow", session="s2"), k, now=0.0) == 0.0


def test_continuum_dy_prices_a_reload_from_host_memory_when_the_engine_offloads():
    """Continuum's value of a warm resume counts "the potential cost of recomputation or
    reloading (if CPU offloading enabled)": with a host tier, reload(r) is the read back of
    what the host holds plus the recompute of the rest, when that is cheaper than the whole
    recompute; ``offload: false`` (or no tier) keeps the recompute; a context the host pool
    cannot hold is recomputed."""
    from mars.policy.engine.base import HostTier

    tier = HostTier(98_304, 64 * 2**30, 30e9, block_tokens=16)
    c = PinCandidate(session_id="s", blocks=2000, context_tokens=32_000, tool="t",
                     started=0.0, prompt_tokens=31_500)
    pol, plain = ContinuumDyRetention(), ContinuumDyRetention(ContinuumDyConfig(offload=False))
    for p in (pol, plain):
        p.attach_host_tier(tier)
    read = 31_488 * 98_304 / 30e9  # the prompt's whole blocks come back (0.10 s)
    assert pol.reload_s(c) == pytest.approx(read + 512 / 10_000)
    assert plain.reload_s(c) == ContinuumDyRetention().reload_s(c) == pytest.approx(3.2)
    # the cold start's closed form, on each value: m ln(V / m), m = 1 s
    assert pol.admit(c, kv(5_000), now=0.0) == 0.0  # V = 0.15 s < m: not worth a pin
    assert plain.admit(c, kv(5_000), now=0.0) == pytest.approx(math.log(3.2))
    huge = PinCandidate(session_id="h", blocks=9000, context_tokens=10_000_000, tool="t",
                        started=0.0, prompt_tokens=10_000_000)
    assert pol.reload_s(huge) == pytest.approx(1000.0)  # the host cannot hold it
    with pytest.raises(ValueError, match="offload"):
        ContinuumDyConfig(offload="no")


def test_infercept_swaps_when_the_engine_has_a_host_tier():
    """InferCept's third option: with vLLM offloading to host memory a released context
    returns by a read (only the request waits: vLLM copies on its own stream) plus the
    recompute of what the host does not hold, so the break-even pin shrinks to that waste;
    ``swap: false`` keeps discard-or-preserve."""
    from mars.policy.engine.base import HostTier
    from mars.policy.engine.baselines import InferceptConfig

    tier = HostTier(98_304, 64 * 2**30, 30e9, block_tokens=16)
    k = kv(free=5_000, pinned=1_000)
    c = PinCandidate(session_id="s", blocks=2000, context_tokens=32_000, tool="t",
                     started=0.0, prompt_tokens=31_500)
    pol, plain = InferceptRetention(), InferceptRetention(InferceptConfig(swap=False))
    for p in (pol, plain):
        p.attach_host_tier(tier)
        for _ in range(5):
            p.observe_tool("t", 5.0)
    read = 31_488 * 98_304 / 30e9  # the prompt's whole blocks come back
    swap = read * 2000 + (512 / 10_000) * 4000  # the rest is recomputed beside the batch
    assert pol.break_even_s(c, k) == pytest.approx(swap / 2000)
    assert plain.break_even_s(c, k) == pytest.approx(6.4)
    assert pol.admit(c, k, now=0.0) == 0.0  # a 5 s tool wastes more pinned than swapped
    assert plain.admit(c, k, now=0.0) == pytest.approx(6.4)
    with pytest.raises(ValueError, match="swap"):
        InferceptConfig(swap="no")
    # a context larger than the host pool cannot be swapped: discard or preserve again
    huge = cand(ctx=10_000_000, blocks=9_000)
    assert pol.break_even_s(huge, kv(free=9_000, total=100_000)) == pytest.approx(
        plain.break_even_s(huge, kv(free=9_000, total=100_000)))


def test_infercept_keep_only_checks_expiry():
    pol = InferceptRetention()
    pol.observe_tool("t", 1.0)
    c = cand(started=100.0)
    tau = pol.admit(c, kv(free=5_000), now=100.0)
    assert tau > 1.0
    # decided once: a full pool does not release it...
    assert pol.keep(c, kv(free=0, waiting=9_000), now=100.0 + tau - 0.01) is True
    # ...expiry does
    assert pol.keep(c, kv(free=5_000), now=100.0 + tau) is False


def test_infercept_expected_duration_fallbacks():
    pol = InferceptRetention()
    assert pol.durations.mean("t") == 5.0             # prior before anything is observed
    pol.observe_tool("other", 2.0)
    assert pol.durations.mean("t") == 2.0             # all-tool running mean


# ====================================================================== Continuum


def test_continuum_fixed_ttl():
    pol = ContinuumRetention()
    assert pol.name == "continuum"
    c = cand("fast", started=0.0)
    assert pol.admit(c, kv(free=100), now=0.0) == 2.0   # nothing known yet: pin
    for d in (1.0, 2.0):
        pol.observe_tool("fast", d)                       # mean 1.5 <= 2
    for d in (2.0, 4.0):
        pol.observe_tool("slow", d)                       # mean 3 > 2
    assert pol.admit(c, kv(free=100), now=0.0) == 2.0
    assert pol.keep(c, kv(free=0, waiting=9_000), now=1.99) is True
    assert pol.keep(c, kv(free=9_000), now=2.0) is False
    assert pol.admit(cand("slow", session="s2"), kv(free=9_000), now=0.0) == 0.0
    # unseen tool: judged by the all-tool mean (2.25 > 2)
    assert pol.admit(cand("new", session="s3"), kv(free=9_000), now=0.0) == 0.0
    custom = ContinuumRetention(ContinuumConfig(ttl_s=5.0, threshold_s=3.0))
    custom.observe_tool("slow", 3.0)
    assert custom.admit(cand("slow"), kv(free=9_000), now=0.0) == 5.0


# ====================================================================== Continuum-Dy


def test_continuum_dy_cold_start_ends_at_100_samples():
    import math

    pol = ContinuumDyRetention()
    assert pol.name == "continuum_dy"
    for _ in range(99):
        pol.observe_tool("t", 300.0)                  # even clearly long tools...
    # ...< 100 samples: the exponential prior decides
    assert pol.admit(cand(), kv(free=9_000), now=0.0) == pytest.approx(math.log(3.2))
    pol.observe_tool("t", 300.0)
    assert pol.admit(cand(), kv(free=9_000), now=0.0) == 0.0   # now the CDF speaks


def test_continuum_dy_argmax():
    pol = ContinuumDyRetention()
    for _ in range(100):
        pol.observe_tool("t", 3.0)
    # value = T_bar * eta + reload = 0 * 1 + 3.2; the only candidate is the observed 3 s:
    # 1 * 3.2 - 3 = 0.2 > 0
    assert pol.value_s(cand()) == pytest.approx(3.2)
    assert pol.admit(cand(), kv(free=9_000), now=0.0) == 3.0
    for _ in range(100):
        pol.observe_tool("t", 6.0)
    # half the durations are 6 s: tau=3 -> 0.5 * 3.2 - 3 < 0, tau=6 -> 3.2 - 6 < 0
    assert pol.admit(cand(), kv(free=9_000), now=0.0) == 0.0
    # queueing after eviction makes a warm resume worth more: 5 * 1 + 3.2 = 8.2
    pol.observe_queue_delay(4.0)
    pol.observe_queue_delay(6.0)
    assert pol.value_s(cand()) == pytest.approx(8.2)
    # scores: tau=3 -> 0.5 * 8.2 - 3 = 1.1; tau=6 -> 8.2 - 6 = 2.2
    assert pol.admit(cand(), kv(free=9_000), now=0.0) == 6.0
    # decided once: keep is pure expiry
    c = cand(started=0.0)
    pol.admit(c, kv(free=9_000), now=0.0)
    assert pol.keep(c, kv(free=0, waiting=9_000), now=5.9) is True
    assert pol.keep(c, kv(free=9_000), now=6.0) is False


def test_continuum_dy_eta_from_finished_sessions():
    pol = ContinuumDyRetention()
    assert pol.eta == 1.0                             # default before any session ends
    pol.observe_session(3)
    pol.observe_session(3)
    assert pol.eta == pytest.approx(1.0)              # equal lengths: perfectly predictable
    pol2 = ContinuumDyRetention()
    for t in (1, 5, 12):
        pol2.observe_session(t)
    pairs = [(d, t - d) for t in (1, 5, 12) for d in range(1, t + 1)]
    done, left = np.array(pairs, dtype=float).T
    expected = -np.corrcoef(done, left)[0, 1]
    assert 0.0 < expected < 1.0
    assert pol2.eta == pytest.approx(expected)
    # eta scales the queueing term
    for _ in range(100):
        pol2.observe_tool("t", 3.0)
    pol2.observe_queue_delay(5.0)
    assert pol2.value_s(cand()) == pytest.approx(5.0 * expected + 3.2)


def test_continuum_dy_tool_specific_vs_all_tool_fallback():
    pol = ContinuumDyRetention()
    for _ in range(100):
        pol.observe_tool("a", 0.4)
    for _ in range(50):
        pol.observe_tool("b", 20.0)
    # candidates are the observed durations: "a" has its own 100 -> P(0.4) = 1 -> 3.2 - 0.4
    assert pol.admit(cand("a"), kv(free=9_000), now=0.0) == 0.4
    assert pol.decision_rule() == "dynamic"
    # "b" has only 50: the all-tool CDF (100 x 0.4, 50 x 20) gives P(0.4) = 2/3 -> pin 0.4
    assert pol.durations.source("b", 100) == "all"
    assert pol.admit(cand("b", session="s2"), kv(free=9_000), now=0.0) == 0.4
    for _ in range(50):
        pol.observe_tool("b", 20.0)
    # with 100 of its own (all 20 s) nothing pays off: holding 20 s costs more than 3.2 s
    assert pol.durations.source("b", 100) == "tool"
    assert pol.admit(cand("b", session="s3"), kv(free=9_000), now=0.0) == 0.0
    assert pol.decisions == {"cold_start": 0, "dynamic": 3}


def test_continuum_dy_cold_start_decides_with_an_exponential_prior():
    """Before 100 tool durations the rule still decides (Exp(1 s) durations, eta = 1,
    T_bar = 0): tau* = ln(V / 1 s) -- not a fixed TTL, so it differs from continuum."""
    import math

    pol = ContinuumDyRetention()
    c = cand()  # reload 3.2 s (32K tokens at 10K tok/s)
    tau = pol.admit(c, kv(free=9_000), now=0.0)
    assert tau == pytest.approx(math.log(3.2))
    assert pol.decision_rule() == "cold_start"
    small = PinCandidate(session_id="s9", blocks=1, context_tokens=5_000, tool="t",
                         started=0.0)  # reload 0.5 s < mean 1 s: never worth pinning
    assert pol.admit(small, kv(free=9_000), now=0.0) == 0.0
    assert pol.decisions == {"cold_start": 2, "dynamic": 0}


def test_program_fcfs_orders_by_the_programs_first_arrival():
    from mars.policy.engine.baselines import ProgramFCFS

    pol = ProgramFCFS()
    assert isinstance(pol, OrderingPolicy)
    a0 = call("a-r0", "a", arrival=0.0, prompt=100)
    b0 = call("b-r0", "b", arrival=1.0, prompt=100)
    a1 = call("a-r1", "a", arrival=5.0, prompt=100)   # a's next round, after b started
    lone = call("x", None, arrival=2.0, prompt=100)
    keys = {c.request_id: pol.key(c, 6.0) for c in (a0, b0, a1, lone)}
    assert sorted(keys, key=keys.get) == ["a-r0", "a-r1", "b-r0", "x"]
    assert pol.horizon(a1, 6.0)[0] == float("inf")
    pol.on_session_end("a", 7.0)
    assert pol.num_programs == 1
    a2 = call("a-r2", "a", arrival=8.0, prompt=100)   # a new program under the same id
    assert pol.key(a2, 8.0) > pol.key(b0, 8.0)


def test_autellix_forgets_a_program_when_its_session_ends():
    pol = AutellixPLAS()
    c = call("s-r0", "s", arrival=0.0, prompt=100)
    pol.on_scheduled(c, 500, 0.1)
    pol.on_finished("s-r0", "s", 0.2)
    assert pol.num_programs == 1 and pol.program_service("s") == 500
    pol.on_session_end("s", 0.3)
    assert pol.num_programs == 0


# ====================================================================== llm-d's retention hint


def test_kv_hint_protects_marked_rounds_for_the_gap_quantile_whatever_the_pool():
    """llm-d's rule: every marked round's whole context, for the 0.9 quantile of the marked
    rounds' observed gaps; unmarked rounds (subagents) get nothing; the pool is never
    looked at (a full pool with a queue still gets the protection)."""
    from mars.policy.engine.hint import KvHintConfig, KvHintRetention

    pol = KvHintRetention(KvHintConfig(tools=("task",)))
    assert pol.name == "kv_hint"
    # nothing seen yet: the 0.9 quantile of the exponential prior (mean 5 s)
    assert pol.admit(cand("task"), kv(free=0, waiting=9_000), now=0.0) == \
        pytest.approx(-math.log(0.1) * 5.0)
    for d in range(1, 11):  # 1..10 s
        pol.observe_tool("task", float(d))
    pol.observe_tool("read", 1000.0)  # an unmarked tool's gap is not the marked queue's
    assert pol.protection_s() == 9.0  # ceil(0.9 * 10) = 9th of 10
    assert pol.admit(cand("task", session="m"), kv(free=0, waiting=9_000), now=0.0) == 9.0
    assert pol.keep(cand("task", session="m"), kv(free=0), now=8.9) is True
    assert pol.keep(cand("task", session="m"), kv(free=0), now=9.0) is False
    assert pol.admit(cand("read", session="sub"), kv(free=9_000), now=0.0) == 0.0
    # unconfigured: every round is marked
    every = KvHintRetention()
    every.observe_tool("read", 2.0)
    assert every.admit(cand("read"), kv(free=0), now=0.0) == 2.0
    # the window holds the last max_samples marked gaps
    small = KvHintRetention(KvHintConfig(quantile=1.0, max_samples=3))
    assert small.protection_s() == math.inf  # q = 1 and nothing seen: until memory is needed
    for d in (100.0, 1.0, 2.0, 3.0):
        small.observe_tool("x", d)
    assert small.protection_s() == 3.0  # 100 s left the window


@pytest.mark.parametrize("bad,match", [({"quantile": 0.0}, "quantile"),
                                       ({"quantile": 1.5}, "quantile"),
                                       ({"quantile": True}, "quantile"),
                                       ({"max_samples": 0}, "max_samples"),
                                       ({"max_samples": 2.5}, "max_samples"),
                                       ({"tools": "task"}, "list of tool names"),
                                       ({"tools": [1]}, "list of tool names"),
                                       ({"tools": []}, "mark no round")])
def test_kv_hint_refuses_bad_settings(bad, match):
    from mars.policy.engine.hint import KvHintConfig, KvHintRetention
    from mars.policy.registry import with_config

    with pytest.raises(ValueError, match=match):
        KvHintConfig(**bad)
    with pytest.raises(ValueError, match=match):  # as --mars-config gives them
        with_config(KvHintRetention(), bad)
    assert with_config(KvHintRetention(), {"tools": ["task"]}).config.tools == ("task",)
