"""The packing room with a host tier (mars.policy.control.residency): admitted contexts charged
at their measured engine share, the host pool bounding them whole."""

from __future__ import annotations

import math

import pytest

from mars.policy.control.admission import AdmissionConfig, BalanceAndAdmit
from mars.policy.control.growth import ContextGrowth
from mars.policy.control.packing import PackConfig
from mars.policy.control.residency import EngineShare, ResidentShare
from mars.protocol.events import make_event, parse_event


def test_engine_share_is_a_ratio_of_sums_over_enough_sessions():
    es = EngineShare(max_sessions=3, min_sessions=2)
    assert es.share() == 1.0  # nothing seen: the room as without a host tier
    es.observe(10.0, 40.0)
    assert es.share() == 1.0  # one session is not enough
    es.observe(30.0, 60.0)
    assert es.share() == pytest.approx(40 / 100)
    # live sessions count with what they have shown so far
    assert es.share([(0.0, 100.0)]) == pytest.approx(40 / 200)
    # the window keeps the last three ended sessions
    es.observe(5.0, 10.0)
    es.observe(50.0, 50.0)
    assert len(es) == 3 and es.share() == pytest.approx((30 + 5 + 50) / (60 + 10 + 50))
    # bad samples are ignored; engine time past the life is clipped
    for bad in ((-1.0, 5.0), (1.0, 0.0), (math.nan, 3.0), (1.0, math.inf)):
        es.observe(*bad)
    assert len(es) == 3
    es2 = EngineShare(min_sessions=1)
    es2.observe(9.0, 3.0)
    assert es2.share() == 1.0
    # no engine time at all is no evidence, not a share of zero
    es3 = EngineShare(min_sessions=1)
    es3.observe(0.0, 10.0)
    assert es3.share() == 1.0
    with pytest.raises(ValueError):
        EngineShare(min_sessions=0)


def test_resident_share_charges_the_share_rounded_up():
    inner = ContextGrowth().project([(100, 1), (51, 1)])  # no forecast yet: the plain sum
    fp = ResidentShare(inner, 0.5)
    assert fp.whole_peak == 151 and fp.peak == 76
    assert fp.rise(10) == 5 and fp.peak == 76  # a dry run adds nothing
    assert fp.add(11) == 5 and fp.whole_peak == 162 and fp.peak == 81
    with pytest.raises(ValueError):
        ResidentShare(inner, 0.0)
    with pytest.raises(ValueError):
        ResidentShare(inner, 1.5)
    # what the host cannot hold stays in GPU memory: charged whole, never more
    held = ResidentShare(ContextGrowth().project([(100, 1)]), 0.25, host_blocks=300)
    assert held.peak == 25 and held.rise(200) == 50
    assert held.rise(400) == 200 - 25  # 500 whole: 200 beyond the host
    tiny = ResidentShare(ContextGrowth().project([(100, 1)]), 0.25, host_blocks=50)
    assert tiny.peak == 50 and tiny.rise(100) == 100  # all of it beyond the host: whole


def _start(ba: BalanceAndAdmit, ts: float, total: int, host: int | None) -> None:
    ev = make_event("scheduler_start", ts=ts, scheduler_cls="x", policy="mars",
                    total_blocks=total, block_size=16, pid=1,
                    **({"host_blocks": host} if host is not None else {}))
    parse_event(ev)  # schema-valid
    ba.observe(ev)
    ba.observe(make_event("kv_snapshot", ts=ts, total_blocks=total, free_blocks=total,
                          used_blocks=0, running=0, waiting=0))


def _session(ba: BalanceAndAdmit, sid: str, t: float, blocks: int, busy: float,
             life: float, end: bool = True) -> None:
    """Admit ``sid`` at ``t``, one call of ``blocks`` in the engine for ``busy`` s, ended
    (released) at ``t + life``."""
    ba.enqueue(sid, t, est_blocks=blocks)
    assert ba.step(t).admitted == [sid]
    ba.observe(make_event("gpu_submit", ts=t, session_id=sid, request_id=f"{sid}.0",
                          round=0, prompt_tokens=blocks * 16, projected_blocks=blocks))
    ba.observe(make_event("gpu_end", ts=t + busy, session_id=sid, request_id=f"{sid}.0",
                          prompt_tokens=blocks * 16, output_tokens=1, reason="stop",
                          duration_s=busy))
    if end:
        ba.observe(make_event("session_end", ts=t + life, session_id=sid, reason="done"))


def _cfg(**kw) -> AdmissionConfig:
    return AdmissionConfig(packing=PackConfig(kv_reserve_frac=0.0), growth_forecast=False, **kw)


def test_a_host_tier_charges_admitted_contexts_their_engine_share():
    """Sessions spend a quarter of their time with a call in the engine: with a host tier
    the paused ones' contexts come back by a read, so four times as much context fits the
    pool's room; without one (or with the ablation) every context counts whole."""
    def run(host: int | None, **kw) -> BalanceAndAdmit:
        ba = BalanceAndAdmit(_cfg(**kw))
        _start(ba, 0.0, total=1000, host=host)
        for i in range(8):
            _session(ba, f"old{i}", float(i), 100, busy=5.0, life=20.0)
        return ba

    ba = run(host=10_000)
    assert ba.engine_share_now(30.0) == pytest.approx(0.25)
    # two admitted sessions paused in tools with 400 blocks each: 200 charged, not 800
    for sid in ("a", "b"):
        _session(ba, sid, 30.0, 400, busy=5.0, life=0.0, end=False)
    now = 40.0
    share = ba.engine_share_now(now)  # a and b: 5 s of 10 so far count too, by their blocks
    assert share == pytest.approx((8 * 100 * 5 + 2 * 400 * 5) / (8 * 100 * 20 + 2 * 400 * 10))
    sig = ba.state.signals(now)
    assert sig.host_blocks == 10_000
    assert ba.room(sig, now) == 1000 - math.ceil(share * 800)
    ba.enqueue("c", now, est_blocks=500)
    assert ba.step(now).admitted == ["c"]
    for off in (run(host=None), run(host=10_000, host_tier=False)):
        for sid in ("a", "b"):
            _session(off, sid, 30.0, 400, busy=5.0, life=0.0, end=False)
        assert off.room(off.state.signals(now), now) == 200
        off.enqueue("c", now, est_blocks=500)
        assert off.step(now).admitted == []


def test_what_the_host_pool_cannot_hold_counts_whole():
    """vLLM's host LRU holds every stored prompt up to its size: what of the admitted
    contexts does not fit there would be recomputed if it left the GPU, so it counts whole;
    a host tier, however small, never leaves less room than none."""
    def room(host: int | None) -> int:
        ba = BalanceAndAdmit(_cfg())
        _start(ba, 0.0, total=1000, host=host)
        for i in range(8):
            _session(ba, f"old{i}", float(i), 100, busy=5.0, life=20.0)
        for sid in ("a", "b"):  # 800 blocks admitted, a quarter of their time in the engine
            _session(ba, sid, 30.0, 400, busy=2.5, life=0.0, end=False)
        assert ba.engine_share_now(40.0) == pytest.approx(0.25)
        return ba.room(ba.state.signals(40.0), 40.0)

    assert room(10_000) == 1000 - 200  # all on host: a quarter of 800
    assert room(500) == 1000 - 300  # 300 blocks beyond the host count whole
    assert room(None) == 1000 - 800  # no host tier
    assert room(1) == 1000 - 799
    ba = BalanceAndAdmit(_cfg())
    _start(ba, 0.0, total=1000, host=500)
    _start(ba, 50.0, total=1000, host=None)  # restarted without one
    assert ba.state.signals(50.0).host_blocks is None


def test_engine_time_is_counted_by_blocks_and_ends_with_the_engine():
    """A session's engine time runs from its first call in to its last call out (a side
    call beside the main one adds nothing), weighted by its context's blocks, and an engine
    restart ends it."""
    ba = BalanceAndAdmit(_cfg())
    _start(ba, 0.0, total=1000, host=5000)
    ba.enqueue("s", 0.0, est_blocks=10)
    ba.step(0.0)
    for rid, ts in (("m", 1.0), ("side", 2.0)):
        ba.observe(make_event("gpu_submit", ts=ts, session_id="s", request_id=rid, round=0,
                              prompt_tokens=160, projected_blocks=10))
    for rid, ts in (("side", 3.0), ("m", 5.0), ("unknown", 6.0)):
        ba.observe(make_event("gpu_end", ts=ts, session_id="s", request_id=rid,
                              prompt_tokens=160, output_tokens=1, reason="stop", duration_s=1))
    adm = ba._admitted["s"]
    assert adm.accounts(9.0, None) == pytest.approx((40.0, 90.0))
    ba.observe(make_event("gpu_submit", ts=10.0, session_id="s", request_id="n", round=1,
                          prompt_tokens=320, projected_blocks=20))  # its context doubled
    assert adm.accounts(11.0, None) == pytest.approx((60.0, 120.0))
    _start(ba, 12.0, total=1000, host=5000)  # the call is lost with the engine
    assert adm.accounts(20.0, None) == pytest.approx((80.0, 140.0 + 20 * 8))
    ba.release("s", 20.0)
    assert len(ba.engine_share) == 1


def test_a_quiet_session_stops_counting_in_its_share():
    """Past the longest recent gap between rounds a session is quiet: the room does not
    count it, and neither does its share (a client that never ends its sessions would
    otherwise drag the share towards zero until the idle reaper)."""
    from mars.policy.control.admission import RoundGaps

    ba = BalanceAndAdmit(_cfg())
    ba.gaps = RoundGaps(min_samples=1)
    ba.gaps.observe(5.0)
    _start(ba, 0.0, total=1000, host=5000)
    ba.enqueue("s", 0.0, est_blocks=10)
    ba.step(0.0)
    ba.observe(make_event("gpu_submit", ts=0.0, session_id="s", request_id="r", round=0,
                          prompt_tokens=160, projected_blocks=10))
    ba.observe(make_event("gpu_end", ts=1.0, session_id="s", request_id="r",
                          prompt_tokens=160, output_tokens=1, reason="stop", duration_s=1))
    adm = ba._admitted["s"]
    assert adm.accounts(100.0, ba.gaps.longest()) == pytest.approx((10.0, 60.0))
    # a sign of life at 50 (a tool call) counts from there, not back to its quiet start, and
    # a session in a tool is not quiet however long the tool runs
    ba.observe(make_event("tool_start", ts=50.0, session_id="s", tool="bash", call_id="c"))
    assert adm.accounts(100.0, ba.gaps.longest(), ba._tools("s")) == pytest.approx(
        (10.0, 60.0 + 10 * 50))
    ba.observe(make_event("tool_end", ts=80.0, session_id="s", tool="bash", call_id="c",
                          status="ok", duration_s=30.0))
    assert adm.accounts(82.0, ba.gaps.longest()) == pytest.approx((10.0, 60.0 + 10 * 32))
    ba.release("s", 300.0)  # reaped long after: its sample ends where it went quiet again
    assert ba.engine_share._ended[-1] == pytest.approx((10.0, 60.0 + 10 * 35))


def test_host_tier_flag_is_checked():
    with pytest.raises(ValueError, match="host_tier"):
        AdmissionConfig(host_tier=1)
