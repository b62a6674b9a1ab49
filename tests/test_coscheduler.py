"""The Coordinator and the Co-Scheduler, each on the offline engine (vLLM's real scheduler and
KV manager, synthetic outputs, virtual clock): the rules that issue-12's review found biased."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.usefixtures("scheduling")

from mars.engine.harness.offline import BLOCK_SIZE, OfflineEngine  # noqa: E402

BS = BLOCK_SIZE


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 800 for i in range(n)]


def test_cache_hits_after_a_preemption_are_not_charged_as_service():
    """A call preempted and re-admitted finds part of its context in the prefix cache; only
    what is computed again is service (its windowed service equals the tokens computed)."""
    eng = OfflineEngine("mars", num_blocks=40, max_num_seqs=8, max_num_batched_tokens=256,
                        mars={"tick_s": 0.0, "admit_headroom_tokens": 0})
    try:
        # a victim and enough decode growth to preempt it
        eng.add("v", _prompt(1, 300), 200, job_id="v", last_round=True)
        for j in range(4):
            eng.add(f"d{j}", _prompt(10 + j, 96), 200, job_id=f"d{j}", last_round=True)
        mlfq = eng.sched.mars_coord.policy
        computed = {}
        preempted = False
        while eng.live:
            before = {rid: r.num_computed_tokens for rid, r in eng.live.items()}
            eng.step()
            preempted = preempted or eng.sched.mars_counters["preempted"] > 0
            for rid, n in before.items():
                r = eng.live.get(rid)
                if r is not None and r.num_computed_tokens > n:
                    computed[rid] = computed.get(rid, 0) + r.num_computed_tokens - n
            if "v" in eng.live and preempted:
                svc = mlfq.windowed_service("v", eng.clock())
                assert svc <= computed.get("v", 0), (svc, computed.get("v"))
        assert preempted, "the scenario did not preempt"
    finally:
        eng.close()


def test_a_continuation_ranks_by_its_uncached_work():
    """A long session's next round (mostly cached) goes ahead of a fresh prompt of the same
    length: priority comes from the work a call still needs, known from the cache lookup."""
    eng = OfflineEngine("mars", num_blocks=512, max_num_seqs=8, max_num_batched_tokens=512)
    try:
        eng.add("s-r0", _prompt(1, 6000), 8, job_id="s", round=0, next_tool="t")
        eng.run_until_idle()
        cont = eng.add("s-r1", eng.done["s-r0"] + _prompt(2, 50), 8, job_id="s", round=1,
                       last_round=True)
        fresh = eng.add("f", _prompt(3, 6100), 8, job_id="f", last_round=True)
        calls = eng.sched.mars_calls
        assert calls["s-r1"].cached_tokens >= 6000 - BS
        assert calls["s-r1"].key < calls["f"].key
        eng.step()
        assert cont.num_computed_tokens >= 6000  # admitted first, from the cache
        assert fresh.num_computed_tokens < fresh.num_prompt_tokens
        eng.run_until_idle()
    finally:
        eng.close()


def test_a_pin_is_priced_by_the_blocks_it_alone_holds():
    """Two sessions share a long system prompt: the second pin only adds its own tail, and the
    pinned-block count is of distinct blocks."""
    eng = OfflineEngine("mars", num_blocks=256, max_num_seqs=8, max_num_batched_tokens=2048,
                        mars={"events_file": None})
    try:
        shared = _prompt(7, 1600)  # 50 blocks
        eng.add("a-r0", shared + _prompt(8, 320), 4, job_id="a", round=0, next_tool="t")
        eng.run_until_idle()
        eng.add("b-r0", shared + _prompt(9, 320), 4, job_id="b", round=0, next_tool="t")
        eng.run_until_idle()
        pins = eng.sched.mars_cosched.pins
        pa, pb = pins.get("a"), pins.get("b")
        assert pa is not None and pb is not None
        assert pa.cand.blocks >= 59          # a held everything alone when it was pinned
        assert pb.cand.blocks <= 12          # b shares the 50 prefix blocks with a's pin
        assert pins.pinned_blocks == len({b.block_id for b in pa.blocks + pb.blocks})
        assert pins.pinned_blocks < pa.num_blocks + pb.num_blocks
        acc = eng.kv_account()
        assert acc.balanced and acc.pinned == pins.pinned_blocks
    finally:
        eng.close()


def test_waiting_call_reclaims_other_pins_but_never_its_own():
    """Pins fill the pool; session s1's next round needs room beyond its own cached context:
    the other session's pin goes, s1's own pin (its cache hit) stays until it is admitted."""
    eng = OfflineEngine("continuum", num_blocks=65, max_num_seqs=8,
                        max_num_batched_tokens=256)
    try:
        for i, s in enumerate(("s1", "s2")):
            eng.add(f"{s}-r0", _prompt(20 + i, 890), 4, job_id=s, round=0, next_tool="t")
        eng.run_until_idle()
        assert set(eng.sched.mars_cosched.pins.sessions()) == {"s1", "s2"}
        r1 = eng.add("s1-r1", eng.done["s1-r0"] + _prompt(30, 300), 4, job_id="s1", round=1,
                     last_round=True)
        eng.step()
        assert r1.num_computed_tokens > 0, eng.describe()
        events = eng.sched.mars_cosched
        assert "s2" not in events.pins  # reclaimed for s1's next round
        # s1's pin was its cache hit: admitted with its context found in the cache
        assert eng.sched.mars_calls["s1-r1"].cached_tokens >= 890 - BS
        eng.run_until_idle()
        assert eng.kv_account().pinned == 0
    finally:
        eng.close()
