"""UpdateWindow (mars.policy.control.window) and the dual-pressure state it reads (mars.policy.control.pressure)."""

from __future__ import annotations

import math

import pytest

from mars.policy.control.window import (WindowController, AIMDConfig, Hysteresis, OverloadBand,
                               WindowDecision, cpu_little_cap, kv_soft_cap)
from mars.protocol.events import make_event
from mars.policy.control.pressure import DualPressureState, PressureConfig


def kv(state: DualPressureState, ts: float, util: float, total: int = 1000, **kw) -> None:
    free = round(total * (1.0 - util))
    state.observe(make_event("kv_snapshot", ts=ts, total_blocks=total, free_blocks=free,
                             used_blocks=total - free, **kw))


def tools(state: DualPressureState, ts: float, n: int, prefix: str = "t") -> None:
    for i in range(n):
        state.observe(make_event("tool_start", session_id=f"{prefix}{i}", ts=ts, tool="bash",
                                 call_id=f"{prefix}{i}"))


# ------------------------------------------------------------------ pressure state
def test_pressure_unknown_before_snapshot():
    st = DualPressureState()
    sig = st.signals(0.0)
    assert sig.kv_utilisation is None and sig.kv_headroom is None and sig.free_blocks is None
    assert not sig.kv_known
    assert sig.active_tools == 0 and sig.cpu_load == 0.0
    assert sig.tool_slowdown is None and sig.tool_duration_ema is None


def test_pressure_tracks_kv_tools_and_preemptions():
    st = DualPressureState(PressureConfig(tool_cores=4, preempt_window_s=10))
    st.observe(make_event("kv_snapshot", ts=1.0, total_blocks=1000, free_blocks=250,
                          used_blocks=700, pinned_blocks=50, running=4, waiting=2))
    tools(st, 1.0, 3)
    st.observe(make_event("tool_end", session_id="t0", ts=3.0, tool="bash", duration_s=2.0,
                          call_id="t0"))
    st.observe(make_event("preempt", ts=2.0, request_id="r", blocks=10))
    sig = st.signals(5.0)
    assert sig.kv_utilisation == pytest.approx(0.75)
    assert sig.kv_headroom == pytest.approx(0.25)
    assert sig.free_blocks == 250 and sig.pinned_blocks == 50
    assert sig.engine_queue_ratio == pytest.approx(0.5)
    assert sig.active_tools == 2 and sig.cpu_load == pytest.approx(0.5)
    assert st.active_tools_of("t1") == 1 and st.active_tools_of("t0") == 0
    assert sig.tool_duration_ema == pytest.approx(2.0)
    assert sig.preemptions == 1
    assert st.signals(12.5).preemptions == 0  # left the 10 s window


def test_pressure_pinned_reclaimable_and_staleness():
    st = DualPressureState(PressureConfig(pinned_reclaimable=1.0, kv_stale_s=30))
    st.observe(make_event("kv_snapshot", ts=0.0, total_blocks=1000, free_blocks=200,
                          used_blocks=800, pinned_blocks=200))
    assert st.signals(1.0).kv_utilisation == pytest.approx(0.6)
    assert st.signals(1.0).free_blocks == 400
    assert st.signals(31.0).kv_utilisation is None  # stale -> unknown


def test_pressure_robust_to_unmatched_and_malformed_events():
    st = DualPressureState()
    st.observe(make_event("tool_end", session_id="x", ts=1.0, tool="bash", duration_s=1.0))
    assert st.active_tools == 0
    assert st.observe({"kind": "kv_snapshot", "ts": 1.0}) is True  # missing fields -> zeros
    assert st.observe({"kind": "tool_end", "ts": 1.0}) is False  # no duration -> ignored
    assert st.ignored_events == 1
    tools(st, 1.0, 2)
    st.observe(make_event("tool_start", session_id="t0", ts=1.0, tool="bash", call_id="t0"))
    assert st.active_tools == 2  # duplicate start with the same call id is ignored
    st.observe(make_event("tool_num", ts=2.0, active=5))
    assert st.active_tools == 5  # absolute resync
    st.observe(make_event("session_end", session_id="t0", ts=3.0, reason="last_round"))
    assert st.active_tools == 4


def _jitter(i: int) -> float:
    """A deterministic +-5 % wobble: tools of one type never take exactly the same time."""
    return 1.0 + 0.05 * ((i * 7) % 5 - 2) / 2


def test_pressure_slowdown_per_tool_type():
    st = DualPressureState(PressureConfig())
    t = 0.0
    for i in range(60):  # baseline: bash ~1 s, pytest ~10 s (a baseline needs its calls)
        for tool, d in (("bash", 1.0), ("pytest", 10.0)):
            st.observe(make_event("tool_end", session_id="s", ts=t, tool=tool,
                                  duration_s=d * _jitter(i)))
    tools(st, t, 1)
    assert st.signals(t).tool_slowdown == pytest.approx(1.0)  # mix alone is no slowdown
    for i in range(10):  # bash now takes 3 s
        st.observe(make_event("tool_end", session_id="s", ts=t, tool="bash",
                              duration_s=3.0 * _jitter(i)))
    assert st.signals(t).tool_slowdown > 2.0
    assert st.tool_duration_of("bash") > 2.5
    assert st.tool_duration_of("pytest") == pytest.approx(10.0, rel=0.05)


# ------------------------------------------------------------------ soft KV cap
def test_kv_soft_cap_shape():
    assert kv_soft_cap(None, 1, 64, 0.7) == 64
    assert kv_soft_cap(0.5, 1, 64, 0.7) == 64
    assert kv_soft_cap(0.7, 1, 64, 0.7) == 64
    assert kv_soft_cap(0.85, 1, 64, 0.7, 2.0) == pytest.approx(1 + 63 * 0.75)
    assert kv_soft_cap(1.0, 1, 64, 0.7) == 1
    assert kv_soft_cap(1.2, 1, 64, 0.7) == 1
    us = [i / 1000 for i in range(0, 1101)]
    caps = [kv_soft_cap(u, 1, 64, 0.7) for u in us]
    assert all(b <= a for a, b in zip(caps, caps[1:])), "must be monotone non-increasing"
    for u, c in zip(us, caps):
        if 0.701 <= u <= 0.999:
            assert 1 < c < 64, (u, c)
    # no jump anywhere: the cap is continuous (max step on a 0.001 grid is small)
    assert max(a - b for a, b in zip(caps, caps[1:])) < 0.5


def test_kv_cap_top_is_pool_capacity_in_sessions():
    ctl = WindowController(AIMDConfig(max_window=64, kv_knee=0.7))
    st = DualPressureState()
    kv(st, 0.0, 0.5)  # 500 used blocks by 10 sessions -> 50 blocks each -> 20 sessions fit
    d = ctl.update(st, in_use=10, now=0.0)
    assert d.kv_cap == pytest.approx(20.0)
    kv(st, 1.0, 0.85)
    d = ctl.update(st, in_use=10, now=1.0)
    assert 10 < d.kv_cap < 20


# ------------------------------------------------------------------ CPU cap
def test_cpu_cap_tightens_as_active_tools_exceed_cores():
    caps = [cpu_little_cap(8, 1.0, None, 1, 64, active_tools=a, in_use=10) for a in range(0, 31)]
    assert caps[:9] == [64.0] * 9  # at or under the cores: no backlog guard
    assert caps[12] == pytest.approx(10 * 8 / 12)
    assert caps[16] == pytest.approx(5.0)
    assert all(b <= a for a, b in zip(caps, caps[1:]))
    assert all(c < 10 for c in caps[9:])  # any excess stops admission (cap < in_use)
    assert cpu_little_cap(8, 1.0, 0.5, 1, 64) == pytest.approx(16.0)
    assert cpu_little_cap(8, 1.0, 0.01, 1, 64) == 64.0  # clamped to the ceiling
    assert cpu_little_cap(8, 1.0, 100.0, 1, 64) == 1.0  # clamped to the floor


def _tools(st, ctl, in_use: int, t0: int, t1: int, duration: float, long_every: int = 0,
           ends: list | None = None, kv_util: float | None = None):
    """Each of 10 sessions starts a tool every 10 s (1 start/s overall), each running
    ``duration`` s (every ``long_every``-th one 25x longer); the controller steps every
    0.5 s with the KV cache at ``kv_util`` (default: no snapshot, so KV counts as scarce and
    the Little's-law share binds in full). ``ends``: the calls still running (pass the same list
    to go on). Returns the last decision."""
    ends = [] if ends is None else ends
    d = None
    for k in range(2 * t0, 2 * t1):
        now = k / 2
        if kv_util is not None and k % 2 == 0:
            kv(st, now, kv_util)
        while ends and ends[0][0] <= now:
            te, i, dur = ends.pop(0)
            st.observe(make_event("tool_end", session_id=f"s{i % 10}", ts=te, tool="bash",
                                  duration_s=dur, call_id=str(i)))
        if k % 2 == 0:
            i = k // 2
            st.observe(make_event("tool_start", session_id=f"s{i % 10}", ts=now, tool="bash",
                                  call_id=str(i)))
            dur = duration * (25 if long_every and i % long_every == 0 else 1)
            ends.append((now + dur, i, dur))
            ends.sort()
        d = ctl.update(st, in_use, now)
    return d


def test_cpu_cap_follows_littles_law_from_the_running_tools():
    cfg = AIMDConfig(max_window=64, cpu_rate_tau_s=60, cpu_rate_min_session_s=30)
    ctl = WindowController(cfg)
    st = DualPressureState(PressureConfig(tool_cores=8))
    # 1 start/s of 4 s each: 4 tools running on average, 0.4 per session of 10
    running: list = []
    d = _tools(st, ctl, 10, 0, 200, 4.0, ends=running)
    assert ctl.tools_per_session(st.signals(200.0)) == pytest.approx(0.4, rel=0.05)
    assert d.cpu_cap == pytest.approx(20.0, rel=0.05)
    # tools get twice as slow -> the cap halves
    d = _tools(st, ctl, 10, 200, 400, 8.0, ends=running)
    assert d.cpu_cap == pytest.approx(10.0, rel=0.06)


def test_the_share_phases_in_as_the_kv_cache_becomes_scarce():
    """Coupled CPU cap: with KV to spare a host backlog strands nothing on the GPU, so the
    Little's-law share does not hold sessions outside; it phases in along the KV soft cap's
    ramp (no admit/stop threshold at the knee) and binds in full at a full or unknown KV
    cache. The same tool stream at several KV levels; with the coupling off, the share binds
    at any level."""
    caps = {}
    for util in (None, 0.3, 0.7, 0.71, 0.8, 0.9, 0.99, 1.0):
        ctl = WindowController(AIMDConfig(max_window=64, cpu_rate_tau_s=60,
                                          cpu_rate_min_session_s=30, kv_knee=0.7,
                                          kv_cap_exponent=2.0))
        st = DualPressureState(PressureConfig(tool_cores=8))
        d = _tools(st, ctl, 10, 0, 200, 4.0, kv_util=util)
        assert ctl.tools_per_session(st.signals(200.0)) == pytest.approx(0.4, rel=0.05)
        caps[util] = d.cpu_cap
    share = caps[None]
    assert share == pytest.approx(20.0, rel=0.05) and caps[1.0] == share
    assert caps[0.3] == caps[0.7] == 64.0
    assert 63.0 < caps[0.71] < 64.0  # just past the knee: a sliver, not a step
    # weight ((u - 0.7) / 0.3) ** 2 of the way from the ceiling down to the share's cap
    for u in (0.8, 0.9, 0.99):
        w = ((u - 0.7) / 0.3) ** 2
        assert caps[u] == pytest.approx(64.0 - w * (64.0 - share), rel=1e-6)
    levels = [caps[u] for u in (0.3, 0.7, 0.71, 0.8, 0.9, 0.99, 1.0)]
    assert levels == sorted(levels, reverse=True)
    ctl = WindowController(AIMDConfig(max_window=64, cpu_rate_tau_s=60,
                                      cpu_rate_min_session_s=30, cpu_cap_coupled=False))
    st = DualPressureState(PressureConfig(tool_cores=8))
    assert _tools(st, ctl, 10, 0, 200, 4.0, kv_util=0.3).cpu_cap == pytest.approx(20.0, rel=0.05)


def test_the_backlog_guard_binds_at_any_kv_utilisation():
    """Tools already beyond the cores are contention now, not a forecast: admission stops
    (cap below the admitted sessions) with the KV cache nearly empty too."""
    ctl = WindowController(AIMDConfig(max_window=64))
    st = DualPressureState(PressureConfig(tool_cores=4))
    kv(st, 0.0, 0.2)
    tools(st, 0.0, 8)
    d = ctl.update(st, in_use=10, now=0.0)
    assert d.cpu_cap == pytest.approx(10 * 4 / 8) and d.budget == 5


def test_one_long_tool_moves_the_cpu_cap_by_its_share_only():
    """A 100 s call in a stream of 4 s calls adds its core-seconds as they pass, not its
    duration at once (the rate x duration-EMA estimate it replaced jumped by ~20 s x rate on
    the call's end and cut the cap to a quarter, 4.9 sessions, for the next calls)."""
    cfg = AIMDConfig(max_window=64, cpu_rate_tau_s=60, cpu_rate_min_session_s=30)
    ctl = WindowController(cfg)
    st = DualPressureState(PressureConfig(tool_cores=8))
    caps, running = [], []
    for t0 in range(0, 300, 10):
        d = _tools(st, ctl, 10, t0, t0 + 10, 4.0, long_every=97, ends=running)
        caps.append(d.cpu_cap)
    # one call in 97 runs 100 s: ~5 tools running instead of 4 -> the cap stays near 16-20
    assert min(caps[6:]) >= 14.0, caps


# ------------------------------------------------------------------ AIMD
def test_decrease_on_kv_overload():
    ctl = WindowController(AIMDConfig(initial_window=8, backoff_ratio=0.75))
    st = DualPressureState()
    kv(st, 0.0, 0.97)
    d = ctl.update(st, in_use=8, now=0.0)
    assert d.mode == "decrease" and d.window == pytest.approx(6.0)
    assert d.kv_overloaded and not d.cpu_overloaded and not d.compute_overloaded
    assert d.budget <= 6 and d.slots == 0


def test_decrease_on_cpu_overload():
    ctl = WindowController(AIMDConfig(initial_window=8, backoff_ratio=0.75, cpu=OverloadBand(1.25, 0.9, 5)))
    st = DualPressureState(PressureConfig(tool_cores=8))
    tools(st, 0.0, 11)  # load 1.375 >= cpu_enter 1.25
    d = ctl.update(st, in_use=8, now=0.0)
    assert d.mode == "hold" and not d.cpu_overloaded  # not yet persistent
    assert d.cpu_cap < 8 and d.slots == 0  # but the backlog guard already stops admission
    assert ctl.update(st, in_use=8, now=4.9).mode == "hold"
    d = ctl.update(st, in_use=8, now=5.0)
    assert d.mode == "decrease" and d.window == pytest.approx(6.0)
    assert d.cpu_overloaded and not d.kv_overloaded


def _slowed_calls(st: DualPressureState) -> None:
    """A baseline of 60 ~1 s bash calls, then 10 calls five times slower."""
    for i in range(60):
        st.observe(make_event("tool_end", session_id="s", ts=0.0, tool="bash",
                              duration_s=_jitter(i)))
    for i in range(10):
        st.observe(make_event("tool_end", session_id="s", ts=0.0, tool="bash",
                              duration_s=5.0 * _jitter(i)))


def _persistent_cpu_overload(kv_util: float | None, coupled: bool = True,
                             slowed: bool = False) -> list[str]:
    """Modes of 20 control steps, 1 s apart, with 11 tools on 8 cores (load 1.375 > the
    band's 1.25 entry) held throughout, at the given KV utilisation."""
    ctl = WindowController(AIMDConfig(initial_window=8, increase_interval_s=1.0,
                                      healthy_ticks=1, cpu=OverloadBand(1.25, 0.9, 5),
                                      cpu_band_coupled=coupled))
    st = DualPressureState(PressureConfig(tool_cores=8))
    if slowed:
        _slowed_calls(st)
    tools(st, 0.0, 11)
    modes = []
    for t in range(20):
        if kv_util is not None:
            kv(st, float(t), kv_util)
        modes.append(ctl.update(st, in_use=int(ctl.window), now=float(t)).mode)
    return modes


def test_persistent_oversubscription_cuts_the_window_at_any_kv_utilisation():
    """11 tools on 8 cores for 5 s is persistent host contention (paper §4.1): the window is
    cut whether the KV cache is nearly empty, past its knee or unknown, coupled or not."""
    for util in (0.3, 0.8, None):
        modes = _persistent_cpu_overload(util)
        assert modes[5] == "decrease" and "increase" not in modes, (util, modes)
    assert "decrease" in _persistent_cpu_overload(0.3, coupled=False)


def _busy_cores(kv_util: float, active: int, in_use: int = 8,
                coupled: bool = True) -> list[WindowDecision]:
    """30 control steps, 1 s apart, ``active`` tools on 8 cores held throughout."""
    ctl = WindowController(AIMDConfig(initial_window=8, increase_interval_s=1.0,
                                      healthy_ticks=1, cpu=OverloadBand(1.25, 0.9, 5),
                                      cpu_band_coupled=coupled))
    st = DualPressureState(PressureConfig(tool_cores=8))
    tools(st, 0.0, active)
    out = []
    for t in range(30):
        kv(st, float(t), kv_util)
        out.append(ctl.update(st, in_use=in_use, now=float(t)))
    return out


def test_busy_cores_hold_growth_only_while_the_kv_cache_is_scarce():
    """Cores busy with no tool waiting (8 tools on 8 cores, load 1.0, inside the band):
    with KV to spare the window grows -- a session held outside would only delay GPU rounds
    that overlap the others' tools (found in ``mars sim``: at ILR-2 on the H200, cores ~90 %
    busy and KV 15-25 % used, this hold kept sessions queued while `mars_no_ctrl`, without
    admission, was 10 % faster). Past the knee the band holds it, as it does uncoupled."""
    assert _busy_cores(0.3, 8)[-1].window > 8.0
    assert {d.mode for d in _busy_cores(0.8, 8)} == {"hold"}
    assert {d.mode for d in _busy_cores(0.3, 8, coupled=False)} == {"hold"}


def test_oversubscribed_cores_hold_the_window_at_any_kv_utilisation():
    """Tools beyond the cores (9 on 8: load 1.125, inside the band) are contention now: the
    backlog guard caps admission below the admitted sessions and the window must not wind up
    behind it (it grew 8 -> 11 while the guard held the budget at 7, and would have let three
    sessions in at once as the tools drained)."""
    for d in _busy_cores(0.3, 9):
        assert d.window == 8.0 and d.mode == "hold" and d.budget == 7 and d.slots == 0
    # the guard alone, with fewer sessions admitted than the window: 6 x 8 / 11 sessions
    ctl = WindowController(AIMDConfig(initial_window=8))
    st = DualPressureState(PressureConfig(tool_cores=8))
    kv(st, 0.0, 0.3)
    tools(st, 0.0, 11)
    d = ctl.update(st, in_use=6, now=0.0)
    assert d.cpu_cap == pytest.approx(6 * 8 / 11) and d.budget == 4 and d.slots == 0


def test_tool_slowdown_counts_at_any_kv_utilisation():
    """Tools measurably slower than their baseline are the contention that hurts: the
    slowdown band cuts the window with the KV cache nearly empty too."""
    modes = _persistent_cpu_overload(0.3, slowed=True)
    assert modes[0] == "decrease", modes


def test_transient_cpu_spike_does_not_decrease():
    ctl = WindowController(AIMDConfig(initial_window=8, cpu=OverloadBand(1.25, 0.9, 5)))
    st = DualPressureState(PressureConfig(tool_cores=8))
    for t in range(0, 60):
        n = 12 if t % 4 == 0 else 4  # a 1 s burst above cpu_enter every 4 s
        st.observe(make_event("tool_num", ts=float(t), active=n))
        d = ctl.update(st, in_use=8, now=float(t))
        assert d.window == 8.0 and not d.cpu_overloaded


def test_decrease_on_preemption_and_engine_queue():
    ctl = WindowController(AIMDConfig(initial_window=8))
    st = DualPressureState()
    st.observe(make_event("preempt", ts=0.0, request_id="r", blocks=4))
    d = ctl.update(st, in_use=8, now=0.0)
    assert d.mode == "decrease" and d.kv_overloaded
    ctl2 = WindowController(AIMDConfig(initial_window=8, engine_queue=OverloadBand(1.0, 0.25, 2)))
    st2 = DualPressureState()
    kv(st2, 0.0, 0.5, running=4, waiting=8)
    assert ctl2.update(st2, in_use=8, now=0.0).mode == "hold"
    kv(st2, 2.0, 0.5, running=4, waiting=8)
    d2 = ctl2.update(st2, in_use=8, now=2.0)
    assert d2.mode == "decrease" and d2.compute_overloaded and not d2.kv_overloaded



def test_calls_waiting_for_their_kv_from_the_host_tier_are_not_a_compute_queue():
    """A call whose KV is still on the host link waits for the transfer, not for compute:
    a burst of tool returns over a host tier (``mars sim``'s tool-heavy: 15 of the window's
    cuts) was read as GPU-compute overload. Loads do not count in the engine-queue ratio; the
    calls queued for compute beside them still do, and a producer's count above ``waiting``
    is clipped to it."""
    band = OverloadBand(1.0, 0.25, 2)
    st = DualPressureState()
    kv(st, 0.0, 0.5, running=2, waiting=5, loading=4)
    sig = st.signals(0.0)
    assert sig.engine_waiting == 5 and sig.engine_loading == 4
    assert sig.engine_queue_ratio == pytest.approx(0.5)
    ctl = WindowController(AIMDConfig(initial_window=8, engine_queue=band))
    for t in (0.0, 1.0, 2.0, 3.0):
        kv(st, t, 0.5, running=2, waiting=5, loading=4)
        d = ctl.update(st, in_use=8, now=t)
        assert not d.compute_overloaded and d.mode != "decrease", d.reason
    # the same queue with the loads landed and the calls still waiting: compute overload
    ctl = WindowController(AIMDConfig(initial_window=8, engine_queue=band))
    for t in (0.0, 2.0):
        kv(st, 10.0 + t, 0.5, running=2, waiting=5, loading=0)
        d = ctl.update(st, in_use=8, now=10.0 + t)
    assert d.compute_overloaded and d.mode == "decrease"
    kv(st, 20.0, 0.5, running=2, waiting=1, loading=3)
    assert st.signals(20.0).engine_loading == 1
    assert st.signals(20.0).engine_queue_ratio == 0.0
    kv(st, 21.0, 0.5, running=2, waiting=1, loading=-1)  # malformed: dropped, counted
    assert st.ignored_events == 1 and st.signals(21.0).engine_loading == 1

def test_decrease_takes_operating_point_not_unused_window():
    ctl = WindowController(AIMDConfig(initial_window=20, backoff_ratio=0.75))
    st = DualPressureState()
    kv(st, 0.0, 0.97)
    d = ctl.update(st, in_use=8, now=0.0)
    assert d.window == pytest.approx(6.0)  # 0.75 * min(20, 8)


def test_decreases_are_rate_limited_and_wait_for_drain():
    cfg = AIMDConfig(initial_window=8, backoff_ratio=0.75, decrease_cooldown_s=10)
    ctl = WindowController(cfg)
    st = DualPressureState()
    kv(st, 0.0, 0.97)
    windows = []
    for t in range(0, 31, 5):  # in_use 0: nothing drains, only the cooldown limits
        kv(st, float(t), 0.97)
        windows.append(ctl.update(st, in_use=0, now=float(t)).window)
    assert windows == pytest.approx([6.0, 6.0, 4.5, 4.5, 3.375, 3.375, 2.375])
    # drain rule: with 8 sessions still admitted above a window of 6, no second cut
    ctl = WindowController(cfg)
    assert ctl.update(st, in_use=8, now=30.0).window == pytest.approx(6.0)
    d = ctl.update(st, in_use=8, now=45.0)
    assert d.mode == "hold" and d.window == pytest.approx(6.0) and "draining" in d.reason
    d = ctl.update(st, in_use=6, now=46.0)
    assert d.mode == "decrease" and d.window == pytest.approx(4.5)


def test_window_and_budget_never_below_floor():
    ctl = WindowController(AIMDConfig(initial_window=4, min_window=1,
                                         decrease_cooldown_s=1))
    st = DualPressureState()
    for t in range(50):
        kv(st, float(t), 1.0)
        d = ctl.update(st, in_use=0, now=float(t))
    assert d.window == 1.0 and d.budget == 1 and d.slots == 1


def test_no_growth_while_under_used():
    ctl = WindowController(AIMDConfig(initial_window=8, healthy_ticks=3,
                                         increase_interval_s=2, increase_min_utilisation=0.75))
    st = DualPressureState()
    kv(st, 0.0, 0.3)
    for t in range(0, 121, 2):
        kv(st, float(t), 0.3)
        d = ctl.update(st, in_use=5, now=float(t))  # 5 < 0.75 * 8
        assert d.window == 8.0 and d.mode == "hold"
    assert "under-used" in d.reason


def test_a_fractional_window_filled_to_its_whole_slots_grows():
    """A cut from two admitted sessions leaves W = 1.5: one slot. One session in it is the
    window used (0.75 x 1.5 = 1.125 could never be reached with one slot), so sustained
    health grows it again. Before, it stayed at one session for good (`mars_no_coord` in
    ``mars sim`` at ILR-4 0.034 tasks/s: sessions queued ten minutes behind an idle GPU).
    With a cap binding below the window's slots, it still does not grow (anti-windup)."""
    def run(in_use: int, window: float, kv_util: float = 0.3) -> WindowDecision:
        ctl = WindowController(AIMDConfig(initial_window=window, healthy_ticks=3,
                                          increase_interval_s=2))
        st = DualPressureState()
        for t in range(0, 21, 2):
            kv(st, float(t), kv_util)
            d = ctl.update(st, in_use=in_use, now=float(t))
        return d

    assert run(1, 1.5).window == pytest.approx(2.5)
    assert run(2, 2.75).window > 2.75  # 2 whole slots filled; 0.75 x 2.75 = 2.06
    assert run(1, 2.75).window == 2.75  # one of two slots: under-used
    assert run(5, 8.0).window == 8.0  # 5 < 0.75 x 8, as before
    assert run(6, 8.0).window == 9.0  # 0.75 x 8 = 6 < floor(8): the fraction still rules
    # W = 8 held to 2 sessions by the KV soft cap (healthy, below the KV band's leave): the
    # window's slots are not filled, so it does not wind up
    d = run(2, 8.0, kv_util=0.84)
    assert d.budget == 2 and d.window == 8.0 and "under-used" in d.reason


def test_growth_after_sustained_health_when_used():
    ctl = WindowController(AIMDConfig(initial_window=8, healthy_ticks=3,
                                         increase_interval_s=2, additive_increase=1))
    st = DualPressureState()
    trace = []
    for t in range(0, 13, 2):
        kv(st, float(t), 0.3)
        d = ctl.update(st, in_use=math.floor(ctl.window), now=float(t))
        trace.append((d.window, d.mode))
    assert trace == [(8.0, "hold"), (8.0, "hold"), (8.0, "hold"), (9.0, "increase"),
                     (9.0, "hold"), (9.0, "hold"), (10.0, "increase")]


def _slow_start_run(queued: list[int], *, per_session: float = 0.005, in_use=None,
                    initial: float = 8, kv_util=None, **cfg) -> tuple[WindowController, list]:
    """A window fed one healthy KV snapshot and one evaluation per second (every evaluation
    may increase). Each admitted session holds ``per_session`` of the pool (so the KV cap's
    session ceiling, pool / footprint, stays far above the window) unless ``kv_util`` fixes
    the utilisation; ``in_use`` (a function of W) defaults to a full window."""
    ctl = WindowController(AIMDConfig(initial_window=initial, healthy_ticks=1,
                                      increase_interval_s=1, **cfg))
    st = DualPressureState()
    use = in_use or (lambda w: math.floor(w))

    def util(n: int) -> float:
        return kv_util if kv_util is not None else per_session * n

    kv(st, 0.0, util(use(ctl.window)))
    ctl.update(st, in_use=use(ctl.window), now=0.0)  # the first evaluation is a second later
    out = []
    for t, q in enumerate(queued, start=1):
        n = use(ctl.window)
        kv(st, float(t), util(n))
        out.append(ctl.update(st, in_use=n, now=float(t), queued=q))
    return ctl, out


def test_demand_led_start_adds_the_sessions_waiting_at_most_doubling():
    """Before any overload an increase adds the sessions waiting for a slot (at most W):
    short sessions at a high rate no longer queue for minutes behind a window growing by one
    every few seconds with every signal healthy (held-out ``short`` workload, docs). Nobody
    or one session waiting: the additive step; the config switch restores it always."""
    def grow(queued: list[int], **cfg) -> list[float]:
        return [d.window for d in _slow_start_run(queued, **cfg)[1]]

    assert grow([30, 30, 30, 30]) == [16.0, 32.0, 62.0, 64.0]  # at most doubling; ceiling
    assert grow([3, 0, 1, 5]) == [11.0, 12.0, 13.0, 18.0]  # the waiting sessions, or +1
    assert grow([30, 30], demand_increase=False) == [9.0, 10.0]
    # more sessions waiting never means slower growth (W below the additive step)
    assert grow([5], initial=2, additive_increase=4) == [6.0]


def test_demand_led_start_counts_only_the_sessions_beyond_the_free_slots():
    """Sessions the window's free slots admit anyway are no demand on W: six of eight slots
    used and two waiting is no reason to grow (it once opened two slots nobody took)."""
    # 6 in use: 2 waiting fit the 2 free slots of W = 8 (+1); 5 waiting, 3 free slots of
    # W = 9: 2 beyond (+2); 12 waiting, 5 free slots of W = 11: 7 beyond (+7)
    _, out = _slow_start_run([2, 5, 12], in_use=lambda w: 6, increase_min_utilisation=0.5)
    assert [d.window for d in out] == [9.0, 11.0, 18.0]


def test_demand_led_start_does_not_wind_up_behind_a_cap_or_without_kv_evidence():
    """The demand step is taken only when the window is what holds the sessions: behind the
    KV soft cap (KV past its knee, still healthy) it would wind W up far above what the
    engine takes; with no KV feed (a restarted engine, a stale snapshot) the signals are
    healthy only for want of data."""
    # KV at 0.80: past the knee, below the band's leave threshold (0.85), so healthy; the
    # soft cap holds the budget at or below the sessions in use, and W grows by one
    _, out = _slow_start_run([40] * 3, kv_util=0.80, in_use=lambda w: 20, initial=20)
    assert out[-1].budget == 22 < out[-1].window  # the soft cap binds (22.3 sessions)
    assert [d.window for d in out] == [21.0, 22.0, 23.0]
    # below the knee, but a cap holds the budget under W (the KV cap's session ceiling, its
    # footprint average still carrying two big sessions seen a moment ago): +1
    ctl = WindowController(AIMDConfig(initial_window=8, healthy_ticks=1,
                                      increase_interval_s=1))
    st = DualPressureState()
    kv(st, 0.0, 0.6)
    ctl.update(st, in_use=2, now=0.0)
    kv(st, 1.0, 0.3)
    d = ctl.update(st, in_use=8, now=1.0, queued=40)
    assert d.kv_cap < 8 and d.window == 9.0 and d.mode == "increase"
    # no KV feed at all: additive, however many wait
    ctl = WindowController(AIMDConfig(initial_window=8, healthy_ticks=1,
                                      increase_interval_s=1))
    st = DualPressureState()
    ws = [ctl.update(st, in_use=math.floor(ctl.window), now=float(t), queued=80).window
          for t in range(5)]
    assert ws == [8.0, 9.0, 10.0, 11.0, 12.0] and ctl.slow_start
    # the same with a KV feed below the knee: demand-led
    _, out = _slow_start_run([80] * 3)
    assert [d.window for d in out] == [16.0, 32.0, 64.0]


def test_demand_led_start_keeps_the_other_growth_rules():
    """Slow start changes the size of a step, never when one is taken: not while the window
    is under-used, not while a signal is above its leave threshold."""
    _, out = _slow_start_run([40] * 3, in_use=lambda w: 4)
    assert [d.window for d in out] == [8.0] * 3
    assert all("under-used" in d.reason for d in out)
    # KV utilisation 0.90: inside the KV band (leave 0.85, enter 0.95): hold
    _, out = _slow_start_run([40] * 3, kv_util=0.90)
    assert [d.window for d in out] == [8.0] * 3 and all(d.mode == "hold" for d in out)


def test_the_first_overload_ends_the_demand_led_start():
    """After a cut the window is near what the signals allow: growth is additive again
    however many sessions wait, so it does not jump back into the overload it just left."""
    ctl = WindowController(AIMDConfig(initial_window=16, healthy_ticks=1,
                                      increase_interval_s=1))
    st = DualPressureState()
    assert ctl.slow_start
    kv(st, 0.0, 0.97)
    d = ctl.update(st, in_use=16, now=0.0, queued=20)
    assert d.mode == "decrease" and d.window == 12.0 and not ctl.slow_start
    windows = []
    for t in range(1, 5):
        kv(st, float(t), 0.01 * math.floor(ctl.window))
        windows.append(ctl.update(st, in_use=math.floor(ctl.window), now=float(t),
                                  queued=20).window)
    assert windows == [13.0, 14.0, 15.0, 16.0]
    assert not WindowController(AIMDConfig(demand_increase=False)).slow_start
    # an overload at the window's floor cuts nothing but ends the start all the same
    ctl = WindowController(AIMDConfig(initial_window=1, healthy_ticks=1,
                                      increase_interval_s=1))
    kv(st, 10.0, 0.97)
    d = ctl.update(st, in_use=1, now=10.0, queued=20)
    assert d.mode == "hold" and "floor" in d.reason and not ctl.slow_start


def test_growth_rate_independent_of_call_rate():
    ctl = WindowController(AIMDConfig(initial_window=8, healthy_ticks=3,
                                         increase_interval_s=2))
    st = DualPressureState()
    kv(st, 0.0, 0.3)
    windows = [ctl.update(st, in_use=8, now=i / 10).window for i in range(0, 61)]
    assert windows[59] == 8.0 and windows[60] == 9.0
    assert windows.count(9.0) == 1


def test_growth_stops_at_ceiling_and_resets_on_band():
    ctl = WindowController(AIMDConfig(initial_window=9, max_window=10, healthy_ticks=1,
                                         increase_interval_s=1))
    st = DualPressureState()
    kv(st, 0.0, 0.3)
    for t in range(10):
        d = ctl.update(st, in_use=10, now=float(t))
    assert d.window == 10.0 and d.budget == 10 and d.reason == "healthy at ceiling"


def test_no_toggling_inside_kv_band():
    cfg = AIMDConfig(initial_window=8, kv=OverloadBand(0.95, 0.85))
    ctl = WindowController(cfg)
    st = DualPressureState()
    decisions = []
    for i in range(200):
        u = 0.87 if i % 2 else 0.93
        kv(st, float(i), u)
        decisions.append(ctl.update(st, in_use=8, now=float(i)))
    assert {d.window for d in decisions} == {8.0}
    assert {d.mode for d in decisions} == {"hold"}
    assert {d.kv_overloaded for d in decisions} == {False}
    assert {d.slots for d in decisions} == {0}

    # Same oscillation after entering overload: one decrease, then a constant hold.
    ctl = WindowController(cfg)
    kv(st, 1000.0, 0.97)
    first = ctl.update(st, in_use=6, now=1000.0)
    assert first.mode == "decrease" and first.window == pytest.approx(4.5)
    later = []
    for i in range(1, 200):
        kv(st, 1000.0 + i, 0.87 if i % 2 else 0.93)
        later.append(ctl.update(st, in_use=4, now=1000.0 + i))
    assert {d.window for d in later} == {4.5}
    assert {d.mode for d in later} == {"hold"}
    assert {d.kv_overloaded for d in later} == {True}  # latched until below 0.85
    assert {d.slots for d in later} == {0}
    kv(st, 1300.0, 0.80)
    assert not ctl.update(st, in_use=4, now=1300.0).kv_overloaded


def test_no_toggling_inside_cpu_band():
    ctl = WindowController(AIMDConfig(initial_window=8, cpu=OverloadBand(1.25, 0.9)))
    st = DualPressureState(PressureConfig(tool_cores=8))
    tools(st, 0.0, 8)
    decisions = []
    for i in range(200):
        # 8 <-> 9 active tools: load 1.0 <-> 1.125, inside (0.9, 1.25)
        if i % 2:
            st.observe(make_event("tool_start", session_id="x", ts=float(i), tool="bash",
                                  call_id=f"x{i}"))
        else:
            st.observe(make_event("tool_end", session_id="x", ts=float(i), tool="bash",
                                  duration_s=0.5, call_id=f"x{i - 1}"))
        decisions.append(ctl.update(st, in_use=8, now=float(i)))
    assert {d.window for d in decisions} == {8.0}
    assert {d.mode for d in decisions} == {"hold"}
    assert {d.cpu_overloaded for d in decisions} == {False}
    assert {d.slots for d in decisions} == {0}


def test_budget_is_min_of_window_and_caps():
    ctl = WindowController(AIMDConfig(initial_window=8, max_window=64))
    st = DualPressureState()
    d = ctl.update(st, in_use=0, now=0.0)  # nothing known: only the window limits
    assert (d.kv_cap, d.cpu_cap, d.budget, d.slots) == (64.0, 64.0, 8, 8)
    kv(st, 1.0, 0.9)  # 900 blocks over 3 sessions -> 300 each -> pool holds 3.33
    d = ctl.update(st, in_use=3, now=1.0)
    assert d.kv_cap < 3 and d.budget == math.floor(d.kv_cap) and d.slots == 0


def test_config_validation():
    with pytest.raises(ValueError):
        AIMDConfig(min_window=0)
    with pytest.raises(ValueError):
        AIMDConfig(kv=OverloadBand(0.8, 0.9))
    with pytest.raises(ValueError):
        AIMDConfig(initial_window=100, max_window=64)
    with pytest.raises(ValueError):
        AIMDConfig(backoff_ratio=1.0)
    with pytest.raises(ValueError):
        AIMDConfig(cpu={"enter": 1.25, "leave": 0.9, "persist_s": -1})


def test_hysteresis_latch():
    h = Hysteresis("x", enter=1.0, leave=0.5)
    assert [h.update(v) for v in (0.7, 1.0, 0.7, 0.6, 0.5, 0.7, None)] == \
        [False, True, True, True, False, False, False]
    p = Hysteresis("p", enter=1.0, leave=0.5, persist_s=3.0)
    seq = [(0, 1.2), (2, 1.2), (2.5, 0.8), (3, 1.2), (5.9, 1.5), (6, 1.1), (7, 0.7), (8, 0.5)]
    assert [p.update(v, t) for t, v in seq] == \
        [False, False, False, False, False, True, True, False]


def test_slowdown_counts_as_overload_only_while_tools_fill_the_cores():
    """Tool calls of one type vary tenfold in recorded agent traces: a long call on a machine
    whose tool cores sit idle is the call's own length, not contention. The slowdown band
    only acts while the tools fill the cores (load at the CPU band's leave threshold or
    above). Found in ``mars sim``: at 0.1 tasks/s the window fell to one session on an idle
    GPU and new sessions queued 70 s."""
    def run(active: int) -> str:
        ctl = WindowController(AIMDConfig(initial_window=8, backoff_ratio=0.75))
        st = DualPressureState(PressureConfig(tool_cores=8))
        _slowed_calls(st)
        tools(st, 0.0, active)
        assert st.signals(0.0).tool_slowdown > 2.0
        return ctl.update(st, in_use=8, now=0.0).mode

    assert run(1) == "hold"  # one tool on eight cores: no contention to speak of
    assert run(8) == "decrease"  # the cores are full and tools run slower: contention
