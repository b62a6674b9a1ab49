"""What a run's latency is made of (``mars.sim.fidelity``): the engine's calls, the rest."""

from __future__ import annotations

import math

import pytest

from mars.sim.fidelity import engine_call_seconds, engine_calls, engine_side_mean, outside_engine
from mars.workloads.results import RoundResult, RunResult, TaskResult


def _ev(kind: str, rid: str, ts: float) -> dict:
    return {"v": 1, "kind": kind, "ts": ts, "session_id": "s", "request_id": rid}


def _round(i: int, rid: str, submit: float, end: float, tool: float = 0.0,
           tool_run: float | None = None) -> RoundResult:
    r = RoundResult(index=i, prompt_tokens=10, output_tokens=2, planned_output_tokens=2,
                    submit_s=submit, first_token_s=submit + 0.01, end_s=end, request_id=rid,
                    tool="t" if tool else None, tool_duration_s=tool)
    if tool:
        r.tool_enqueue_s = r.tool_start_s = end
        r.tool_end_s = end + (tool if tool_run is None else tool_run)
    return r


def _run(tasks: list[TaskResult]) -> RunResult:
    return RunResult(label="x", mode="load", trace={}, server={}, config={}, run={},
                     tasks=tasks)


def test_engine_calls_pair_submit_and_end_per_request():
    ev = [_ev("gpu_submit", "a", 1.0), _ev("gpu_submit", "b", 1.5), _ev("gpu_end", "a", 2.0),
          _ev("gpu_end", "c", 9.0), _ev("gpu_end", "b", 4.0)]
    assert engine_calls(ev) == {"a": 1.0, "b": 2.5}
    assert engine_call_seconds(ev) == pytest.approx(3.5)


def test_outside_engine_is_the_round_time_not_in_the_engine_and_late_tools():
    # served ids carry vLLM's suffix after the client's id; the simulator's do not
    served = "cmpl-t.r0.ab-0-1f2e3d4c"
    ev = [_ev("gpu_submit", served, 0.1), _ev("gpu_end", served, 0.6),
          _ev("gpu_submit", "t.r1", 2.05), _ev("gpu_end", "t.r1", 2.25)]
    task = TaskResult(task_id="t", arrival_s=0.0, planned_rounds=3, status="completed",
                      start_s=0.0, finish_s=3.0, rounds=[
                          _round(0, "cmpl-t.r0.ab", 0.0, 0.7, tool=1.0, tool_run=1.3),
                          _round(1, "t.r1", 2.0, 2.3, tool=0.5),
                          _round(2, "t.r2", 2.8, 3.0)])  # no engine event: not counted
    out = outside_engine(_run([task]), ev)["t"]
    assert out.gaps_s == pytest.approx((0.7 - 0.5) + (0.3 - 0.2))
    assert out.tool_overrun_s == pytest.approx(0.3)
    assert out.unmatched == 1
    assert out.total_s == pytest.approx(0.6)
    assert engine_side_mean(_run([task]), ev) == pytest.approx(3.0 - 0.6)


def test_engine_side_mean_counts_completed_tasks_only():
    unfinished = TaskResult(task_id="u", arrival_s=0.0, planned_rounds=2, status="running")
    assert math.isnan(engine_side_mean(_run([unfinished]), []))


def test_busy_time_counts_shared_time_once():
    from mars.sim.fidelity import engine_busy_seconds

    ev = [_ev("gpu_submit", "a", 0.0), _ev("gpu_submit", "b", 1.0), _ev("gpu_end", "a", 2.0),
          _ev("gpu_end", "b", 3.0), _ev("gpu_submit", "c", 5.0), _ev("gpu_end", "c", 5.5)]
    # a and b share [1, 2]: the sum counts it twice, the busy time once
    assert engine_call_seconds(ev) == pytest.approx(4.5)
    assert engine_busy_seconds(ev) == pytest.approx(3.5)
    assert engine_busy_seconds([]) == 0.0


def _spans(*calls: tuple[str, float, float]) -> list[dict]:
    """Engine events of calls ``(request id, submitted, ended)``, in time order."""
    ev = [_ev(k, rid, ts) for rid, a, b in calls for k, ts in (("gpu_submit", a), ("gpu_end", b))]
    return sorted(ev, key=lambda e: e["ts"])


def test_solo_calls_are_the_rounds_alone_in_both_runs():
    from mars.sim.fidelity import solo_calls

    # run a: rounds 0 and 1 of t overlap, u's round 0 is alone; run b: all alone
    ta = TaskResult("t", 0.0, 2)
    ta.rounds = [_round(0, "a0", 0.0, 2.0), _round(1, "a1", 1.0, 3.0)]
    ua = TaskResult("u", 0.0, 1)
    ua.rounds = [_round(0, "a2", 4.0, 5.0)]
    ev_a = _spans(("a0", 0.0, 2.0), ("a1", 1.0, 3.0), ("a2", 4.0, 5.0))
    tb = TaskResult("t", 0.0, 2)
    tb.rounds = [_round(0, "b0", 0.0, 1.0), _round(1, "b1", 2.0, 3.0)]
    ub = TaskResult("u", 0.0, 1)
    ub.rounds = [_round(0, "b2", 4.0, 4.5)]
    ev_b = _spans(("b0", 0.0, 1.0), ("b1", 2.0, 3.0), ("b2", 4.0, 4.5))
    run_a, run_b = _run([ta, ua]), _run([tb, ub])
    s = solo_calls((run_a, ev_a), (run_b, ev_b))
    assert (s.calls, s.seconds_a, s.seconds_b) == (1, pytest.approx(1.0), pytest.approx(0.5))


def test_host_model_is_read_off_a_run_and_checked():
    from mars.sim.host import HostModel, measure_host

    t = TaskResult("t", 0.0, 4)
    # round 0 (waited 5 s for admission): sent at 0, engine 5.0-6.0, client done 6.2;
    # round 1: sent 8.0, engine 8.1-9.0, done 9.1, its tool then ran 3 s for 2 planned;
    # round 2: sent 12.0, engine 12.1-13.0, done 13.1; round 3: sent 14.0, engine 14.7-15.0,
    # done 15.6 -- ways in 0.1, 0.1, 0.7 (mean 0.3, median 0.1), ways back 0.2, 0.1, 0.1, 0.6
    t.rounds = [_round(0, "r0", 0.0, 6.2), _round(1, "r1", 8.0, 9.1, tool=2.0, tool_run=3.0),
                _round(2, "r2", 12.0, 13.1), _round(3, "r3", 14.0, 15.6)]
    run = _run([t])
    run.run["start_unix"] = 100.0
    ev = [_ev("gpu_submit", "r0", 105.0), _ev("gpu_end", "r0", 106.0),
          _ev("gpu_submit", "r1", 108.1), _ev("gpu_end", "r1", 109.0),
          _ev("gpu_submit", "r2", 112.1), _ev("gpu_end", "r2", 113.0),
          _ev("gpu_submit", "r3", 114.7), _ev("gpu_end", "r3", 115.0)]
    h = measure_host(run, ev)
    # means (a task's latency sums them), the first round's admission wait left out
    assert h.request_s == pytest.approx(0.3) and h.response_s == pytest.approx(0.25)
    assert h.tool_overrun == pytest.approx(0.5) and h.active
    assert not HostModel().active
    for bad in ({"request_s": -1.0}, {"response_s": math.nan}, {"tool_overrun": math.inf},
                {"request_s": True}):
        with pytest.raises(ValueError, match="host model"):
            HostModel(**bad)
    with pytest.raises(ValueError, match="no round"):
        measure_host(run, [])
