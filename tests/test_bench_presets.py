"""``mars bench --preset``: the paper's set-ups as simulated grids with per-regime rates (no
server, no engine: configuration, the tables over per-regime rates, and bad input)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from mars.bench import BenchError, format_tables
from mars.cli.bench import config_from_args, register
from mars.bench.presets import FIVE, PRESETS, SEVEN, get_preset


def _args(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers())
    return ap.parse_args(["bench", *argv])


def test_each_preset_is_a_paper_set_up_at_multiples_of_its_saturation():
    assert set(PRESETS) == {"h100-qwen", "h100-gptoss", "h200-qwen"}
    for p in PRESETS.values():
        assert len(p.multiples) == (7 if p.name == "h200-qwen" else 5)
        for reg in p.regimes:
            rates = p.rates(reg)
            assert rates == sorted(rates) and len(set(rates)) == len(rates)
            # the onset itself is one of the points; the grid goes below and past it
            assert p.onset[reg] in rates and min(rates) < p.onset[reg] < max(rates)
    assert PRESETS["h100-gptoss"].regimes == ("S-ILR-1", "S-ILR-2", "S-ILR-3")
    assert PRESETS["h200-qwen"].multiples == SEVEN and PRESETS["h100-qwen"].multiples == FIVE


def test_preset_fills_the_grid(tmp_path):
    cfg = config_from_args(_args("--preset", "h100-qwen", "--out", str(tmp_path)))
    p = get_preset("h100-qwen")
    assert cfg.sim == p.sim and cfg.regimes == list(p.regimes) and cfg.preset == "h100-qwen"
    assert cfg.num_tasks == 100 and "mars" in cfg.policies and "mars_no_coord" in cfg.policies
    assert cfg.rates_for("ILR-4") == p.rates("ILR-4") != cfg.rates_for("ILR-1")
    assert cfg.to_json()["regime_rates"]["ILR-3"] == p.rates("ILR-3")
    # a subset of its regimes, fewer tasks, chosen policies
    cfg = config_from_args(_args("ILR-2", "--preset", "h100-qwen", "--num-tasks", "10",
                                 "--policies", "fcfs,mars", "--out", str(tmp_path)))
    assert cfg.regimes == ["ILR-2"] and cfg.num_tasks == 10 and cfg.policies == ["fcfs", "mars"]


@pytest.mark.parametrize("argv,msg", [
    (["--preset", "nope"], "unknown preset 'nope'"),
    (["--preset", "h100-qwen", "--rates", "0.1"], "do not give --rates"),
    (["S-ILR-1", "--preset", "h100-qwen"], "not S-ILR-1"),
    (["--preset", "h100-qwen", "--sim", "h200:qwen3-coder-30b-a3b"], "do not give --sim"),
    ([], "name at least one REGIME"),
])
def test_bad_preset_input(argv, msg, tmp_path):
    with pytest.raises(BenchError, match=msg):
        config_from_args(_args(*argv, "--out", str(tmp_path)))


def test_list_presets_prints_every_rate():
    r = subprocess.run([sys.executable, "-m", "mars.cli", "bench", "--list-presets"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for p in PRESETS.values():
        assert f"`{p.name}`" in r.stdout
        for reg in p.regimes:
            assert ", ".join(f"{x:g}" for x in p.rates(reg)) in r.stdout


def _pt(regime, rate, policy, mean):
    return {"regime": regime, "rate": rate, "policy": policy, "status": "done",
            "summary": {"tasks_done": 4, "tasks_total": 4, "complete": True,
                        "latency_s": {"mean": mean, "p90": mean, "p95": mean},
                        "goodput": {"2": 0.1, "3": 0.1, "5": 0.1}}}


def test_tables_follow_each_regimes_own_rates():
    doc = {"points": [_pt("ILR-1", 0.4, "fcfs", 10), _pt("ILR-1", 0.4, "mars", 5),
                      _pt("ILR-4", 0.05, "fcfs", 30), _pt("ILR-4", 0.05, "mars", 10)],
           "config": {"regimes": ["ILR-1", "ILR-4"], "rates": [0.1],
                      "regime_rates": {"ILR-1": [0.4], "ILR-4": [0.05]}, "slacks": [2, 3, 5],
                      "policies": ["fcfs", "mars"], "time_scale": 1}}
    text = format_tables(doc)
    assert "| ILR-1 | 0.4 | 2.00× (vs fcfs)" in text and "| ILR-4 | 0.05 | 3.00× (vs fcfs)" in text
    assert "| 0.1 |" not in text  # the shared list is not used for a regime with its own
