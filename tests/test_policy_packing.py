"""PackQueue (mars.policy.control.packing): mode selection, per-mode selection, anti-starvation."""

from __future__ import annotations

import pytest

from mars.protocol.events import make_event
from mars.policy.control.packing import (Footprint, PackConfig, PackMode, PackQueue, QueuedSession,
                                 choose_mode, estimate_blocks)
from mars.policy.control.pressure import DualPressureState, PressureConfig


def q(sid: str, blocks: int, at: float = 0.0, share: float | None = None, seq: int = 0):
    return QueuedSession(session_id=sid, enqueued_at=at, prompt_tokens=blocks * 16,
                         est_blocks=blocks, tool_share=share, seq=seq)


def state(util: float | None = None, total: int = 1000, active_tools: int = 0,
          cores: float = 8) -> DualPressureState:
    st = DualPressureState(PressureConfig(tool_cores=cores))
    if util is not None:
        free = round(total * (1 - util))
        st.observe(make_event("kv_snapshot", ts=0.0, total_blocks=total, free_blocks=free,
                              used_blocks=total - free))
    for i in range(active_tools):
        st.observe(make_event("tool_start", session_id=f"t{i}", ts=0.0, tool="bash"))
    return st


def test_estimate_blocks():
    assert [estimate_blocks(n, 16) for n in (0, 1, 16, 17, 32, 1000)] == [0, 1, 1, 2, 2, 63]
    assert estimate_blocks(-5, 16) == 0
    with pytest.raises(ValueError):
        estimate_blocks(10, 0)


def test_choose_mode():
    cfg = PackConfig(kv_mode_utilisation=0.8, cpu_mode_load=0.85, long_dominated_frac=0.25)
    small = [q("a", 10), q("b", 20), q("c", 30)]
    assert choose_mode(state().signals(0), small, cfg)[0] is PackMode.NORMAL
    assert choose_mode(state(0.5).signals(0), small, cfg)[0] is PackMode.NORMAL
    assert choose_mode(state(0.5, active_tools=7).signals(0), small, cfg)[0] is PackMode.CPU
    assert choose_mode(state(0.8).signals(0), small, cfg)[0] is PackMode.KV
    # KV wins over CPU
    assert choose_mode(state(0.85, active_tools=8).signals(0), small, cfg)[0] is PackMode.KV
    # long-dominated: 500 free, median 200 > 0.25 * 500
    longq = [q("a", 10), q("b", 200), q("c", 300)]
    mode, why = choose_mode(state(0.5).signals(0), longq, cfg)
    assert mode is PackMode.KV and "long-dominated" in why
    # median 100 == 0.2 * 500 is not long-dominated
    assert choose_mode(state(0.5).signals(0), [q("a", 100)], cfg)[0] is PackMode.NORMAL
    # explicit free blocks (after pending reservations) override the snapshot
    assert choose_mode(state(0.5).signals(0), [q("a", 100)], cfg, free_blocks=300)[0] \
        is PackMode.KV
    # unknown KV never selects KV mode, however large the sessions
    assert choose_mode(state().signals(0), [q("a", 10_000)], cfg)[0] is PackMode.NORMAL


def test_normal_mode_smaller_first():
    queue = [q("a", 50, 0, seq=0), q("b", 10, 1, seq=1), q("c", 30, 2, seq=2),
             q("d", 20, 3, seq=3)]
    res = PackQueue().pack(queue, state(0.3), budget_slots=2, free_blocks=700, now=5.0)
    assert res.mode is PackMode.NORMAL
    assert res.session_ids == ["b", "d"]
    assert res.planned_blocks == 30


def test_normal_mode_ties_break_by_arrival():
    queue = [q("late", 10, 3, seq=1), q("early", 10, 1, seq=0)]
    res = PackQueue().pack(queue, state(), budget_slots=1, free_blocks=None, now=5.0)
    assert res.session_ids == ["early"]


def test_cpu_mode_favours_gpu_resident_low_tool_sessions():
    queue = [q("tooly", 100, share=0.8), q("quiet", 20, share=0.1),
             q("big_unknown", 500), q("small_unknown", 50)]
    st = state(0.3, active_tools=8)
    res = PackQueue().pack(queue, st, budget_slots=3, free_blocks=700, now=1.0)
    assert res.mode is PackMode.CPU
    # known-low tool share first, then unknown (default 0.5) long before short, tool-heavy last
    assert res.session_ids == ["quiet", "big_unknown", "small_unknown"]


def test_kv_mode_skips_oversized_head_and_packs_smaller():
    cfg = PackConfig(kv_reserve_frac=0.0)
    queue = [q("big", 500, 0, seq=0), q("s1", 100, 1, seq=1), q("s2", 150, 2, seq=2),
             q("s3", 80, 3, seq=3)]
    st = state(0.85)  # 150 free in the snapshot, but the caller passes its own budget
    res = PackQueue(cfg).pack(queue, st, budget_slots=10, free_blocks=300, now=10.0, in_use=3)
    assert res.mode is PackMode.KV
    assert res.session_ids == ["s3", "s1"]  # 80 + 100 = 180; s2 (150) would exceed 300
    assert res.planned_blocks == 180
    assert res.reserved_for is None


def test_kv_mode_keeps_reserve_for_growth():
    cfg = PackConfig(kv_reserve_frac=0.1)  # 100 of 1000 blocks held back
    queue = [q("a", 150), q("b", 100)]
    res = PackQueue(cfg).pack(queue, state(0.8), budget_slots=10, free_blocks=200, now=0.0,
                              in_use=2)
    assert res.session_ids == ["b"]  # budget 100


def test_every_mode_packs_under_the_free_block_budget():
    """Normal and CPU modes order differently from KV mode but never admit more than the
    free blocks hold: three aged sessions of 400 blocks each do not enter 900 free blocks
    together, whatever the mode; the first that does not fit reserves, in strict order."""
    cfg = PackConfig(kv_reserve_frac=0.0, max_queue_wait_s=60)
    queue = [q("old1", 400, at=0.0, seq=0), q("old2", 400, at=1.0, seq=1),
             q("old3", 400, at=2.0, seq=2), q("small", 10, at=100.0, seq=3)]
    pq = PackQueue(cfg)
    for mode in (PackMode.NORMAL, PackMode.CPU, PackMode.KV):
        res = pq.pack(queue, state(0.1), budget_slots=4, free_blocks=900, now=101.0,
                      in_use=2, mode=mode)
        assert res.session_ids == ["old1", "old2"], mode
        assert res.reserved_for == "old3" and res.planned_blocks == 800, mode
    # not aged: the mode's order, skipping what does not fit (CPU mode: large first)
    fresh = [q("a", 500, share=0.1, seq=0), q("b", 450, share=0.1, seq=1),
             q("c", 300, share=0.9, seq=2)]
    res = pq.pack(fresh, state(0.1), budget_slots=3, free_blocks=900, now=1.0, in_use=2,
                  mode=PackMode.NORMAL)
    assert res.session_ids == ["c", "b"]  # 300 + 450; 500 no longer fits
    res = pq.pack(fresh, state(0.1), budget_slots=3, free_blocks=900, now=1.0, in_use=2,
                  mode=PackMode.CPU)
    assert res.session_ids == ["a", "c"]  # 500 first (low share, large); 450 skipped
    # unknown free blocks: no budget, the slots alone bound it
    res = pq.pack(fresh, state(), budget_slots=3, free_blocks=None, now=1.0, in_use=2,
                  mode=PackMode.NORMAL)
    assert res.session_ids == ["c", "b", "a"]


def test_kv_mode_respects_slot_budget():
    queue = [q(f"s{i}", 10, seq=i) for i in range(10)]
    res = PackQueue().pack(queue, state(0.9), budget_slots=3, free_blocks=100, now=0.0,
                           in_use=1)
    assert res.mode is PackMode.KV and len(res.sessions) == 3


def test_aged_session_goes_first_in_every_mode():
    cfg = PackConfig(max_queue_wait_s=60, kv_reserve_frac=0.0)
    queue = [q("old_big", 400, at=0.0, seq=0), q("s1", 10, at=50.0, seq=1),
             q("s2", 20, at=55.0, seq=2)]
    pq = PackQueue(cfg)
    for mode in (PackMode.NORMAL, PackMode.CPU):
        res = pq.pack(queue, state(0.3), budget_slots=1, free_blocks=700, now=61.0, mode=mode)
        assert res.session_ids == ["old_big"], mode
    res = pq.pack(queue, state(0.85), budget_slots=5, free_blocks=450, now=61.0, in_use=2,
                  mode=PackMode.KV)
    assert res.session_ids == ["old_big", "s1", "s2"]
    # not yet aged at 59 s: smaller ones first
    res = pq.pack(queue, state(0.3), budget_slots=1, free_blocks=700, now=59.0)
    assert res.session_ids == ["s1"]


def test_kv_mode_aged_session_that_does_not_fit_reserves():
    cfg = PackConfig(max_queue_wait_s=60, kv_reserve_frac=0.0)
    queue = [q("old_big", 400, at=0.0, seq=0), q("s1", 10, at=50.0, seq=1)]
    pq = PackQueue(cfg)
    res = pq.pack(queue, state(0.85), budget_slots=5, free_blocks=300, now=70.0, in_use=3,
                  mode=PackMode.KV)
    assert res.sessions == [] and res.reserved_for == "old_big"
    assert "reserving" in res.reason
    # once enough blocks are free it goes first and the rest backfill behind it
    res = pq.pack(queue, state(0.5), budget_slots=5, free_blocks=420, now=80.0, in_use=1,
                  mode=PackMode.KV)
    assert res.session_ids == ["old_big", "s1"] and res.reserved_for is None


def test_kv_mode_progress_rule_when_nothing_runs():
    cfg = PackConfig(kv_reserve_frac=0.0)
    queue = [q("huge", 5000, seq=0), q("big", 2000, seq=1)]
    pq = PackQueue(cfg)
    res = pq.pack(queue, state(0.1), budget_slots=2, free_blocks=900, now=0.0, in_use=1)
    assert res.sessions == []  # something runs: wait for it to free memory
    res = pq.pack(queue, state(0.1), budget_slots=2, free_blocks=900, now=0.0, in_use=0)
    assert res.session_ids == ["big"]  # nothing runs: admit the smallest anyway
    # an aged one takes precedence under the progress rule too
    cfg2 = PackConfig(kv_reserve_frac=0.0, max_queue_wait_s=10)
    res = PackQueue(cfg2).pack(queue, state(0.1), budget_slots=2, free_blocks=900, now=20.0,
                               in_use=0)
    assert res.session_ids == ["huge"]


def test_no_slots_or_empty_queue():
    pq = PackQueue()
    assert pq.pack([q("a", 1)], state(), budget_slots=0, free_blocks=None, now=0).sessions == []
    assert pq.pack([], state(), budget_slots=5, free_blocks=None, now=0).sessions == []


class Doubling(Footprint):
    """A projection in which every session needs twice its prompt, less a discount once
    two are in (a stand-in for mars.policy.control.growth.Projection: growth that overlaps less)."""

    def __init__(self) -> None:
        self.added: list[int] = []

    def rise(self, blocks: int) -> int:
        return 2 * blocks - (blocks // 2 if len(self.added) >= 2 else 0)

    def add(self, blocks: int) -> int:
        r = self.rise(blocks)
        self.added.append(blocks)
        return r


def test_a_footprint_charges_each_pick_what_it_raises_the_projection_by():
    """With a footprint the packer charges a session what it raises the admitted sessions'
    projected need by (at least its estimate), adds each pick to it, and plans their sum;
    the progress rule's admission is added too."""
    pq = PackQueue(PackConfig(kv_reserve_frac=0.0))
    fp = Doubling()
    res = pq.pack([q("a", 100, seq=0), q("b", 150, seq=1), q("c", 200, seq=2),
                   q("d", 300, seq=3)], state(util=0.0), 4, 800, 0.0, footprint=fp)
    # a: 200, b: 300 (500 of 800), c: 400 - 100 = 300 (800), d: 450 > 0 left
    assert res.session_ids == ["a", "b", "c"] and res.planned_blocks == 800
    assert fp.added == [100, 150, 200]
    # without one, the estimates: d fits too (750 of 800)
    assert pq.pack([q("a", 100), q("b", 150), q("c", 200), q("d", 300)], state(util=0.0),
                   4, 800, 0.0).session_ids == ["a", "b", "c", "d"]

    class Shrinking(Doubling):
        def rise(self, blocks: int) -> int:
            return 0  # growth that comes only after the others end: still its prompt now

    res = pq.pack([q("a", 100), q("b", 150)], state(util=0.0), 4, 200, 0.0,
                  footprint=Shrinking())
    assert res.session_ids == ["a"] and res.planned_blocks == 100
    # nothing admitted anywhere: the progress rule's pick is added to the projection
    fp = Doubling()
    res = pq.pack([q("big", 900)], state(util=0.0), 4, 500, 0.0, in_use=0, footprint=fp)
    assert res.session_ids == ["big"] and fp.added == [900]
