"""Latency percentiles, throughput and Dynamic SLO-Aware Goodput (paper Eq. 1-2)."""

from __future__ import annotations

import math

import pytest

from mars.workloads.goodput import (
    DEFAULT_SLACKS,
    TaskOutcome,
    Window,
    attach_ideal,
    completed_in,
    default_window,
    evaluate,
    goodput,
    goodput_report,
    meets_slo,
    summarize,
    throughput,
)


def test_summarize():
    s = summarize(range(1, 101))
    assert s.count == 100 and s.mean == 50.5 and s.min == 1 and s.max == 100
    assert s.p50 == pytest.approx(50.5)
    assert s.p90 == pytest.approx(90.1)
    assert s.p95 == pytest.approx(95.05)
    assert s.p99 == pytest.approx(99.01)
    one = summarize([3.0])
    assert one.p50 == one.p99 == one.mean == 3.0
    empty = summarize([])
    assert empty.count == 0 and math.isnan(empty.mean) and math.isnan(empty.p99)
    with pytest.raises(ValueError):
        summarize([1.0, float("nan")])
    assert set(s.to_dict()) == {"count", "mean", "p50", "p90", "p95", "p99", "min", "max"}


def test_throughput():
    assert throughput(30, 60.0) == 0.5
    with pytest.raises(ValueError):
        throughput(1, 0.0)


def _outcomes() -> list[TaskOutcome]:
    return [
        # latency / ideal = 2.0: meets slack 2 exactly (the bound is inclusive)
        TaskOutcome("a", 0.0, 10.0, ideal_s=5.0, output_tokens=100),
        # 2.4: meets slack 3 and 5
        TaskOutcome("b", 5.0, 17.0, ideal_s=5.0, output_tokens=50),
        # 30 / 7 = 4.29: meets slack 5 only
        TaskOutcome("c", 10.0, 40.0, ideal_s=7.0, output_tokens=10),
        # 6: meets none
        TaskOutcome("d", 20.0, 80.0, ideal_s=10.0, output_tokens=40),
        # completed but no ideal time: excluded, counted in missing_ideal
        TaskOutcome("e", 30.0, 50.0, ideal_s=None, output_tokens=5),
        # never completed
        TaskOutcome("f", 40.0, None, ideal_s=3.0),
    ]


def test_goodput_hand_made():
    outs = _outcomes()
    w = Window(0.0, 100.0)
    expected = {2.0: 1, 3.0: 2, 5.0: 3}
    for slack, good in expected.items():
        g = goodput(outs, slack, w)
        assert g.good == good
        assert g.goodput == pytest.approx(good / 100.0)
        assert (g.completed, g.evaluated, g.missing_ideal) == (5, 4, 1)
        assert g.attainment == pytest.approx(good / 4)
        assert g.window_s == 100.0
    rep = goodput_report(outs, window=w)
    assert tuple(rep) == DEFAULT_SLACKS == (2.0, 3.0, 5.0)
    assert [rep[s].good for s in DEFAULT_SLACKS] == [1, 2, 3]


def test_goodput_window_membership():
    outs = _outcomes()
    # only tasks finishing within [0, 45] count: a, b, c (d finishes at 80, e at 50)
    g = goodput(outs, 5.0, Window(0.0, 45.0))
    assert (g.completed, g.good) == (3, 3)
    assert g.goodput == pytest.approx(3 / 45)
    # a window that starts later drops earlier completions, keeps ones that arrived before it
    late = completed_in(outs, Window(15.0, 60.0))
    assert [o.task_id for o in late] == ["b", "c", "e"]
    # default window: first arrival to last completion
    w = default_window(outs)
    assert (w.start_s, w.end_s) == (0.0, 80.0)
    assert goodput(outs, 3.0).goodput == pytest.approx(2 / 80)


def test_unusable_ideal_times_are_excluded_and_counted():
    outs = [
        TaskOutcome("a", 0.0, 4.0, ideal_s=2.0),
        TaskOutcome("b", 0.0, 4.0, ideal_s=0.0),
        TaskOutcome("c", 0.0, 4.0, ideal_s=float("nan")),
        TaskOutcome("d", 0.0, 4.0, ideal_s=float("inf")),
        TaskOutcome("e", 0.0, 4.0, ideal_s=-1.0),
    ]
    g = goodput(outs, 2.0, Window(0.0, 10.0))
    assert (g.good, g.evaluated, g.missing_ideal, g.completed) == (1, 1, 4, 5)
    none = goodput([TaskOutcome("x", 0.0, 1.0)], 2.0, Window(0.0, 10.0))
    assert none.goodput == 0.0 and none.missing_ideal == 1 and math.isnan(none.attainment)


def test_attach_ideal():
    outs = [TaskOutcome("a", 0.0, 9.0), TaskOutcome("b", 0.0, 9.0, ideal_s=1.0)]
    withi = attach_ideal(outs, {"a": 3.0})
    assert [o.ideal_s for o in withi] == [3.0, 1.0]
    assert meets_slo(withi[0], 3.0) and not meets_slo(withi[0], 2.9)
    with pytest.raises(ValueError):
        meets_slo(outs[0], 2.0)


def test_errors():
    with pytest.raises(ValueError, match="slack"):
        goodput(_outcomes(), 0.0, Window(0, 1))
    with pytest.raises(ValueError, match="no completed tasks"):
        goodput([TaskOutcome("x", 0.0, None)], 2.0)
    with pytest.raises(ValueError, match="finishes before it arrives"):
        _ = TaskOutcome("x", 5.0, 4.0).latency_s


def test_evaluate():
    m = evaluate(_outcomes(), window=Window(0.0, 100.0))
    assert m.completed == 5 and m.incomplete == 1
    assert m.latency.count == 5
    assert m.latency.mean == pytest.approx((10 + 12 + 30 + 60 + 20) / 5)
    assert m.latency.p50 == 20.0
    assert m.request_throughput == pytest.approx(0.05)
    assert m.output_token_throughput == pytest.approx(205 / 100)
    assert m.goodput[5.0].good == 3
    d = m.to_dict()
    assert d["goodput"]["2.0"]["good"] == 1 and d["latency_s"]["count"] == 5
