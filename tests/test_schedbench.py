"""Smoke test of the scheduler benchmark harness (``experiments/bench_scheduler.py``).

Not a benchmark: a few steps at N=4 on the real vLLM scheduler (no model, no server), checking
that the harness produces timings and that the mars scheduler really ran its hooks.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _bench():
    path = Path(__file__).resolve().parents[1] / "experiments" / "bench_scheduler.py"
    spec = importlib.util.spec_from_file_location("bench_scheduler", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_scheduler"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_schedbench_smoke():
    pytest.importorskip("vllm")
    bench = _bench()
    Workload, format_tables, run = bench.Workload, bench.format_tables, bench.run

    wl = Workload(prompt_tokens=64, turn_tokens=16, min_output=2, max_output=6, job_rounds=2)
    results, drivers = run([4], steps=24, warmup=8, rounds=2, configs=("stock", "mars"),
                           workload=wl, keep_drivers=True)
    try:
        by = {r.config: r for r in results}
        assert set(by) == {"stock", "mars"}
        for r in results:
            assert r.schedule.n == 24 and r.update.n == 24
            assert r.schedule.median_us > 0 and r.schedule.mean_us > 0
            assert r.schedule_cpu.mean_us > 0 and r.update.mean_us > 0
            assert r.avg_running > 0
            assert r.finished > 0  # rounds finished and were replaced
        assert not by["stock"].counters
        mars = drivers[4]["mars"].sched
        assert type(mars).__name__ == "MarsScheduler"
        assert mars.mars_coord.active  # policy mars: ordering on
        assert mars.mars_counters["steps"] == 8 + 24
        assert mars.mars_counters["finished"] > 0
        assert all(c.key for c in mars.mars_calls.values())  # live requests are keyed
        table = format_tables(results, "cmd")
        assert "| 4 | mars |" in table and "| 4 | stock |" in table
    finally:
        for ds in drivers.values():
            for d in ds.values():
                d.close()
