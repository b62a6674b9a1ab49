"""The batch cost: what one more admitted session costs every decode step, measured by the
engine (DecodeCost, ``kv_snapshot``'s ``batch_share``) and weighed by the control plane
against the door wait (mars.policy.control.batch_cost)."""

from __future__ import annotations

import math

import pytest

from mars.policy.control.admission import AdmissionConfig, BalanceAndAdmit
from mars.policy.control.batch_cost import batch_elasticity, worth_admitting_more
from mars.policy.control.pressure import DualPressureState
from mars.policy.engine.step_stats import DecodeCost
from mars.protocol.events import make_event, parse_event
from tests.test_policy_residency import _cfg, _session, _start


def test_more_sessions_are_worth_it_while_the_queue_outweighs_the_slowdown():
    """q / N > e / (1 - e), e = engine share x batch share."""
    assert batch_elasticity(0.5, 0.8) == pytest.approx(0.4)      # threshold 2/3
    assert not worth_admitting_more(1, 2, 0.5, 0.8)               # q/N = 0.5
    assert worth_admitting_more(3, 4, 0.5, 0.8)                   # 0.75
    assert not worth_admitting_more(2, 2, 0.5, 1.0)               # e = 1/2: exactly level
    assert worth_admitting_more(3, 2, 0.5, 1.0)
    assert not worth_admitting_more(1, 10, 0.9, 0.9)              # e = 0.81: needs q > 4.3 N
    assert worth_admitting_more(45, 10, 0.9, 0.9)
    assert not worth_admitting_more(1000, 1, 1.0, 1.0)            # throughput flat: never
    assert worth_admitting_more(1, 1000, 0.8, 0.0)                # the batch costs nothing
    assert worth_admitting_more(1, 1000, 0.0, 0.9)                # sessions live in tools
    # no evidence: the share charge as before; nothing admitted: nothing to slow
    assert worth_admitting_more(1, 50, 1.0, None)
    assert worth_admitting_more(1, 0, 1.0, 1.0)
    assert not worth_admitting_more(0, 5, 0.1, 0.1)               # nobody to admit


def test_the_decode_cost_is_fitted_from_the_steps():
    """Steps of an empty-step cost, a cost per call and a cost per context token, read at
    batches whose size and context vary apart: the fit recovers all three, and the batch's
    share at a batch follows (at the steps' means by default)."""
    dc = DecodeCost(alpha=0.01, min_steps=16)
    a, c, b = 0.003, 0.001, 5e-8  # 3 ms, 1 ms a call, 2 ms per 40 K tokens
    steps = [(1 + k % 5, 10_000 * (1 + (3 * k) % 11)) for k in range(400)]
    for u, x in steps[:15]:
        dc.observe(u, x, a + c * u + b * x)
    assert dc.fit() is None and dc.batch_share() is None  # too few steps
    for u, x in steps[15:]:
        dc.observe(u, x, a + c * u + b * x)
    fa, fc, fb = dc.fit()
    assert (fa, fc, fb) == pytest.approx((a, c, b), rel=1e-6)
    assert dc.batch_share(5, 200_000) == pytest.approx(0.015 / 0.018)
    assert dc.batch_share(0, 0) == 0.0
    u, x = dc.mean_calls, dc.mean_tokens
    assert 1 < u < 5 and 10_000 < x < 110_000
    assert dc.batch_share() == pytest.approx((c * u + b * x) / (a + c * u + b * x))
    # fitted on the context alone, the calls' part would have gone to the intercept
    alone = DecodeCost(alpha=0.01, min_steps=16)
    for u, x in steps:
        alone.observe(3, x, a + c * u + b * x)  # (the calls not told apart: held at 3)
    assert alone.batch_share() < dc.batch_share() - 0.1


def test_a_batch_whose_size_and_context_move_together_is_fitted_on_one():
    """Calls all of one context: the batch's size and context are one variable, and either
    alone gives the share at the mean (the context's is used)."""
    dc = DecodeCost(alpha=0.01, min_steps=16)
    for k in range(200):
        u = 1 + k % 6
        dc.observe(u, 20_000 * u, 0.004 + 0.002 * u)
    a, c, b = dc.fit()
    assert c == 0.0 and b == pytest.approx(1e-7) and a == pytest.approx(0.004)
    u = dc.mean_calls
    assert dc.batch_share() == pytest.approx(0.002 * u / (0.004 + 0.002 * u))


def test_the_decode_cost_ignores_nonsense_and_clips_noise():
    flat = DecodeCost(min_steps=4)
    for _ in range(10):
        flat.observe(2, 1000, 0.01)
    assert flat.fit() is None  # nothing varied: no slope to fit
    flat.observe(2, -1, 0.01), flat.observe(2, 10, math.nan), flat.observe(2, 10, 0.0)
    flat.observe(0, 10, 0.01)
    assert flat._n == 10
    # a cost falling with the batch (noise) is a slope of 0 and a share of 0
    down = DecodeCost(alpha=0.1, min_steps=2)
    for u, x, y in ((1, 0, 0.02), (2, 1000, 0.01), (1, 0, 0.02), (2, 1000, 0.01)):
        down.observe(u, x, y)
    assert down.fit()[1:] == (0.0, 0.0) and down.batch_share() == 0.0
    # an empty-step cost below 0 is 0: the whole step grows with the batch
    steep = DecodeCost(alpha=0.1, min_steps=2)
    for u, x, y in ((1, 1000, 0.01), (1, 2000, 0.03), (1, 1000, 0.01), (1, 2000, 0.03)):
        steep.observe(u, x, y)
    assert steep.fit()[0] == 0.0 and steep.batch_share() == 1.0
    # one of the two explaining nothing (its slope negative): the other alone
    mixed = DecodeCost(alpha=0.01, min_steps=16)
    for k in range(300):
        u, x = 1 + k % 4, 10_000 * (1 + (5 * k) % 7)
        mixed.observe(u, x, 0.004 + 2e-7 * x - 1e-4 * u)
    a, c, b = mixed.fit()
    assert c == 0.0 and b > 0


def _snapshot(ts: float, total: int, **kw) -> dict:
    ev = make_event("kv_snapshot", ts=ts, total_blocks=total, free_blocks=total,
                    used_blocks=0, running=kw.pop("running", 0), waiting=0, **kw)
    parse_event(ev)  # schema-valid
    return ev


def test_the_batch_share_travels_with_the_kv_snapshot():
    st = DualPressureState()
    assert st.signals(0.0).batch_share is None
    st.observe(_snapshot(1.0, 100, running=3, batch_share=0.7))
    assert st.signals(1.0).batch_share == 0.7
    st.observe(_snapshot(2.0, 100))  # an engine that does not report it
    assert st.signals(2.0).batch_share is None
    st.observe(_snapshot(3.0, 100, batch_share=0.5))
    for bad in (1.5, -0.1, math.nan, "x"):
        before = st.ignored_events
        st.observe(make_event("kv_snapshot", ts=4.0, total_blocks=100, free_blocks=100,
                              used_blocks=0, batch_share=bad))
        assert st.ignored_events == before + 1
    assert st.signals(4.0).batch_share == 0.5
    st.observe(_snapshot(0.5, 100, batch_share=0.9))  # out of order: the newest stays
    assert st.signals(4.0).batch_share == 0.5
    stale = st.config.kv_stale_s
    assert st.signals(3.0 + stale + 1.0).batch_share is None  # stale with its snapshot
    with pytest.raises(Exception):
        parse_event(make_event("kv_snapshot", ts=1.0, total_blocks=1, free_blocks=1,
                               used_blocks=0, batch_share=1.2))


def _host_tier_engine(batch_share: float | None, **kw) -> BalanceAndAdmit:
    """With the batch cost on: a 1000-block pool over a host tier; eight ended sessions and
    two admitted ones of 400 blocks each, paused in tools, spent half their time in the
    engine: engine share 1/2, so the share charge leaves 600 blocks, the whole one 200."""
    ba = BalanceAndAdmit(_cfg(**{"batch_cost": True, **kw}))
    _start(ba, 0.0, total=1000, host=10_000)
    for i in range(8):
        _session(ba, f"old{i}", float(i), 100, busy=10.0, life=20.0)
    for sid in ("a", "b"):
        _session(ba, sid, 30.0, 400, busy=5.0, life=0.0, end=False)
    ba.observe(_snapshot(40.0, 1000, running=2,
                         **({"batch_share": batch_share} if batch_share is not None else {})))
    assert ba.engine_share_now(40.0) == pytest.approx(0.5)
    return ba


def test_past_the_whole_context_room_only_a_long_enough_queue_is_admitted():
    """Engine share 1/2 and a decode step all batch (batch share 1): e = 1/2, so sessions
    past the whole-context room (200 blocks) are worth admitting once the queue holds more
    than are admitted (2). One queued, or two: charged whole, none fits; three: the share
    charge (600 blocks), two of them in. The window_update event says which charge the
    step used."""
    ba = _host_tier_engine(batch_share=1.0)
    ba.enqueue("c", 40.0, est_blocks=500)
    res = ba.step(40.0)
    assert res.admitted == [] and res.charge == "whole"
    assert "charge=whole" in res.events(40.0)[0]["reason"]
    ba.enqueue("d", 40.0, est_blocks=300)
    res = ba.step(40.0)  # two against two: level, not worth it
    assert res.admitted == [] and res.charge == "whole"
    ba.enqueue("e", 40.0, est_blocks=250)
    res = ba.step(40.0)
    assert sorted(res.admitted) == ["d", "e"] and res.charge == "share"
    assert "charge=share" in res.events(40.0)[0]["reason"]
    assert ba.is_queued("c")


@pytest.mark.parametrize("batch_share,kw", [(0.4, {}), (None, {}), (1.0, {"batch_cost": False})])
def test_a_cheap_batch_an_unknown_cost_or_the_ablation_keep_the_share_charge(batch_share, kw):
    """e = 1/2 x 0.4 = 0.2 (threshold 0.25): one queued session against two admitted is
    worth it; an engine that
    has not fitted its cost (or does not report it) gives no evidence against; with
    ``batch_cost`` off the share charge alone decides, as before."""
    ba = _host_tier_engine(batch_share=batch_share, **kw)
    ba.enqueue("c", 40.0, est_blocks=500)
    res = ba.step(40.0)
    assert res.admitted == ["c"] and res.charge == "share"


def test_the_dry_run_reads_the_batch_cost_as_a_step_would():
    """A session moved to this engine (placement's dry run) is a queue of one: at e = 1/2
    (threshold 1) against three admitted (q/N = 1/3) it is not worth the room past the whole
    contexts (190 blocks left); at e = 0.1 it is."""
    ba = _host_tier_engine(batch_share=1.0)
    ba.enqueue("x", 40.0, est_blocks=10)
    ba.step(40.0)  # a last decision to read the window's budget from
    assert ba.take_out("x") is None  # (admitted: it fit the whole room)
    assert ba.would_admit(150, 40.0) is True   # fits what whole contexts leave
    assert ba.would_admit(500, 40.0) is False  # only the share charge would make room
    cheap = _host_tier_engine(batch_share=0.2)
    cheap.enqueue("x", 40.0, est_blocks=10)
    cheap.step(40.0)
    assert cheap.would_admit(500, 40.0) is True


def test_batch_cost_flag_is_checked():
    assert AdmissionConfig().batch_cost is False  # opt-in (docs/results.md, *The batch cost*)
    with pytest.raises(ValueError, match="batch_cost"):
        AdmissionConfig(batch_cost="yes")


@pytest.mark.parametrize("asy", [False, True], ids=["sync", "async"])
def test_the_engine_fits_its_decode_cost_and_reports_it(tmp_path, asy):
    """vLLM's real scheduler on a virtual clock whose decode step costs 4 ms, 0.5 ms a call
    and 50 ns per context token of the batch: calls of different prompts start and finish at different
    times, so the batch's context varies; the engine's fit recovers the step's form and its
    ``kv_snapshot`` reports the batch's share of the step at the decode steps' mean context,
    idle too (the batch paused, not gone)."""
    pytest.importorskip("vllm")
    import json

    from mars.engine.harness.offline import OfflineEngine

    holder: dict = {}

    def step_time(out) -> float:
        reqs = holder["eng"].sched.requests
        ctx = sum(reqs[r].num_computed_tokens for r in out.num_scheduled_tokens if r in reqs)
        prefill = out.total_num_scheduled_tokens - len(out.num_scheduled_tokens)
        return 0.004 + 5e-4 * len(out.num_scheduled_tokens) + 5e-8 * ctx + 2e-5 * prefill

    events = tmp_path / "ev.jsonl"
    eng = OfflineEngine("mars", num_blocks=4096, max_num_seqs=16, step_time=step_time,
                        async_scheduling=asy,
                        mars={"events_file": str(events), "snapshot_interval_s": 0.05})
    holder["eng"] = eng
    try:
        for j in range(12):
            n = 200 + 900 * j
            eng.add(f"r{j}", [100 + (j * 31 + i * 7) % 800 for i in range(n)], 40 + 25 * j,
                    job_id=f"s{j}", last_round=True)
            for _ in range(15):
                eng.step()
        eng.run_until_idle()
        dc = eng.sched.mars_decode_cost
        fit, calls, mean = dc.fit(), dc.mean_calls, dc.mean_tokens
    finally:
        eng.close()
    assert fit is not None
    a, c, b = fit
    # the fit is of what the engine measured between steps: under async scheduling a step's
    # span is its own; each step's context is read as scheduled (its new token included)
    assert (a, c, b) == pytest.approx((0.004, 5e-4, 5e-8), rel=0.05)
    snaps = [json.loads(line) for line in events.read_text().splitlines()]
    snaps = [e for e in snaps if e["kind"] == "kv_snapshot"]
    shares = [e["batch_share"] for e in snaps if e.get("batch_share") is not None]
    assert shares and all(0.0 <= s <= 1.0 for s in shares)
    # a batch of a few thousand to ~80 K tokens: 0.05-0.5 ms of context against 4 ms empty
    assert 2_000 < mean < 80_000
    assert snaps[-1]["running"] == 0  # idle at the end, and the share still reported
    grow = c * calls + b * mean
    assert snaps[-1]["batch_share"] == pytest.approx(grow / (a + grow), abs=1e-4)
