"""experiments/kv_headroom.py: what it reads from a run (the pool, the door's state while
sessions wait, the sessions' engine share) and its argument errors. The simulations it
starts are ``mars sim run`` with vLLM's ``--num-gpu-blocks-override``, covered where the
simulator is; here the arithmetic the report rests on, on a run written by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "experiments" / "kv_headroom.py"
_spec = importlib.util.spec_from_file_location("kv_headroom", _PATH)
kv_headroom = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv_headroom)


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "x1"
    (run / "mars").mkdir(parents=True)
    ev = [
        {"kind": "scheduler_start", "ts": 0.0, "total_blocks": 99, "block_size": 16},
        {"kind": "kv_snapshot", "ts": 0.0, "total_blocks": 99, "free_blocks": 99,
         "running": 0},
        {"kind": "window_update", "ts": 1.0, "queued": 1, "budget": 4, "admitted": 1},
        # queued from 1 to 5 s: free 99 of 99 for 1 s, then 33 of 99 for 3 s
        {"kind": "kv_snapshot", "ts": 2.0, "total_blocks": 99, "free_blocks": 33,
         "running": 2},
        {"kind": "session_admit", "ts": 5.0, "session_id": "a", "queued_s": 1.0},
        {"kind": "window_update", "ts": 5.0, "queued": 0, "budget": 4, "admitted": 2},
        {"kind": "session_admit", "ts": 6.0, "session_id": "b", "queued_s": 0.0},
        # not queued: not counted
        {"kind": "kv_snapshot", "ts": 9.0, "total_blocks": 99, "free_blocks": 0,
         "running": 9},
    ]
    (run / "mars" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    rounds = [  # 1 s at the door, 5 s in the engine, 2 s in a tool
        {"index": 0, "submit_s": 0.0, "end_s": 4.0, "tool_enqueue_s": 4.0, "tool_end_s": 6.0},
        {"index": 1, "submit_s": 6.0, "end_s": 8.0, "tool_enqueue_s": None,
         "tool_end_s": None}]
    results = {"summary": {"latency_s": {"mean": 8.0, "p90": 8.0}},
               "tasks": [{"task_id": "a", "status": "completed", "rounds": rounds},
                         {"task_id": "b", "status": "failed", "rounds": []}]}
    (run / "mars" / "results.json").write_text(json.dumps(results))
    return run


def test_reads_the_pool_and_the_door(tmp_path):
    run = _run(tmp_path)
    # vLLM's pool counts the null block the engine does not report
    assert kv_headroom.pool_blocks(run) == 100
    x = kv_headroom.read(run)
    assert (x["done"], x["tasks"]) == (1, 2)
    assert x["engine_share"] == pytest.approx(5 / 7)  # the door's second is no engine time
    assert x["door_wait"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert x["queued_s"] == pytest.approx(4.0)
    assert x["free_q"] == pytest.approx((1 * 1.0 + 3 * (33 / 99)) / 4)
    assert x["running_q"] == pytest.approx((1 * 0 + 3 * 2) / 4)
    assert x["slots_q"] == pytest.approx(3.0)  # budget 4 - admitted 1 throughout


def test_a_run_without_its_engine_start_is_an_error(tmp_path):
    run = _run(tmp_path)
    events = run / "mars" / "events.jsonl"
    events.write_text("".join(line + "\n" for line in events.read_text().splitlines()[1:]))
    with pytest.raises(SystemExit, match="no scheduler_start"):
        kv_headroom.pool_blocks(run)


@pytest.mark.parametrize("argv, message", [
    (["--out", "x"], "give a regime"),
    (["ILR-3", "--trace", "t.jsonl", "--out", "x"], "not both"),
    (["ILR-3", "--out", "x"], "needs --rate"),
    (["ILR-3", "--rate", "0.2", "--multipliers", "2,a", "--out", "x"], "numbers"),
    (["ILR-3", "--rate", "0.2", "--multipliers", "0", "--out", "x"], "> 0"),
])
def test_bad_arguments_say_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        kv_headroom.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
