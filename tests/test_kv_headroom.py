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

    def call(kind: str, ts: float, sid: str, rid: str, **kw) -> dict:
        return {"kind": kind, "ts": ts, "session_id": sid, "request_id": rid, **kw}

    ev = [
        {"kind": "scheduler_start", "ts": 0.0, "total_blocks": 99, "block_size": 16},
        {"kind": "kv_snapshot", "ts": 0.0, "total_blocks": 99, "free_blocks": 99,
         "running": 0},
        # b: admitted at once, estimated at 5 blocks; a call of 10 blocks from 1 to 2 s, then
        # one of 6 blocks (its context stays at 10) beside a side call, 2.5 to 3.5 s
        {"kind": "session_admit", "ts": 0.0, "session_id": "b", "queued_s": 0.0,
         "est_blocks": 5},
        # c: one call of 1 block; its gpu_end comes after its session_end
        {"kind": "session_admit", "ts": 0.5, "session_id": "c", "queued_s": 0.0,
         "est_blocks": 1},
        call("gpu_submit", 0.5, "c", "c.r0", prompt_tokens=16),
        call("gpu_submit", 1.0, "b", "b.r0", prompt_tokens=160),
        {"kind": "window_update", "ts": 1.0, "queued": 1, "budget": 4, "admitted": 1},
        {"kind": "session_end", "ts": 1.5, "session_id": "c"},
        # queued from 1 to 5 s: free 99 of 99 for 1 s, then 33 of 99 for 3 s
        {"kind": "kv_snapshot", "ts": 2.0, "total_blocks": 99, "free_blocks": 33,
         "running": 2},
        call("gpu_end", 2.0, "b", "b.r0"),
        call("gpu_end", 2.0, "c", "c.r0"),
        call("gpu_submit", 2.5, "b", "b.r1", prompt_tokens=96),
        call("gpu_submit", 2.5, "b", "b.side", prompt_tokens=16),
        call("gpu_end", 3.0, "b", "b.side"),
        call("gpu_end", 3.0, "b", "b.side"),  # (twice: b.r1 is still in the engine)
        call("gpu_end", 3.5, "b", "b.r1"),
        {"kind": "session_end", "ts": 4.0, "session_id": "b"},
        # a: waited 4 s at the door, estimated at 20 blocks; a call of 31 blocks (481 tokens)
        # from 5.5 to 6.5 s; no session_end: it counts to the log's last event, at 7 s
        {"kind": "session_admit", "ts": 5.0, "session_id": "a", "queued_s": 4.0,
         "est_blocks": 20},
        {"kind": "window_update", "ts": 5.0, "queued": 0, "budget": 4, "admitted": 2},
        call("gpu_submit", 5.5, "a", "a.r0", prompt_tokens=481),
        call("gpu_end", 6.5, "a", "a.r0"),
        # not queued: not counted
        {"kind": "kv_snapshot", "ts": 7.0, "total_blocks": 99, "free_blocks": 0,
         "running": 9},
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
    # in the engine / admitted, seconds: b 2 of 4, a 1 of 2 (to the log's end), c 1 of 1
    assert x["engine_share"] == pytest.approx(4 / 7)
    # block-seconds: b 10 x 2 of 5 x 1 + 10 x 3; a 31 x 1 of 20 x 0.5 + 31 x 1.5; c 1 of 1
    assert x["engine_share_blocks"] == pytest.approx((20 + 31 + 1) / (35 + 56.5 + 1))
    assert x["door_wait"] == pytest.approx(4 / 3)
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
    (["ILR-3", "--rate", "0.2", "--multipliers", "0", "--out", "x"], "(0, 1000]"),
    (["ILR-3", "--rate", "0.2", "--multipliers", "nan", "--out", "x"], "(0, 1000]"),
    (["ILR-3", "--rate", "0", "--out", "x"], "--rate must be"),
    (["--trace", "t.jsonl", "--rate", "0.2", "--out", "x"], "a trace has its own"),
    (["ILR-3", "--rate", "0.2", "--jobs", "0", "--out", "x"], "--jobs must be"),
])
def test_bad_arguments_say_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        kv_headroom.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
