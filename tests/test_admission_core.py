"""The sidecar's session admission as a sans-IO state machine, on a fake clock: no event loop,
no HTTP. The asyncio shell (``mars.sidecar.control``) and the simulator drive this object."""

from __future__ import annotations

import dataclasses

import pytest

from mars.policy.control.admission import AdmissionConfig, QueueFull
from mars.protocol.events import make_event
from mars.policy.control.window import AIMDConfig
from mars.policy.control.admission_core import AdmissionCore, CoreConfig, Listener


class Shell:
    def __init__(self, admission: bool = True, window: int = 2, **cfg) -> None:
        self.events: list[dict] = []
        self.admitted: list[str] = []
        self.ended: list[tuple[str, str]] = []
        acfg = AdmissionConfig(aimd=AIMDConfig(min_window=1, initial_window=window,
                                               max_window=max(window, 1)), **cfg)
        self.core = AdmissionCore(
            CoreConfig(admission=admission, admission_config=acfg, idle_timeout_s=10.0),
            Listener(emit=self.events.append,
                     admitted=lambda s, q: self.admitted.append(s.id),
                     ended=lambda s, r: self.ended.append((s.id, r))))

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events]


def test_pass_through_admits_at_once_and_ends_on_the_last_round():
    sh = Shell(admission=False)
    c = sh.core
    s = c.arrive("a", 0.0)
    assert s.is_admitted and sh.admitted == ["a"] and c.in_use == 1
    c.forward(s, 0.1)
    c.finish(s, "ok", 0.2)
    assert not s.ended  # no marker yet: the session goes on to a tool
    c.forward(s, 1.0, last_round=True)
    c.finish(s, "ok", 1.5)
    assert s.ended and sh.ended == [("a", "last_round")] and c.in_use == 0
    assert sh.kinds() == ["session_admit", "session_end"]


def test_a_session_the_engine_refused_gives_its_slot_back():
    """A sidecar without keys in front of an engine with keys: the engine's 401 ends the
    session at once instead of leaving its slot taken until the idle timeout."""
    sh = Shell(admission=False)
    c = sh.core
    s = c.arrive("a", 0.0)
    c.forward(s, 0.1)
    c.finish(s, "refused", 0.2)
    assert s.ended and sh.ended == [("a", "error")] and c.in_use == 0


def test_queued_sessions_are_admitted_by_steps_within_the_window():
    sh = Shell(window=2)
    c = sh.core
    ss = [c.arrive(sid, 0.0) for sid in ("a", "b", "c")]
    assert not any(s.is_admitted for s in ss) and c.queued == 3
    admitted = c.step(0.01)
    assert [s.id for s in admitted] == sh.admitted and len(admitted) == 2
    assert c.in_use == 2 and c.queued == 1
    assert "window_update" in sh.kinds() and sh.kinds().count("session_admit") == 2
    # the third waits until a slot is released
    assert c.step(0.02) == []
    first = admitted[0]
    c.forward(first, 0.03, last_round=True)
    c.finish(first, "ok", 0.04)
    later = c.step(0.05)
    assert len(later) == 1 and c.in_use == 2 and c.queued == 0


def test_the_state_view_says_whether_the_window_is_in_its_demand_led_start():
    sh = Shell(window=2)
    assert sh.core.snapshot(0.0)["slow_start"] is True
    # an overload ends it: a KV snapshot past the KV band's enter threshold
    sh.core.observe(make_event("kv_snapshot", ts=1.0, total_blocks=100, free_blocks=2,
                               used_blocks=98), 1.0)
    sh.core.step(1.0)
    assert sh.core.snapshot(1.0)["slow_start"] is False
    assert Shell(admission=False).core.snapshot(0.0)["slow_start"] is None


def test_a_waiter_that_gives_up_withdraws_its_session():
    sh = Shell(window=1)
    c = sh.core
    a, b = c.arrive("a", 0.0), c.arrive("b", 0.0)
    c.step(0.0)
    waiting = b if a.is_admitted else a
    waiting.waiting = 2  # two requests of the same session wait
    c.give_up(waiting, "disconnect", 1.0)
    assert not waiting.ended and c.queued == 1  # the other waiter still wants it
    c.give_up(waiting, "error", 2.0)
    assert waiting.ended and c.queued == 0 and (waiting.id, "error") in sh.ended


def test_idle_sessions_are_reaped_on_the_fake_clock():
    sh = Shell(admission=False)
    c = sh.core
    s = c.arrive("a", 0.0)
    c.forward(s, 0.0)
    c.finish(s, "ok", 1.0)
    assert c.reap_idle(10.9) == 0
    # a tool event keeps it alive
    c.observe({"kind": "tool_start", "session_id": "a", "ts": 10.9, "tool": "t"}, 10.9)
    assert c.reap_idle(20.0) == 0
    c.observe({"kind": "tool_end", "session_id": "a", "ts": 20.0, "tool": "t",
               "duration_s": 9.1}, 20.0)
    assert c.reap_idle(29.0) == 0 and c.reap_idle(30.1) == 1
    assert sh.ended == [("a", "idle")]


def test_queue_full_records_nothing_and_ends_are_idempotent():
    sh = Shell(window=1, max_queue=1)
    c = sh.core
    c.arrive("a", 0.0)
    with pytest.raises(QueueFull):
        c.arrive("b", 0.0)
    assert set(c.sessions) == {"a"}
    assert c.end_session("a", "deleted", 1.0) and not c.end_session("a", "deleted", 1.0)
    assert sh.ended == [("a", "deleted")] and c.queued == 0


def test_one_shot_sessions_end_with_their_request():
    sh = Shell(admission=False)
    c = sh.core
    sid = c.oneshot_id()
    s = c.arrive(sid, 0.0, one_shot=True)
    c.forward(s, 0.0)
    c.finish(s, "disconnect", 0.5)
    assert sh.ended == [(sid, "disconnect")]
    assert dataclasses.is_dataclass(s)


def test_the_wait_deadline_is_a_stall_bound_that_moves_with_progress():
    """A queued session gives up only after nothing moved for the whole bound: an admission,
    a request finished well, engine output, a tool call of an admitted session ending, or an
    admitted session's end moves its deadline on; a request forwarded or failed (a dead
    engine with retrying clients), tool starts and counts (a tool runner's chatter while the
    engine hangs), a queued session's own events and a queued session leaving do not."""
    sh = Shell(window=1)
    c = sh.core
    a = c.arrive("a", 0.0)
    c.step(0.0)
    assert a.is_admitted and c.last_progress == 0.0
    c.arrive("b", 1.0)
    assert c.wait_deadline(1.0, 10.0) == 11.0  # arrival after the last progress
    c.forward(a, 2.0)
    c.finish(a, "error", 3.0)
    c.forward(a, 4.0)
    for kind in ("tool_start", "tool_num", "tool_enqueue"):
        c.observe({"kind": kind, "session_id": "a", "tool": "t", "active": 1, "ts": 5.0}, 5.0)
    c.observe({"kind": "tool_end", "session_id": "b", "tool": "t", "ts": 5.0}, 5.0)  # queued
    assert c.wait_deadline(1.0, 10.0) == 11.0  # none of that is progress
    c.observe({"kind": "kv_snapshot", "total_blocks": 10, "free_blocks": 5, "used_blocks": 5,
               "ts": 6.0}, 6.0)  # the engine stepped
    assert c.wait_deadline(1.0, 10.0) == 16.0
    c.finish(a, "ok", 7.0)
    c.observe({"kind": "tool_end", "session_id": "a", "tool": "t", "duration_s": 1.0,
               "ts": 9.0}, 9.0)
    assert c.wait_deadline(1.0, 10.0) == 19.0  # far past 1.0 + 10: still waiting
    q = c.arrive("q", 12.0)
    c.give_up(q, "disconnect", 13.0)  # a queued session leaving: no slot came free
    assert c.wait_deadline(1.0, 10.0) == 19.0
    c.end_session("a", "idle", 20.0)  # a slot comes free: progress
    assert c.wait_deadline(1.0, 10.0) == 30.0


def test_the_engine_s_gpu_submit_reaches_the_packing_room():
    """``gpu_submit`` is one of the events the core hands to BalanceAndAdmit: an admitted
    session's projected context then bounds what later sessions are packed into, also once
    the KV snapshot has gone stale (the pool's size is the engine's, not the snapshot's)."""
    from mars.protocol.events import make_event
    from mars.policy.control.packing import PackConfig

    sh = Shell(window=4, packing=PackConfig(kv_reserve_frac=0.0))
    c = sh.core
    c.observe(make_event("scheduler_start", ts=0.0, scheduler_cls="x", policy="mars",
                         total_blocks=1000, block_size=16, pid=1), 0.0)
    c.observe(make_event("kv_snapshot", ts=0.0, total_blocks=1000, free_blocks=1000,
                         used_blocks=0, running=0, waiting=0), 0.0)
    a = c.arrive("a", 0.0, prompt_tokens=100 * 16)
    assert [s.id for s in c.step(0.0)] == ["a"]
    c.observe(make_event("gpu_submit", ts=0.1, session_id="a", request_id="a.r0", round=0,
                         prompt_tokens=900 * 16, projected_blocks=900), 0.1)
    assert c.balance.projected_blocks() == 900
    c.observe(make_event("gpu_end", ts=0.2, session_id="a", request_id="a.r0",
                         freed_blocks=900, output_tokens=5, status="finished_stopped"), 0.2)
    # a's tool runs for a minute: the engine is idle, its last snapshot goes stale
    b = c.arrive("b", 1.0, prompt_tokens=200 * 16)
    assert c.step(60.0) == [] and not b.is_admitted  # 1000 - 900 left: b does not fit
    assert c.balance.room(c.balance.state.signals(60.0), 60.0) == 100
    c.forward(a, 61.0, last_round=True)
    c.finish(a, "ok", 61.5)
    assert [s.id for s in c.step(62.0)] == ["b"]


def test_round_gaps_are_timed_on_the_core_s_clock_and_shown_in_the_views():
    """The gaps between a session's rounds are measured when the core sees the events (its
    own clock, the one its steps use), not by the engine's timestamps, so a skewed engine
    clock cannot make every session look quiet; the views say which sessions are."""
    from mars.protocol.events import make_event

    sh = Shell(window=4)
    c = sh.core
    a = c.arrive("a", 0.0, prompt_tokens=16)
    c.arrive("b", 0.0, prompt_tokens=16)
    assert {s.id for s in c.step(0.0)} == {"a", "b"}

    def call(sid: str, rnd: int, start: float, end: float) -> None:
        # the engine's clock is an hour behind the core's
        c.observe(make_event("gpu_submit", ts=start - 3600, session_id=sid,
                             request_id=f"{sid}.r{rnd}", round=rnd, prompt_tokens=160,
                             projected_blocks=10), start)
        c.observe(make_event("gpu_end", ts=end - 3600, session_id=sid,
                             request_id=f"{sid}.r{rnd}", freed_blocks=10, output_tokens=3,
                             status="finished_stopped"), end)

    call("b", 0, 0.5, 1.0)
    n = c.balance.gaps.min_samples
    for rnd in range(n + 1):
        call("a", rnd, 1.0 + 2 * rnd, 2.0 + 2 * rnd)  # 1 s between rounds
    assert c.balance.gaps.longest() == 1.0
    last_end = 2.0 + 2 * n
    now = last_end + 30.0
    view = {s["session_id"]: s["quiet"] for s in c.sessions_view(now)}
    assert view == {"a": True, "b": True}  # both idle longer than 1 s
    snap = c.snapshot(now)
    assert snap["quiet_sessions"] == 2 and snap["projected_blocks"] == 0
    assert snap["round_gap_longest_s"] == 1.0
    assert snap["growth_samples"] == 0  # no session has ended: nothing forecast
    assert snap["host_blocks"] is None and snap["engine_share"] is None  # no host tier
    assert snap["charge"] == "" and snap["signals"]["batch_share"] is None
    assert {s["session_id"]: s["quiet"] for s in c.sessions_view(last_end + 0.5)} == {
        "a": False, "b": True}
    # the core hands BalanceAndAdmit the tool calls queued for a core, and its own forwards
    c.observe(make_event("tool_enqueue", ts=0.0, session_id="b", tool="bash", call_id="q"),
              now)
    c.forward(a, now)  # a's pause since its last call (30 s) is a gap, ended by the forward
    assert c.balance.gaps.longest() == 30.0
    assert {s["session_id"]: s["quiet"] for s in c.sessions_view(now + 60.0)} == {
        "a": False, "b": False}
    c.finish(a, "error", now + 60.0)  # it never reached the engine
    assert {s["session_id"]: s["quiet"] for s in c.sessions_view(now + 89.0)} == {
        "a": False, "b": False}
    assert {s["session_id"]: s["quiet"] for s in c.sessions_view(now + 91.0)} == {
        "a": True, "b": False}
    # the views count each session's running tools (a late viewer has no tool_start to read)
    assert {s["session_id"]: s["tools"] for s in c.sessions_view(now + 91.0)} == {"a": 0, "b": 0}
    c.observe(make_event("tool_start", ts=0.0, session_id="b", tool="bash", call_id="q"),
              now + 92.0)
    assert {s["session_id"]: s["tools"] for s in c.sessions_view(now + 92.0)} == {"a": 0, "b": 1}
    c.observe(make_event("tool_end", ts=0.0, session_id="b", tool="bash", call_id="q",
                         status="ok", duration_s=1.0), now + 93.0)
    assert {s["session_id"]: s["tools"] for s in c.sessions_view(now + 93.0)} == {"a": 0, "b": 0}


def test_a_queued_session_moves_to_another_core_with_its_arrival_and_waiters():
    """Late binding between two engines' cores: a session queued at ``a`` (its window full)
    leaves it without failing its waiters (``requeued``, not ``ended``), keeps when it
    arrived, and is admitted by ``b``, whose dry run said it would be; ``a`` admits no
    longer asks for it. Nothing moves that is admitted, unknown or already there."""
    a, b = Shell(window=1), Shell(window=1)
    moved: list[str] = []
    a.core._out.requeued = lambda s: moved.append(s.id)
    a.core.arrive("held", 0.0)
    s = a.core.arrive("x", 1.0, prompt_tokens=64)
    s.waiting = 1
    a.core.step(2.0)
    assert a.admitted == ["held"] and a.core.queued == 1
    assert not a.core.would_admit(0, 2.0)  # (its own queue, and no slot)
    assert not b.core.would_admit(0, 2.0)  # (no step yet: nothing decided)
    b.core.step(2.0)
    assert b.core.would_admit(4, 2.0)
    assert a.core.transfer_out("held", 3.0) is None  # admitted: it holds its slot there
    assert a.core.transfer_out("nobody", 3.0) is None
    got = a.core.transfer_out("x", 3.0)
    assert got is not None and got[0] is s and moved == ["x"] and a.ended == []
    assert "x" not in a.core.sessions and a.core.queued == 0
    assert a.events[-1]["kind"] == "session_end" and a.events[-1]["reason"] == "requeued"
    b.core.transfer_in(*got)
    with pytest.raises(ValueError, match="already here"):
        b.core.transfer_in(*got)
    assert not b.core.would_admit(0, 3.0)  # it has a queue now
    b.core.step(4.0)
    assert b.admitted == ["x"] and s.is_admitted and s.waiting == 1
    adm = [e for e in b.events if e["kind"] == "session_admit"][-1]
    assert adm["queued_s"] == pytest.approx(3.0)  # waited since 1.0, at a then at b
    assert b.core.arrive("x", 5.0) is s  # its waiters go on with the same session


def test_without_admission_nothing_is_queued_to_move():
    sh = Shell(admission=False)
    sh.core.arrive("a", 0.0)
    assert not sh.core.would_admit(0, 1.0) and sh.core.queued_sessions() == []
    assert sh.core.transfer_out("a", 1.0) is None


def test_the_placement_view_is_the_snapshot_s_placement_fields():
    """``load_view`` (what placement reads of every engine, at every new session) gives the
    same numbers as the full snapshot, with admission on and off, before and after a step."""
    from mars.policy.control.placement import EngineTracker

    for admission in (True, False):
        sh = Shell(admission=admission, window=4)
        c = sh.core
        views = []
        c.observe(make_event("kv_snapshot", ts=0.0, total_blocks=1000, free_blocks=700,
                             used_blocks=300, running=2, waiting=0), 0.0)
        views.append((c.load_view(0.0), c.snapshot(0.0)))
        a = c.arrive("a", 0.0, prompt_tokens=100 * 16)
        c.arrive("b", 0.0, prompt_tokens=50 * 16)
        c.step(0.5)
        c.forward(a, 0.6)
        c.observe(make_event("gpu_submit", ts=0.7, session_id="a", request_id="a.r0",
                             round=0, prompt_tokens=120 * 16, projected_blocks=120), 0.7)
        views.append((c.load_view(1.0), c.snapshot(1.0)))
        for view, snap in views:
            assert view == {"budget": snap["budget"],
                            "projected_blocks": snap["projected_blocks"],
                            "inflight": snap["inflight"],
                            "signals": {"used_blocks": snap["signals"]["used_blocks"]}}
            t = EngineTracker(0)
            assert t.load_with(view) == t.load_with(snap)
        assert views[-1][0]["inflight"] == 1 and views[-1][0]["signals"]["used_blocks"] == 300
        assert (views[-1][0]["budget"] is not None) == admission
        # the KV snapshot gone stale: neither view reports blocks in use
        late = 1.0 + c.balance.state.config.kv_stale_s + 1.0
        assert c.load_view(late)["signals"]["used_blocks"] is None
        assert c.snapshot(late)["signals"]["used_blocks"] is None
        # a snapshot of no pool: utilisation unknown, so no blocks in use either
        c.observe(make_event("kv_snapshot", ts=late, total_blocks=0, free_blocks=0,
                             used_blocks=5, running=0, waiting=0), late)
        assert c.balance.state.signals(late).engine_running == 0  # (fresh, not stale)
        assert c.load_view(late)["signals"]["used_blocks"] is None
        assert c.snapshot(late)["signals"]["used_blocks"] is None
