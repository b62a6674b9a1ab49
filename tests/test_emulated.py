"""``mars-vllm serve --emulate GPU:MODEL``: the real vLLM engine (scheduler, KV cache manager,
API server) on an EMULATED GPU -- the target model's KV layout, the card's KV capacity and the
step-time model's step times, no weights.

One server with an inflated per-step overhead (every step >= 40 ms, so the pacing check does not
depend on how busy this machine's cores are) serves the chat, streaming, capacity and pacing
checks; the paper-scale replay runs the shipped profile unchanged, under mars (fcfs's: the
fidelity test of tests/test_sim.py).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

from mars.protocol.sse import iter_sse_lines

from tests.conftest import read_events, wait_for_events

pytestmark = pytest.mark.engine

GPU, MODEL = "h100-nvl", "qwen3-coder-30b-a3b"
SERVED = "Qwen/Qwen3-Coder-30B-A3B-Instruct"
SLOW = {"step_overhead_s": 0.04}


def _server(*args: str):
    pytest.importorskip("vllm")
    from mars.launch import ServerProcess

    return ServerProcess(args=["--emulate", f"{GPU}:{MODEL}", *args]).start()


@pytest.fixture(scope="module")
def emu():
    srv = _server("--no-sidecar", "--emulate-config", json.dumps({"coefficients": SLOW}))
    try:
        yield srv
    finally:
        srv.stop()


def test_models_lists_the_target_model_and_its_context(emu):
    models = httpx.get(emu.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [SERVED]
    assert models[0]["max_model_len"] == 262144
    assert "EMULATED GPU" in emu.tail(400)
    # as vLLM on the card: the async scheduler class (issue #32)
    assert "async scheduling" in emu.tail(400)


def test_chat_completion_and_stream(emu):
    r = httpx.post(emu.url + "/v1/chat/completions", timeout=60, json={
        "model": SERVED, "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    chunks = []
    with httpx.stream("POST", emu.url + "/v1/completions", timeout=60, json={
            "model": SERVED, "prompt": "def main():", "max_tokens": 5, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as s:
        assert s.status_code == 200
        for line in iter_sse_lines(s.iter_bytes()):
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    usage = [json.loads(c)["usage"] for c in chunks[:-1] if json.loads(c).get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 5
    # a call that does not force its length ends with the emulated model's stop token
    r = httpx.post(emu.url + "/v1/completions", timeout=120, json={
        "model": SERVED, "prompt": [5, 6, 7], "max_tokens": 1000})
    from mars.emulate.batch import NATURAL_TOKENS

    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == NATURAL_TOKENS


def test_kv_pool_is_what_the_card_leaves(emu):
    """Blocks = (memory x utilization - activation reserve - weights) / KV per block, the
    figure computed here from the specs, not read from the executor."""
    from mars.emulate.specs import get_gpu, get_model

    m, g = get_model(MODEL), get_gpu(GPU)
    budget = (g.memory_gib * 0.92 - 2.0) * 2**30 - m.weight_memory_bytes  # vLLM's 0.92 default
    per_block = 16 * m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2  # bf16 K and V
    httpx.post(emu.url + "/v1/completions", timeout=60,
               json={"model": SERVED, "prompt": [1, 2, 3], "max_tokens": 1})
    snaps = wait_for_events(emu.events_file, lambda e: e["kind"] == "kv_snapshot")
    # vLLM's block pool keeps one of its blocks as the null block
    assert snaps[-1]["total_blocks"] + 1 == int(budget // per_block)
    assert f"{int(budget // per_block) * 16:,} tokens" in emu.tail(400)


def test_step_times_follow_the_model(emu):
    """One request alone: the time between its first token and its end, read from the
    engine's events, is the step-time model's sum over its decode steps (within 5 %), plus
    whatever the pacer itself counted as late (host work that outlasted a step: a busy
    machine's stalls, which the wall clock cannot take back)."""
    from mars.emulate.specs import get_gpu, get_model
    from mars.emulate.step_time import StepCoefficients, StepTimeModel

    def late_s(pred) -> float:
        """The pacer's running total of lateness, at the last snapshot matching ``pred``."""
        snaps = wait_for_events(emu.events_file, lambda e: e["kind"] == "kv_snapshot"
                                and "emulated" in e and pred(e["ts"]), 60)
        assert snaps
        return snaps[-1]["emulated"]["late_s"]

    prompt, out = 3000, 30
    r = httpx.post(emu.url + "/v1/completions", timeout=120, json={
        "model": SERVED, "prompt": [100 + k % 800 for k in range(prompt)], "max_tokens": out,
        "ignore_eos": True, "vllm_xargs": {"job_id": "pace"}})
    assert r.status_code == 200, r.text

    def ev(kind, sid="pace"):
        evs = wait_for_events(emu.events_file,
                              lambda e: e["kind"] == kind and e.get("session_id") == sid, 60)
        return evs[-1]["ts"]

    first, end = ev("gpu_1st_token"), ev("gpu_end")
    # a snapshot is taken as a step is scheduled, and once more as the engine goes idle: one
    # more call (a probe) makes one that shows the lateness of the request's last steps
    assert httpx.post(emu.url + "/v1/completions", timeout=120, json={
        "model": SERVED, "prompt": [5, 6, 7], "max_tokens": 1,
        "vllm_xargs": {"job_id": "pace-probe"}}).status_code == 200
    ev("gpu_end", "pace-probe")
    late = late_s(lambda ts: ts > end) - late_s(lambda ts: ts <= first)
    measured = end - first
    stm = StepTimeModel(get_model(MODEL), get_gpu(GPU), StepCoefficients(**SLOW))
    # decode j (j = 1 .. out-1) computes the token sampled before it over prompt + j - 1
    modeled = sum(stm.step_time([(1, prompt + j - 1)]) for j in range(1, out))
    assert modeled * 0.95 < measured < modeled * 1.05 + late, (measured, modeled, late)
    snap = [e for e in read_events(emu.events_file) if e["kind"] == "kv_snapshot"][-1]
    assert snap["emulated"]["steps"] >= out and snap["emulated"]["modeled_s"] > modeled


@pytest.mark.parametrize("policy", ["mars"])
def test_paper_scale_replay_completes(policy, tmp_path):
    """Two ILR-1 tasks at full token scale (prompts of 4K-40K tokens) through the sidecar,
    the scheduler of ``policy`` and the emulated executor; tool times compressed 20x. fcfs's
    paper-scale replay is the served run of tests/test_sim.py's fidelity test (the same
    checks, on the same emulated stack: one server start fewer)."""
    import subprocess
    import sys

    from mars.launch import ServerProcess

    srv = ServerProcess(args=["--emulate", f"{GPU}:{MODEL}", "--policy", policy]).start()
    try:
        out = tmp_path / "run"
        cmd = [os.path.join(os.path.dirname(sys.executable), "mars"), "replay", "ILR-1",
               "--url", srv.url, "--num-tasks", "2", "--time-scale", "20", "--ideal", "skip",
               "--out", str(out), "--no-plots", "--no-progress",
               "--events-file", srv.events_file]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        # on failure: the replay's report and each failed task's error, then the server's log
        assert done.returncode == 0, (done.stdout[-2000:] + done.stderr[-3000:]
                                      + "\nserver log:\n" + srv.tail(60))
        res = json.loads((out / "results.json").read_text())
        assert [t["status"] for t in res["tasks"]] == ["completed"] * 2, res["tasks"]
        rounds = [r for t in res["tasks"] for r in t["rounds"]]
        assert max(r["prompt_tokens"] for r in rounds) > 10_000
        assert all(r["output_tokens"] == r["planned_output_tokens"] for r in rounds)
        snap = [e for e in read_events(srv.events_file) if e["kind"] == "kv_snapshot"][-1]
        assert snap["emulated"]["steps"] > 100
    finally:
        srv.stop()
