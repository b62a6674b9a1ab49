"""``mars bench --seeds``: one bench per seed, pooled into one comparison (mars.bench.seeds)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from mars.bench.seeds import combine, seed_table
from mars.bench.report import compare


def _point(policy: str, lat: dict[str, float | None], goodput: float, complete: bool = True,
           regime: str = "ILR-1", rate: float = 0.5) -> dict:
    done = [v for v in lat.values() if v is not None]
    return {"regime": regime, "rate": rate, "policy": policy, "status": "done",
            "dir": f"{policy}", "returncode": 0, "wall_s": 1.0, "reused": False,
            "summary": {"tasks_total": len(lat), "tasks_done": len(done),
                        "tasks_completed": len(done), "complete": complete,
                        "latency_s": {"mean": float(np.mean(done))},
                        "goodput": {"3": goodput}, "goodput_good": {"3": 1},
                        "goodput_evaluated": len(done), "ttft_mean_s": 1.0,
                        "task_latency_s": lat}}


def _doc(seed: int, points: list[dict]) -> dict:
    return {"schema": "mars.bench", "version": 1,
            "config": {"regimes": ["ILR-1"], "rates": [0.5], "policies": ["fcfs", "mars"],
                       "seed": seed, "num_tasks": 12, "slacks": [3]},
            "run": {"wall_s": 10.0, "interrupted": False}, "points": points}


def _lat(base: float, n: int = 12, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    return {f"t{i}": float(base * (1 + rng.random())) for i in range(n)}


def test_points_are_pooled_over_the_seeds_tasks():
    d0 = _doc(0, [_point("fcfs", _lat(10, seed=1), 0.2), _point("mars", _lat(5, seed=2), 0.4)])
    d1 = _doc(1, [_point("fcfs", _lat(12, seed=3), 0.1), _point("mars", _lat(11, seed=4), 0.2)])
    doc = combine([d0, d1], [0, 1])
    assert doc["config"]["seeds"] == [0, 1] and doc["config"]["seed"] is None
    pts = {p["policy"]: p for p in doc["points"]}
    m = pts["mars"]["summary"]
    assert m["tasks_total"] == 24 and m["complete"] and len(m["task_latency_s"]) == 24
    both = list(d0["points"][1]["summary"]["task_latency_s"].values()) + \
        list(d1["points"][1]["summary"]["task_latency_s"].values())
    assert m["latency_s"]["mean"] == pytest.approx(np.mean(both))
    assert m["latency_s"]["p90"] == pytest.approx(np.percentile(both, 90))
    assert m["goodput"]["3"] == pytest.approx(0.3) and m["goodput_good"]["3"] == 2
    # the comparison pools (seed, task) pairs: the interval is over 24 pairs
    cmp = compare(doc)
    row = cmp["vs_baseline"][0]["metrics"]["mean"]
    assert row["ratio"] == pytest.approx(pts["fcfs"]["summary"]["latency_s"]["mean"]
                                         / m["latency_s"]["mean"])
    assert row["ci"] and row["ci"][0] <= row["ratio"] <= row["ci"][1]
    table = seed_table([d0, d1], [0, 1], cmp)
    r0 = compare(d0)["vs_baseline"][0]["metrics"]["mean"]["ratio"]
    r1 = compare(d1)["vs_baseline"][0]["metrics"]["mean"]["ratio"]
    assert f"{r0:.2f}×" in table and f"{r1:.2f}×" in table and "| seed 0 | seed 1 | pooled |" \
        in table


def test_an_incomplete_seed_makes_the_pooled_point_incomplete_and_missing_points_drop():
    lat = _lat(5)
    lat["t3"] = None
    d0 = _doc(0, [_point("fcfs", _lat(10), 0.2), _point("mars", lat, 0.4, complete=False)])
    d1 = _doc(1, [_point("fcfs", _lat(12), 0.1), _point("mars", _lat(11), 0.2),
                  _point("mars", _lat(11), 0.2, rate=0.9)])
    doc = combine([d0, d1], [0, 1])
    assert len(doc["points"]) == 2  # rate 0.9 ran for seed 1 only
    m = next(p for p in doc["points"] if p["policy"] == "mars")["summary"]
    assert not m["complete"] and m["tasks_done"] == 23 and m["tasks_total"] == 24


def test_benches_that_differ_in_more_than_the_seed_are_refused():
    d0 = _doc(0, [_point("fcfs", _lat(10), 0.2)])
    d1 = _doc(1, [_point("fcfs", _lat(10), 0.2)])
    d1["config"]["num_tasks"] = 20
    with pytest.raises(ValueError, match="num_tasks"):
        combine([d0, d1], [0, 1])
    with pytest.raises(ValueError, match="repeat"):
        combine([d0, d0], [0, 0])


@pytest.mark.parametrize("text,seeds", [("0,1,2", [0, 1, 2]), ("3-5", [3, 4, 5]), ("7", [7])])
def test_the_seed_list_parses(text, seeds):
    from mars.cli.types import seeds as parse

    assert parse(text) == seeds


@pytest.mark.parametrize("text", ["", "a", "1,1", "0-1,1", "0,3-1"])
def test_a_bad_seed_list_is_a_usage_error(text):
    import argparse

    from mars.cli.types import seeds as parse

    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


def test_the_pooled_interval_carries_the_seed_to_seed_spread():
    """Two seeds where MARS wins by 2x in one and loses by 2x in the other: the pooled tasks
    alone would give a narrow interval around the mixture; the two-stage bootstrap spans
    both seeds' ratios."""
    from mars.bench.stats import BootstrapConfig, clustered_ratio_interval, ratio_interval

    rng = np.random.default_rng(0)
    base = rng.uniform(9, 11, 200)
    mars = np.concatenate([base[:100] / 2, base[100:] * 2])
    seeds = ["0"] * 100 + ["1"] * 100
    flat = ratio_interval(mars, base, "mean", BootstrapConfig())
    two = clustered_ratio_interval(mars, base, seeds, "mean", BootstrapConfig())
    assert flat[1] - flat[0] < 0.3
    assert two[0] < 0.6 and two[1] > 1.9  # from about "all like seed 1" to "all like seed 0"
    assert clustered_ratio_interval(mars, base, ["0"] * 200, "mean") == ratio_interval(
        mars, base, "mean")


@pytest.mark.engine
def test_bench_with_several_seeds_runs_each_and_pools_them(tmp_path):
    """``mars bench --sim ... --seeds 0,1``: a bench per seed in OUT/seed-N (other traces), the
    pooled comparison in OUT; --resume reuses every seed's points."""
    out = tmp_path / "bench"
    args = [sys.executable, "-m", "mars.cli", "bench", "ILR-1", "--sim",
            "h100-nvl:qwen3-coder-30b-a3b", "--rates", "0.5", "--policies", "fcfs,mars",
            "--num-tasks", "3", "--max-rounds", "3", "--jobs", "2", "--seeds", "0,1",
            "--ideal-cache",
            str(tmp_path / "ideal"), "--no-run-plots", "--out", str(out)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    seeds = [json.loads((out / f"seed-{s}" / "bench.json").read_text()) for s in (0, 1)]
    assert [d["config"]["seed"] for d in seeds] == [0, 1]
    traces = [open(next(iter(d["traces"].values()))).read() for d in seeds]
    assert traces[0] != traces[1]
    doc = json.loads((out / "bench.json").read_text())
    assert doc["config"]["seeds"] == [0, 1] and len(doc["points"]) == 2
    for p in doc["points"]:
        s = p["summary"]
        assert s["tasks_total"] == 6 and s["complete"], s
        assert sorted(k.split("/")[0] for k in s["task_latency_s"]) == ["0"] * 3 + ["1"] * 3
    report = (out / "report.md").read_text()
    assert "MARS's mean-latency ratio per seed" in report and "| seed 0 | seed 1 |" in report
    r2 = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0 and r2.stderr.count("2 points (2 reused)") == 2, r2.stderr[-2000:]
    # without --resume an existing bench is refused before any seed runs
    r3 = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r3.returncode == 1 and "already holds a bench" in r3.stderr, r3.stderr[-2000:]
    assert "seed 0 (1 of 2)" not in r3.stderr
