"""The host's tool cores shared by several engines' control planes (``--cpu-budget node``):
the policy pieces alone (``NodeTools``, ``split_tool_count``, the CPU cap with the other
engines' tools), then the served sidecar's ``EngineSet`` routing tool events to them."""

from __future__ import annotations

import time

import pytest

from mars.policy.control.admission import AdmissionConfig
from mars.policy.control.pressure import (DualPressureState, NodeTools, PressureConfig,
                                          split_tool_count)
from mars.policy.control.window import AIMDConfig, WindowController, cpu_little_cap


def _tools(state: DualPressureState, sid: str, n: int, ts: float = 1.0,
           cpu_bound: bool = True) -> None:
    for i in range(n):
        state.observe({"kind": "tool_start", "ts": ts, "session_id": sid,
                       "call_id": f"{sid}-{i}", "tool": "t", "cpu_bound": cpu_bound})


def test_each_state_reads_the_others_running_tools_and_the_hosts_load():
    a, b = (DualPressureState(PressureConfig(tool_cores=8)) for _ in range(2))
    node = NodeTools()
    node.join(a)
    node.join(b)
    with pytest.raises(ValueError, match="already shares"):
        node.join(a)
    _tools(a, "s1", 5)
    _tools(b, "s2", 1)
    _tools(b, "s3", 2, cpu_bound=False)  # waits on the network: no core
    sa, sb = a.signals(2.0), b.signals(2.0)
    assert (sa.active_tools, sa.other_tools) == (5, 1)
    assert (sb.active_tools, sb.other_tools) == (1, 5)
    # the load is the host's, the same on both engines
    assert sa.cpu_load == sb.cpu_load == b.cpu_load == pytest.approx(6 / 8)
    assert node.active == 6
    # one ends: both see it
    a.observe({"kind": "tool_end", "ts": 3.0, "session_id": "s1", "call_id": "s1-0",
               "tool": "t", "duration_s": 2.0})
    assert b.signals(3.0).other_tools == 4 and node.active == 5
    # alone, nothing else is counted
    alone = DualPressureState(PressureConfig(tool_cores=8))
    _tools(alone, "s", 3)
    assert alone.signals(2.0).other_tools == 0 and alone.signals(2.0).cpu_load == 3 / 8
    assert not alone.shares_host and a.shares_host


def test_the_others_demand_is_what_their_admitted_sessions_are_expected_to_run():
    """Between two tools a session runs none, but will: an engine's long-run cap must count
    the others' admitted sessions, or every engine sees the host free while the others'
    sessions are in model calls and admits for all of it."""
    a, b = (DualPressureState(PressureConfig(tool_cores=8)) for _ in range(2))
    node = NodeTools()
    node.join(a, lambda: 6.0)  # six admitted sessions' worth of tools expected
    node.join(b, lambda: 1.0)
    _tools(a, "s1", 2)
    sb = b.signals(2.0)
    assert sb.other_tools == 2 and sb.other_demand == 6.0  # the forecast, above the running
    _tools(a, "s2", 7)
    assert b.signals(2.0).other_demand == 9.0  # the running, above the forecast
    sa = a.signals(2.0)
    assert sa.other_tools == 0 and sa.other_demand == 1.0
    # the long-run cap counts the demand, the backlog guard the running tools
    assert cpu_little_cap(8, 1.0, 0.5, 1, 64, other_tools=2, other_demand=6.0) == \
        pytest.approx((8 - 6) / 0.5)


@pytest.mark.parametrize("active, tracked, want", [
    (10, [4, 0], [7, 3]),    # more than tracked: the rest spread equally
    (5, [4, 0], [4, 1]),     # (the remainder to the plane tracking fewest,
    (5, [0, 4], [1, 4]),     # wherever it stands; the first among equals)
    (7, [3, 1, 1], [3, 2, 2]),
    (3, [4, 0], [3, 0]),     # fewer: taken from the plane tracking most
    (1, [2, 2, 0], [0, 1, 0]),
    (0, [3, 1], [0, 0]),
    (4, [0, 0, 0], [2, 1, 1]),
    (2, [], []),
])
def test_a_hosts_tool_count_is_split_keeping_each_planes_own(active, tracked, want):
    got = split_tool_count(active, tracked)
    assert got == want and sum(got) == (active if tracked else 0)
    assert all(v >= 0 for v in got)


def test_a_negative_tool_count_is_refused():
    with pytest.raises(ValueError, match="negative"):
        split_tool_count(-1, [1])


def test_the_cpu_cap_counts_the_cores_the_other_engines_leave():
    # 8 cores, one tool per session: alone 8 sessions fit; with 5 of the host's tools
    # running for another engine's sessions, 3 do
    assert cpu_little_cap(8, 1.0, 1.0, 1, 64) == pytest.approx(8.0)
    assert cpu_little_cap(8, 1.0, 1.0, 1, 64, other_tools=5) == pytest.approx(3.0)
    # others fill the host: the floor
    assert cpu_little_cap(8, 1.0, 1.0, 1, 64, other_tools=9) == 1.0
    # the backlog guard reads the host: 4 own + 6 others on 8 cores is a backlog of 10 / 8,
    # shed in proportion on every engine, so the cap is below the 4 sessions admitted
    # (none is admitted until it drains) -- not in_use x (8 - 6) / 4, the whole excess
    guarded = cpu_little_cap(8, 1.0, None, 1, 64, active_tools=4, in_use=4, other_tools=6)
    assert guarded == pytest.approx(4 * 8 / 10) and guarded < 4
    # an engine running no tools of its own holds too while the host is backlogged
    assert cpu_little_cap(8, 1.0, None, 1, 64, active_tools=0, in_use=4,
                          other_tools=9) == pytest.approx(4 * 8 / 9)
    # with one engine the guard is as it always was
    assert cpu_little_cap(8, 1.0, None, 1, 64, active_tools=10, in_use=5) == \
        pytest.approx(5 * 8 / 10)
    # the same own load with an idle rest of the host: no guard
    assert cpu_little_cap(8, 1.0, None, 1, 64, active_tools=4, in_use=4) == 64.0


def test_an_engines_window_tightens_when_another_engine_fills_the_host():
    """The window controller of an engine whose own sessions run few tools: its CPU cap
    falls as the other engine's tools take the cores, with its own state unchanged."""
    a, b = (DualPressureState(PressureConfig(tool_cores=8)) for _ in range(2))
    node = NodeTools()
    node.join(a)
    node.join(b)
    ctl = WindowController(AIMDConfig(cpu_cap_coupled=False))
    _tools(b, "mine", 1)
    now = 1.0
    for _ in range(30):  # its tools per session measured: 1 tool over 2 sessions
        now += 1.0
        ctl.update(b, in_use=2, now=now)
    share = ctl.tools_per_session(b.signals(now))
    assert share == pytest.approx(0.5, rel=0.05)
    free = ctl.cpu_cap(b.signals(now), in_use=2)
    _tools(a, "theirs", 6, ts=now)
    busy = ctl.cpu_cap(b.signals(now), in_use=2)
    assert free == pytest.approx(8 / share) and busy == pytest.approx((8 - 6) / share)


def test_per_engine_configuration_by_budget():
    cfg = AdmissionConfig()
    cores = cfg.pressure.tool_cores
    assert cfg.per_engine(4, "node").pressure.tool_cores == cores
    assert cfg.per_engine(4, "split").pressure.tool_cores == pytest.approx(cores / 4)
    assert cfg.per_engine(1, "split") is cfg
    with pytest.raises(ValueError, match="unknown cpu budget 'nodes'"):
        cfg.per_engine(2, "nodes")


# --------------------------------------------------------------------------- the sidecar
def _engine_set(budget: str, n: int = 2):
    from mars.sidecar.config import SidecarConfig
    from mars.sidecar.engines import EngineSet
    from mars.sidecar.metrics import SidecarMetrics

    urls = tuple(f"http://127.0.0.1:{i + 1}" for i in range(n))
    cfg = SidecarConfig(upstream=urls[0], upstreams=urls, admission=True, cpu_budget=budget,
                        admission_config=AdmissionConfig(pressure=PressureConfig(tool_cores=8)))
    es = None

    def emit(ev, source):
        es.observe(ev)

    es = EngineSet(cfg, emit, SidecarMetrics())
    return es


def test_the_sidecar_shares_the_hosts_cores_between_its_engines():
    es = _engine_set("node")
    assert es.node_tools is not None
    es.router._where["a"] = 0  # session a is on engine 0
    now = time.time()
    for i in range(5):
        es.observe({"kind": "tool_start", "ts": now, "session_id": "a", "call_id": f"c{i}",
                    "tool": "t"})
    s0, s1 = (es[r].control.core.balance.state.signals(now) for r in range(2))
    assert (s0.tool_cores, s1.tool_cores) == (8, 8)  # every engine counts the host's cores
    assert (s0.active_tools, s0.other_tools) == (5, 0)
    assert (s1.active_tools, s1.other_tools) == (0, 5)
    assert s0.cpu_load == s1.cpu_load == pytest.approx(5 / 8)
    # the host's count: each engine keeps its own as far as the count allows
    es.observe({"kind": "tool_num", "ts": now, "active": 7})
    assert [es[r].control.core.balance.state.active_tools for r in range(2)] == [6, 1]
    es.observe({"kind": "tool_num", "ts": now, "active": 3})
    assert [es[r].control.core.balance.state.active_tools for r in range(2)] == [3, 0]


def test_the_split_budget_gives_each_engine_an_equal_share():
    es = _engine_set("split")
    assert es.node_tools is None
    es.router._where["a"] = 0
    now = time.time()
    for i in range(5):
        es.observe({"kind": "tool_start", "ts": now, "session_id": "a", "call_id": f"c{i}",
                    "tool": "t"})
    s0, s1 = (es[r].control.core.balance.state.signals(now) for r in range(2))
    assert (s0.tool_cores, s1.tool_cores) == (4, 4)
    assert (s0.other_tools, s1.other_tools) == (0, 0) and s1.cpu_load == 0
    es.observe({"kind": "tool_num", "ts": now, "active": 7})
    assert [es[r].control.core.balance.state.active_tools for r in range(2)] == [4, 3]


def test_a_bad_cpu_budget_is_refused_by_name():
    from mars.sidecar.config import SidecarConfig

    with pytest.raises(ValueError, match="unknown cpu budget 'half'; choose one of node, split"):
        SidecarConfig(upstream="http://127.0.0.1:1", cpu_budget="half")


def test_a_control_plane_offers_its_admitted_sessions_expected_tools():
    """``BalanceAndAdmit.share_host``: what the other engines read of this one is its
    admitted sessions x its measured tools per session (0 until it has measured one)."""
    from mars.policy.control.admission import BalanceAndAdmit

    cfg = AdmissionConfig(pressure=PressureConfig(tool_cores=8))
    mine, other = BalanceAndAdmit(cfg), BalanceAndAdmit(cfg)
    node = NodeTools()
    mine.share_host(node)
    other.share_host(node)
    assert other.state.signals(1.0).other_demand == 0.0
    for sid in ("s1", "s2", "s3", "s4"):
        mine.enqueue(sid, 1.0, prompt_tokens=100)
    mine.step(1.0)
    assert mine.in_use == 4
    _tools(mine.state, "s1", 2)
    now = 1.0
    for _ in range(60):  # 2 tools over 4 sessions, time-averaged
        now += 1.0
        mine.step(now)
    share = mine.controller.tools_per_session()
    assert share == pytest.approx(0.5, rel=0.05)
    sig = other.state.signals(now)
    assert sig.other_tools == 2 and sig.other_demand == pytest.approx(4 * share)


def test_a_tool_on_one_engine_steps_the_others_at_once():
    import asyncio

    async def main():
        es = _engine_set("node")
        es.router._where["a"] = 0
        assert es[1].control._kick is None
        es.observe({"kind": "tool_start", "ts": time.time(), "session_id": "a",
                    "call_id": "c0", "tool": "t"})
        kicked = es[1].control._kick is not None
        await asyncio.sleep(0.05)
        return kicked, es[1].control._kick is None

    kicked, ran = asyncio.run(main())
    assert kicked and ran  # scheduled, then stepped

    async def session_end(with_tool: bool):
        """A session's end concerns the others only when it drops tools still running."""
        es = _engine_set("node")
        es.router._where["b"] = 0
        es[0].control.observe({"kind": "session_start", "ts": time.time(), "session_id": "b"})
        if with_tool:
            es[0].control.observe({"kind": "tool_start", "ts": time.time(),
                                   "session_id": "b", "call_id": "c1", "tool": "t"})
        assert es[1].control._kick is None
        es.observe({"kind": "session_end", "ts": time.time(), "session_id": "b",
                    "reason": "done"})
        kicked = es[1].control._kick is not None
        await asyncio.sleep(0.05)
        return kicked

    assert asyncio.run(session_end(with_tool=True))
    assert not asyncio.run(session_end(with_tool=False))
    es = _engine_set("split")  # an equal share each: the others are not concerned
    es.router._where["a"] = 0

    async def split():
        es.observe({"kind": "tool_start", "ts": time.time(), "session_id": "a",
                    "call_id": "c0", "tool": "t"})
        return es[1].control._kick

    assert asyncio.run(split()) is None


def test_the_running_count_follows_every_change_between_reads():
    """The count is kept between changes (every engine reads every other's at each step):
    each kind of change must show at the next read."""
    st = DualPressureState(PressureConfig(tool_cores=8, tool_stale_s=100.0))
    _tools(st, "a", 2, ts=1.0)
    assert st.active_tools == 2
    _tools(st, "b", 1, ts=50.0)
    assert st.active_tools == 3
    st.observe({"kind": "tool_end", "ts": 60.0, "session_id": "a", "call_id": "a-0",
                "tool": "t", "duration_s": 59.0})
    assert st.active_tools == 2
    st.observe({"kind": "tool_num", "ts": 61.0, "active": 5})
    assert st.active_tools == 5
    st.observe({"kind": "tool_num", "ts": 61.0, "active": 2})
    st.forget_session("b")
    assert st.active_tools == 1 and st.tracked_tools == 1
    st.signals(200.0)  # a-1, started at 1 s, is stale at 200 s: dropped
    assert st.tracked_tools == 0
