"""Placement of agent sessions over several engines (issue #34): the policy and the router,
framework-free (no vLLM, no HTTP)."""

from __future__ import annotations

import collections
import random

import pytest

from mars.policy.control.placement import (
    PLACERS,
    Call,
    EngineLoad,
    KvOverlapPlacer,
    MarsPlacer,
    NoEngineError,
    RoundRobinPlacer,
    SessionHashPlacer,
    SessionRouter,
    VllmDpPlacer,
    make_placer,
)

RATE = 10_000.0  # tokens/s of prefill, the same on every engine here


def eng(rank: int, **kw) -> EngineLoad:
    kw.setdefault("total_blocks", 1000)
    kw.setdefault("free_blocks", kw["total_blocks"])
    kw.setdefault("prefill_tokens_per_s", RATE)
    return EngineLoad(rank=rank, **kw)


# ----------------------------------------------------------------------------- MARS


def test_mars_sends_a_new_session_where_the_queued_prefill_is_shortest():
    engines = [eng(0, queued_prefill_tokens=40_000), eng(1, queued_prefill_tokens=8_000),
               eng(2, queued_prefill_tokens=20_000)]
    assert MarsPlacer().choose(Call("s", 4_000), engines) == 1


def test_mars_counts_a_cached_prefix_as_work_saved():
    # engine 0 has 2K more queued, but caches 12K of this 16K prompt: 2K+4K < 0+16K
    engines = [eng(0, queued_prefill_tokens=2_000), eng(1)]
    call = Call("s", 16_000, cached_tokens={0: 12_000})
    p = MarsPlacer()
    assert p.cost_s(call, engines[0]) == pytest.approx(0.6)
    assert p.cost_s(call, engines[1]) == pytest.approx(1.6)
    assert p.choose(call, engines) == 0


def test_mars_prices_the_evictions_a_footprint_that_does_not_fit_would_force():
    # engine 0: nothing queued but its room is spoken for by the admitted sessions' growth;
    # the 8K prompt (500 blocks) would evict 400 blocks of contexts to be prefilled again
    full = eng(0, free_blocks=300, committed_blocks=200)
    roomy = eng(1, queued_prefill_tokens=5_000)
    p = MarsPlacer()
    call = Call("s", 8_000)
    assert p.cost_s(call, full) == pytest.approx((8_000 + 400 * 16) / RATE)
    assert p.cost_s(call, roomy) == pytest.approx((5_000 + 8_000) / RATE)
    assert p.choose(call, [full, roomy]) == 1


def test_mars_prefers_an_engine_whose_window_has_room():
    # engine 0 is cheaper by every token count but its window is full: the session would
    # wait there for a slot while engine 1 admits it now
    engines = [eng(0, sessions=4, window=4), eng(1, sessions=9, window=12,
                                                  queued_prefill_tokens=30_000)]
    assert MarsPlacer().choose(Call("s", 1_000), engines) == 1
    # with every window full, the shortest line for a slot, in windows: 41 sessions waiting
    # for 4 slots on engine 0, 2 for 4 on engine 1, however cheap engine 0 is otherwise
    engines = [eng(0, sessions=44, window=4), eng(1, sessions=6, window=4,
                                                  queued_prefill_tokens=30_000)]
    assert [e.wait_line for e in engines] == [41 / 4, 3 / 4]
    assert MarsPlacer().choose(Call("s", 1_000), engines) == 1
    # a bigger window drains a line of the same length sooner
    engines = [eng(0, sessions=8, window=4), eng(1, sessions=20, window=16)]
    assert MarsPlacer().choose(Call("s", 1_000), engines) == 1
    # equal lines: the cost decides again
    engines = [eng(0, sessions=4, window=4), eng(1, sessions=4, window=4,
                                                  queued_prefill_tokens=30_000)]
    assert MarsPlacer().choose(Call("s", 1_000), engines) == 0


def test_an_engine_without_kv_stats_is_charged_no_recompute_and_bad_loads_are_refused():
    fresh = eng(0, total_blocks=0, free_blocks=0)
    assert not fresh.has_kv_stats
    assert MarsPlacer().cost_s(Call("s", 8_000), fresh) == pytest.approx(8_000 / RATE)
    with pytest.raises(ValueError, match="block_size"):
        EngineLoad(rank=0, block_size=0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        EngineLoad(rank=0, prefill_tokens_per_s=0)


def test_mars_breaks_ties_by_sessions_then_rank_and_skips_dead_engines():
    engines = [eng(0, sessions=3), eng(1, sessions=1), eng(2, sessions=1)]
    assert MarsPlacer().choose(Call("s", 100), engines) == 1
    engines[1] = eng(1, sessions=1, alive=False)
    assert MarsPlacer().choose(Call("s", 100), engines) == 2


def test_the_prefill_rate_converts_work_into_time_per_engine():
    # a slower engine (half the prefill rate) with the same queue costs twice as much
    engines = [eng(0, queued_prefill_tokens=10_000, prefill_tokens_per_s=RATE / 2),
               eng(1, queued_prefill_tokens=15_000)]
    assert MarsPlacer().choose(Call("s", 1_000), engines) == 1


# ------------------------------------------------------------------------ baselines


def test_vllm_dp_score_is_vllms():
    p = VllmDpPlacer()
    # max(inflight, waiting + running), plus waiting x 6 x (usage - 0.5) past half the pool
    assert p.score(eng(0, waiting=2, running=3, inflight=1)) == 5.0
    assert p.score(eng(0, waiting=0, running=1, inflight=7)) == 7.0
    e = eng(0, waiting=4, running=2, total_blocks=100, free_blocks=10)  # 90 % used
    assert p.score(e) == pytest.approx(6 + 4 * 6 * 0.4)
    assert p.score(eng(0, waiting=4, running=2, total_blocks=100, free_blocks=60)) == 6.0


def test_vllm_dp_rotates_ties_and_avoids_a_kv_bound_queue():
    p = VllmDpPlacer()
    engines = [eng(2), eng(0), eng(1)]  # scanned in rank order, whatever order they come in
    assert [p.choose(Call(f"s{i}", 10), engines) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    p.snapshot()
    # equal waiting + running, but engine 0's queue sits on a nearly full pool
    engines = [eng(0, waiting=3, running=1, total_blocks=100, free_blocks=5),
               eng(1, waiting=3, running=1, total_blocks=100, free_blocks=70)]
    assert {p.choose(Call("x", 10), engines) for _ in range(4)} == {1}


def test_vllm_dp_counts_its_own_sends_until_the_next_snapshot():
    # engine 0 looks emptier in the snapshot (1 against 3 running), its pool 90 % used: the
    # calls sent there meanwhile wait in vLLM's local count and weigh with the KV penalty,
    # so a burst spills to engine 1 before the next snapshot shows it
    p = VllmDpPlacer()
    engines = [eng(0, running=1, total_blocks=100, free_blocks=10),
               eng(1, running=3, total_blocks=100, free_blocks=60)]
    burst = [p.choose(Call(f"s{i}", 10), engines) for i in range(4)]
    assert burst[0] == 0 and 1 in burst
    # the snapshot now holds those calls: the local additions are dropped
    p.snapshot()
    assert p.score(engines[0]) == 1.0


def test_round_robin_cycles_over_the_alive_engines():
    p = RoundRobinPlacer()
    engines = [eng(2), eng(0), eng(1, alive=False)]
    assert [p.choose(Call("s", 1), engines) for _ in range(4)] == [0, 2, 0, 2]


def test_session_hash_is_stable_and_moves_only_the_dead_engines_sessions():
    p = SessionHashPlacer()
    engines = [eng(r) for r in range(4)]
    sessions = [f"sess-{i}" for i in range(400)]
    before = {s: p.choose(Call(s, 1), engines) for s in sessions}
    assert before == {s: p.choose(Call(s, 1), engines) for s in sessions}  # stable
    counts = collections.Counter(before.values())
    assert len(counts) == 4 and min(counts.values()) > 60  # spread over every engine
    engines[2] = eng(2, alive=False)
    after = {s: p.choose(Call(s, 1), engines) for s in sessions}
    changed = {s for s in sessions if after[s] != before[s]}
    assert changed == {s for s in sessions if before[s] == 2}


def test_kv_overlap_is_dynamos_cost():
    p = KvOverlapPlacer()
    call = Call("s", 1_600, cached_tokens={0: 1_000})  # 100 blocks, 62 cached on engine 0
    e0 = eng(0, total_blocks=1000, free_blocks=700)   # 300 active
    e1 = eng(1, total_blocks=1000, free_blocks=900)   # 100 active
    assert p.cost(call, e0) == (100 - 62) + 300 + 100
    assert p.cost(call, e1) == 100 + 100 + 100
    assert p.choose(call, [e0, e1]) == 1
    assert KvOverlapPlacer(overlap_weight=4.0).choose(call, [e0, e1]) == 0
    # prefill in flight counts with the prompt's new blocks; pinned blocks decode nothing
    busy = eng(1, total_blocks=1000, free_blocks=900, queued_prefill_tokens=3_200)
    assert p.cost(call, busy) == 200 + 100 + 100 + 100
    assert p.choose(call, [e0, busy]) == 0
    paused = eng(0, total_blocks=1000, free_blocks=700, pinned_blocks=250)
    assert p.cost(call, paused) == (100 - 62) + 50 + 100
    with pytest.raises(ValueError):
        KvOverlapPlacer(overlap_weight=-1)


def test_kv_overlap_made_sticky_is_dynamos_session_affinity():
    r = SessionRouter(KvOverlapPlacer(sticky=True))
    engines = [eng(0, total_blocks=1000, free_blocks=100), eng(1)]
    assert r.route(Call("a", 160), engines).rank == 1
    engines = [eng(0), eng(1, total_blocks=1000, free_blocks=100)]
    assert r.route(Call("a", 160), engines).rank == 1 and r.switches == 0


def test_every_placer_is_registered_and_unknown_names_are_refused():
    assert set(PLACERS) == {"mars", "vllm_dp", "round_robin", "session_hash", "kv_overlap"}
    for name in PLACERS:
        assert make_placer(name).name == name
    with pytest.raises(ValueError, match="unknown placement 'nope'.*kv_overlap"):
        make_placer("nope")


@pytest.mark.parametrize("name", sorted(PLACERS))
def test_no_placer_chooses_a_dead_engine_and_none_alive_is_an_error(name):
    rng = random.Random(name)
    p = make_placer(name)
    for i in range(300):
        engines = [eng(r, alive=rng.random() < 0.6, waiting=rng.randrange(5),
                       running=rng.randrange(5), free_blocks=rng.randrange(1001),
                       sessions=rng.randrange(6), window=rng.randrange(6),
                       queued_prefill_tokens=rng.randrange(50_000)) for r in range(4)]
        call = Call(f"s{i % 17}", rng.randrange(1, 30_000),
                    cached_tokens={r: rng.randrange(20_000) for r in range(4)})
        if not any(e.alive for e in engines):
            with pytest.raises(NoEngineError):
                p.choose(call, engines)
            continue
        assert engines[p.choose(call, engines)].alive


# --------------------------------------------------------------------------- router


def test_a_sessions_rounds_stay_on_its_engine_under_a_sticky_placer():
    r = SessionRouter(MarsPlacer())
    engines = [eng(0), eng(1, queued_prefill_tokens=50_000)]
    assert r.route(Call("a", 1_000), engines).rank == 0
    # engine 0 is now the busier one: a new session goes to 1, "a" stays on 0
    engines = [eng(0, queued_prefill_tokens=90_000), eng(1, queued_prefill_tokens=50_000)]
    assert r.route(Call("b", 1_000), engines).rank == 1
    for _ in range(5):
        assert r.route(Call("a", 30_000), engines).rank == 0
    assert (r.moves, r.switches) == (0, 0)
    assert r.sessions_on(0) == 1 and r.sessions_on(1) == 1


def test_a_dead_engines_sessions_move_once_and_are_counted():
    r = SessionRouter(SessionHashPlacer())
    engines = [eng(k) for k in range(3)]
    where = {f"s{i}": r.route(Call(f"s{i}", 10), engines).rank for i in range(60)}
    victims = [s for s, k in where.items() if k == 1]
    assert victims
    engines[1] = eng(1, alive=False)
    for s in where:
        d = r.route(Call(s, 10), engines)
        assert d.rank != 1 and d.moved == (s in victims)
        assert r.route(Call(s, 10), engines).moved is False  # once
    assert r.moves == len(victims) and r.switches == 0


def test_per_call_placers_are_asked_every_round_and_their_switches_counted():
    r = SessionRouter(RoundRobinPlacer())
    engines = [eng(0), eng(1)]
    ranks = [r.route(Call("a", 10), engines).rank for i in range(4)]
    assert ranks == [0, 1, 0, 1]
    assert r.switches == 3 and r.moves == 0


def test_an_ended_session_is_forgotten_and_no_engine_is_an_error():
    r = SessionRouter(MarsPlacer())
    engines = [eng(0), eng(1)]
    r.route(Call("a", 10), engines)
    r.end("a")
    assert r.engine_of("a") is None
    r.end("never-seen")  # harmless
    with pytest.raises(NoEngineError):
        r.route(Call("b", 10), [eng(0, alive=False)])


def test_the_tracker_folds_one_engines_events_into_its_load():
    from mars.policy.control.placement import EngineTracker

    t = EngineTracker(rank=1)
    t.observe({"kind": "scheduler_start", "block_size": 32, "total_blocks": 100})
    t.observe({"kind": "kv_snapshot", "total_blocks": 100, "free_blocks": 60,
               "used_blocks": 40, "pinned_blocks": 10, "running": 2, "waiting": 3})
    t.observe({"kind": "gpu_submit", "request_id": "r1", "session_id": "s", "prompt_tokens": 500})
    t.observe({"kind": "gpu_submit", "request_id": "r2", "session_id": "u", "prompt_tokens": 300})
    assert t.queued_prefill_tokens == 800
    t.observe({"kind": "gpu_1st_token", "request_id": "r1", "cached_tokens": 0})
    assert t.queued_prefill_tokens == 300  # r1's prefill is done, r2's is not
    t.observe({"kind": "gpu_end", "request_id": "r2", "freed_blocks": 0})  # aborted early
    assert t.queued_prefill_tokens == 0
    t.observe({"kind": "gpu_end", "request_id": "r1", "freed_blocks": 16, "output_tokens": 20})
    assert t.cached_tokens("s") == 520 and t.cached_tokens("u") == 300
    load = t.load(sessions=2, window=4, committed_blocks=-5, inflight=1)
    assert (load.rank, load.block_size, load.total_blocks, load.free_blocks) == (1, 32, 100, 60)
    assert (load.pinned_blocks, load.running, load.waiting) == (10, 2, 3)
    assert load.committed_blocks == 0 and load.sessions == 2 and load.window == 4
    t.forget("s")
    assert t.cached_tokens("s") == 0
    # a resubmitted request (preempted and back) is counted once
    t.observe({"kind": "gpu_submit", "request_id": "r3", "prompt_tokens": 100})
    t.observe({"kind": "gpu_submit", "request_id": "r3", "prompt_tokens": 100})
    assert t.queued_prefill_tokens == 100


def test_a_session_placed_by_the_tracker_goes_where_its_context_is_cached():
    from mars.policy.control.placement import Call, EngineTracker, MarsPlacer

    a, b = EngineTracker(0), EngineTracker(1)
    for t in (a, b):
        t.observe({"kind": "scheduler_start", "block_size": 16, "total_blocks": 1000})
        t.observe({"kind": "kv_snapshot", "total_blocks": 1000, "free_blocks": 900,
                   "used_blocks": 100})
    b.observe({"kind": "gpu_submit", "request_id": "x", "session_id": "s", "prompt_tokens": 4000})
    b.observe({"kind": "gpu_1st_token", "request_id": "x"})
    b.observe({"kind": "gpu_end", "request_id": "x", "freed_blocks": 0, "output_tokens": 100})
    call = Call("s", 4200, {0: a.cached_tokens("s"), 1: b.cached_tokens("s")})
    assert MarsPlacer().choose(call, [a.load(), b.load()]) == 1


def test_mars_breaks_a_cost_tie_by_the_room_left_then_by_sessions():
    """A small first prompt fits either pool at no cost; the session goes where its later,
    larger rounds will not force evictions, and where nothing is known of the pools, to the
    engine with fewer sessions."""
    call = Call("s", 64)
    full = eng(0, free_blocks=20, sessions=1)
    roomy = eng(1, free_blocks=900, sessions=3)
    assert MarsPlacer().choose(call, [full, roomy]) == 1
    # room counts what the admitted sessions are projected to grow into
    assert MarsPlacer().choose(call, [eng(0, free_blocks=900, committed_blocks=850),
                                      eng(1, free_blocks=300)]) == 1
    unknown = [eng(0, total_blocks=0, sessions=2), eng(1, total_blocks=0, sessions=1)]
    assert MarsPlacer().choose(call, unknown) == 1
    # an engine that has not reported (it has not stepped yet) is taken to be as roomy as
    # the roomiest that has: fewer sessions decide
    assert MarsPlacer().choose(call, [eng(0, free_blocks=990, sessions=1),
                                      eng(1, total_blocks=0)]) == 1
    assert MarsPlacer().choose(call, [eng(0, free_blocks=990), eng(1, total_blocks=0,
                                                                   sessions=1)]) == 0


# ----------------------------------------------------------------------------- late binding


def test_a_queued_session_moves_to_an_engine_that_would_admit_it_oldest_first():
    """SessionRouter.rebind: the longest-waiting session goes first; an engine that takes
    one takes no other in the same call; only engines that would admit it are asked (and
    as little as monotony allows); a session listed twice stays; the router changes only
    when the caller records the move."""
    from mars.policy.control.placement import Rebind, Waiting

    r = SessionRouter(MarsPlacer())
    for sid, rank in (("old", 0), ("new", 0), ("third", 1), ("twice", 1)):
        r._where[sid] = rank
    waiting = [Waiting("new", 0, 5.0, 1000, 63), Waiting("old", 0, 1.0, 1000, 63),
               Waiting("third", 1, 6.0, 1000, 63), Waiting("twice", 1, 0.5, 10, 1),
               Waiting("twice", 0, 0.5, 10, 1)]
    # engines 0 and 1: windows full with queues; engine 2 would admit; engine 3 is dead
    engines = [eng(0, sessions=6, window=4), eng(1, sessions=5, window=4), eng(2, window=4),
               eng(3, window=4, alive=False)]
    asked = []

    def admits(rank, blocks):
        asked.append((rank, blocks))
        return rank in (2, 3)

    moves = r.rebind(waiting, engines, admits)
    assert moves == [Rebind("old", 0, 2)]  # engine 2 is taken after the first; 3 is dead
    assert (2, 63) in asked and all(rk != 3 for rk, _ in asked)
    assert r.engine_of("old") == 0 and r.rebinds == 0  # (until the caller moved it)
    r.rebound("old", 2)
    assert r.engine_of("old") == 2 and r.rebinds == 1


def test_a_tie_never_moves_a_queued_session():
    """Two equal engines: a session queued at one stays (its own engine is counted without
    it), so a session cannot be traded back and forth; a strictly better one takes it."""
    from mars.policy.control.placement import Rebind, Waiting

    r = SessionRouter(MarsPlacer())
    r._where["s"] = 1
    w = [Waiting("s", 1, 1.0, 1000, 63)]
    # engine 1 counts the waiting session itself: without it, the two are equal
    equal = [eng(0, window=4, sessions=0), eng(1, window=4, sessions=1)]
    assert r.rebind(w, equal, lambda rank, b: True) == []
    # its own engine's window is full (others wait for a slot there): engine 0 is better
    full = [eng(0, window=4, sessions=0), eng(1, window=4, sessions=6)]
    assert r.rebind(w, full, lambda rank, b: True) == [Rebind("s", 1, 0)]
    # its own engine preferred (more room left): it stays
    roomy = [eng(0, window=4, free_blocks=100), eng(1, window=4, sessions=1)]
    assert r.rebind(w, roomy, lambda rank, b: True) == []


@pytest.mark.parametrize("name", sorted(set(PLACERS) - {"mars"}))
def test_only_mars_placement_rebinds_queued_sessions(name):
    from mars.policy.control.placement import Waiting

    r = SessionRouter(make_placer(name))
    assert r.rebind([Waiting("s", 0, 1.0, 10, 1)], [eng(0), eng(1)],
                    lambda rank, b: True) == []
