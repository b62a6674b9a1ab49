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
        # b: admitted at once; a call of 10 blocks for 2 s, then a tool for 2 s
        {"kind": "session_admit", "ts": 0.0, "session_id": "b", "queued_s": 0.0},
        {"kind": "gpu_submit", "ts": 0.0, "session_id": "b", "prompt_tokens": 160},
        {"kind": "window_update", "ts": 1.0, "queued": 1, "budget": 4, "admitted": 1},
        # queued from 1 to 5 s: free 99 of 99 for 1 s, then 33 of 99 for 3 s
        {"kind": "kv_snapshot", "ts": 2.0, "total_blocks": 99, "free_blocks": 33,
         "running": 2},
        {"kind": "gpu_end", "ts": 2.0, "session_id": "b"},
        {"kind": "session_end", "ts": 4.0, "session_id": "b"},
        # a: waited 4 s at the door; a call of 31 blocks (481 tokens) for 1 s, ends 1 s later
        {"kind": "session_admit", "ts": 5.0, "session_id": "a", "queued_s": 4.0},
        {"kind": "window_update", "ts": 5.0, "queued": 0, "budget": 4, "admitted": 2},
        {"kind": "gpu_submit", "ts": 5.0, "session_id": "a", "prompt_tokens": 481},
        {"kind": "gpu_end", "ts": 6.0, "session_id": "a"},
        # not queued: not counted
        {"kind": "kv_snapshot", "ts": 6.5, "total_blocks": 99, "free_blocks": 0,
         "running": 9},
        {"kind": "session_end", "ts": 7.0, "session_id": "a"},
    ]
    (run / "mars" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    results = {"summary": {"latency_s": {"mean": 8.0, "p90": 8.0}},
               "tasks": [{"task_id": "a", "status": "completed", "rounds": []},
                         {"task_id": "b", "status": "failed", "rounds": []}]}
    (run / "mars" / "results.json").write_text(json.dumps(results))
    return run


def test_reads_the_pool_and_the_door(tmp_path):
    run = _run(tmp_path)
    # vLLM's pool counts the null block the engine does not report
    assert kv_headroom.pool_blocks(run) == 100
    x = kv_headroom.read(run)
    assert (x["done"], x["tasks"]) == (1, 2)
    # b: 2 s of 4 in the engine at 10 blocks; a: 1 s of 2 at 31 blocks
    assert x["engine_share"] == pytest.approx(3 / 6)
    assert x["engine_share_blocks"] == pytest.approx((2 * 10 + 1 * 31) / (4 * 10 + 2 * 31))
    assert x["door_wait"] == pytest.approx(2.0)  # (0 + 4) / 2
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
