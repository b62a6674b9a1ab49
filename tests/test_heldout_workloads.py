"""The held-out workloads (experiments/heldout_workloads.py): valid traces of the shapes the
docs describe, so the table in docs/results.md is made from what it says it is made from."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from mars.workloads.tools import is_cpu_bound
from mars.workloads.trace import prompt_lengths, read_trace, validate_trace

_PATH = Path(__file__).resolve().parents[1] / "experiments" / "heldout_workloads.py"
_spec = importlib.util.spec_from_file_location("heldout_workloads", _PATH)
heldout = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = heldout  # dataclasses look their module up there
_spec.loader.exec_module(heldout)


def test_shaped_traces_are_valid_and_have_their_shape():
    for name, shape in heldout.SHAPES.items():
        trace = heldout.shaped_trace(name, 60, 0.1, seed=0)
        validate_trace(trace)
        assert len(trace.tasks) == 60 and trace.header.params["held_out"]
        for t in trace.tasks:
            assert t.prefix_tokens == shape.prefix
            assert max(p + r.output_tokens for p, r in zip(prompt_lengths(t), t.rounds)) \
                <= shape.context_limit
            for r in t.rounds[:-1]:
                assert r.tool in (shape.cpu_tool, shape.light_tool)
    rounds = lambda n: np.mean([len(t.rounds) for t in heldout.shaped_trace(n, 60, 0.1, 0).tasks])
    assert 35 <= rounds("swe-long") <= 65 and rounds("short") < 10
    heavy = heldout.shaped_trace("tool-heavy", 30, 0.1, seed=1)
    assert all(is_cpu_bound(r.tool) and r.tool_duration_s >= 1
               for t in heavy.tasks for r in t.rounds[:-1])
    # seeded: the same trace twice, another with another seed
    assert heldout.shaped_trace("short", 10, 1.0, 3) == heldout.shaped_trace("short", 10, 1.0, 3)
    assert heldout.shaped_trace("short", 10, 1.0, 3) != heldout.shaped_trace("short", 10, 1.0, 4)


def test_bursts_arrive_together_with_the_generators_tasks():
    trace = heldout.burst_trace(48, 0.1, seed=0)
    validate_trace(trace)
    arr = [t.arrival_s for t in trace.tasks]
    # three bursts of 16, each within its spread; the gaps between them are the bursts' own
    for b in range(3):
        group = arr[16 * b:16 * (b + 1)]
        assert max(group) - min(group) <= heldout.BURST_SPREAD_S
    assert arr[16] - arr[15] > heldout.BURST_SPREAD_S or arr[32] - arr[31] > heldout.BURST_SPREAD_S
    assert all(t.task_id.startswith("burst-ILR-3-") for t in trace.tasks)


def test_the_command_writes_readable_traces(tmp_path, capsys):
    assert heldout.main(["--out", str(tmp_path), "--num-tasks", "8", "short:0.5,1",
                         "burst:0.2"]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["burst-rate-0.2.jsonl", "short-rate-0.5.jsonl", "short-rate-1.jsonl"]
    assert len(read_trace(tmp_path / "short-rate-1.jsonl").tasks) == 8
    assert "rounds" in capsys.readouterr().out
