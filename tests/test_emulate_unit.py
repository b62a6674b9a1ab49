"""The emulated GPU's framework-free parts: model specs read from config.json, the worker-side
request table, and the pacer (no vLLM, no engine)."""

from __future__ import annotations

import pytest

from mars.emulate.batch import EmulatedOutput, RequestTable, Scheduled
from mars.emulate.pacing import VirtualPacer, WallPacer
from mars.emulate.specs import MODELS, hf_config, model_from_hf_config
from mars.emulate.step_time import BatchEntry


# ---------------------------------------------------------------------------- specs
def test_models_are_read_from_the_shipped_config_json():
    q, o = MODELS["qwen3-coder-30b-a3b"], MODELS["gpt-oss-120b"]
    assert (q.num_layers, q.hidden, q.num_heads, q.num_kv_heads, q.head_dim) == \
        (48, 2048, 32, 4, 128)
    assert (q.num_experts, q.experts_per_token, q.expert_intermediate) == (128, 8, 768)
    assert q.sliding_layers == 0 and q.hf_id == "Qwen/Qwen3-Coder-30B-A3B-Instruct"
    assert q.max_model_len == 262144 and q.expert_weight_bytes == 2.0
    # gpt-oss: sliding window on the even layers, MXFP4 experts only
    assert o.sliding_layer_ids == tuple(range(0, 36, 2)) and o.sliding_window == 128
    assert o.full_layers == 18 and o.expert_weight_bytes == 0.53125 and o.weight_bytes == 2.0
    # the model cards' parameter counts: 30.5 B (Qwen3-Coder-30B-A3B), 117 B (gpt-oss-120b)
    assert 30.0e9 < q.total_params < 31.0e9
    assert 116e9 < o.total_params < 118e9


@pytest.mark.parametrize("bad,msg", [
    ({"mlp_only_layers": [0]}, "only some layers"),
    ({"quantization_config": {"quant_method": "gptq"}}, "not modelled"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"num_hidden_layers": None}, "lacks"),
])
def test_unpriceable_configs_are_refused(bad, msg):
    cfg = {**hf_config("qwen3-coder-30b-a3b"), **bad}
    with pytest.raises(ValueError, match=msg):
        model_from_hf_config("x", cfg)


# ---------------------------------------------------------------------------- request table
def test_prefill_chunks_sample_only_when_the_prompt_is_complete():
    t = RequestTable()
    t.add("a", prompt_tokens=100)
    batch, out = t.step([Scheduled("a", computed=0, new=64)])
    assert batch == [BatchEntry(64, 0)] and out == {"a": []}
    batch, out = t.step([Scheduled("a", computed=64, new=36)])
    assert batch == [BatchEntry(36, 64)] and len(out["a"]) == 1
    # decodes: one token each, context grows
    for k in range(3):
        batch, out = t.step([Scheduled("a", computed=100 + k, new=1)])
        assert batch == [BatchEntry(1, 100 + k)] and len(out["a"]) == 1


def test_tokens_are_ordinary_ids_and_deterministic():
    def run():
        t = RequestTable(EmulatedOutput(token_lo=20, token_hi=30, seed=3))
        t.add("r", 4)
        toks = t.step([Scheduled("r", 0, 4)])[1]["r"]
        for k in range(50):
            toks += t.step([Scheduled("r", 4 + k, 1)])[1]["r"]
        return toks

    a = run()
    assert a == run() and all(20 <= x < 30 for x in a) and len(set(a)) > 1


def test_an_unforced_call_stops_after_its_natural_length():
    t = RequestTable(EmulatedOutput(natural_tokens=5))
    t.add("s", 10, stop_id=2)
    t.add("f", 10)  # forced length (ignore_eos): never a stop token
    toks = {"s": [], "f": []}
    for k in range(8):
        out = t.step([Scheduled(r, 10 + k if k else 0, 1 if k else 10) for r in ("s", "f")])[1]
        for r in toks:
            toks[r] += out[r]
    assert toks["s"][4] == 2 and 2 not in toks["s"][:4]
    assert 2 not in toks["f"]


def test_a_resumed_request_recomputes_then_samples():
    """After preemption the scheduler restates the request's length (prompt + outputs) and
    recomputes it from zero; only the step that completes it samples."""
    t = RequestTable()
    t.add("p", 10)
    t.step([Scheduled("p", 0, 10)])            # prompt done: token 1
    t.step([Scheduled("p", 10, 1)])            # token 2 -> holds 12 tokens
    _, out = t.step([Scheduled("p", 0, 8, num_tokens=12)])
    assert out["p"] == []
    batch, out = t.step([Scheduled("p", 8, 4)])
    assert batch == [BatchEntry(4, 8)] and len(out["p"]) == 1


def test_unknown_and_finished_requests():
    t = RequestTable()
    t.add("x", 3)
    t.finish(["x", "never-seen"])
    assert len(t) == 0
    with pytest.raises(KeyError):
        t.step([Scheduled("x", 0, 3)])


# ---------------------------------------------------------------------------- pacer
class FakeTime:
    """Wall clock, engine-thread CPU clock and sleep under the test's control."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.slept: list[float] = []

    def work(self, s: float) -> None:  # the engine computes on the host
        self.wall += s
        self.cpu += s

    def idle(self, s: float) -> None:  # the engine waits (no CPU)
        self.wall += s

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.wall += s

    def pacer(self) -> WallPacer:
        return WallPacer(clock=lambda: self.wall, cpu_clock=lambda: self.cpu, sleep=self.sleep)


def test_a_step_takes_its_modeled_time():
    ft = FakeTime()
    p = ft.pacer()
    p.begin()
    ft.work(0.001)  # the executor's own bookkeeping is inside the step
    p.end(0.010)
    assert ft.wall == pytest.approx(0.010) and p.stats.late_steps == 0


def test_host_work_between_steps_hides_under_the_next_step():
    """As with async scheduling on the real card: the cadence is max(GPU, host)."""
    ft = FakeTime()
    p = ft.pacer()
    p.begin(); p.end(0.010)
    t0 = ft.wall
    ft.work(0.004)  # output processing + scheduling of the next step
    p.begin(); p.end(0.010)
    assert ft.wall - t0 == pytest.approx(0.010)
    # host work longer than the step cannot hide: the step is late by the excess
    t1 = ft.wall
    ft.work(0.015)
    p.begin(); p.end(0.010)
    assert ft.wall - t1 == pytest.approx(0.015)
    assert p.stats.late_steps == 1 and p.stats.late_s == pytest.approx(0.005)
    assert p.stats.steps == 3 and p.stats.modeled_s == pytest.approx(0.030)


def test_an_idle_engine_overlaps_nothing():
    ft = FakeTime()
    p = ft.pacer()
    p.begin(); p.end(0.010)
    ft.work(0.002)
    ft.idle(5.0)  # no requests for a while
    t0 = ft.wall
    p.begin(); p.end(0.010)
    assert ft.wall - t0 == pytest.approx(0.010)


def test_virtual_pacer_advances_by_the_model():
    moved: list[float] = []
    p = VirtualPacer(moved.append)
    p.begin(); p.end(0.25)
    assert moved == [0.25] and p.stats.modeled_s == 0.25


def test_async_steps_run_back_to_back_on_the_device():
    """Async scheduling: step k+1 is launched while step k runs; it starts when k ends, and
    the host work between launches costs no device time while it is shorter than a step."""
    ft = FakeTime()
    p = ft.pacer()
    d0 = p.launch(0.010)
    ft.work(0.002)  # schedule the next step while the first runs
    d1 = p.launch(0.010)
    assert (d0, d1) == (pytest.approx(0.010), pytest.approx(0.020))
    p.wait(d0)
    assert ft.wall == pytest.approx(0.010)
    ft.work(0.003)  # process step 0's outputs, schedule step 2 (step 1 runs)
    d2 = p.launch(0.010)
    assert d2 == pytest.approx(0.030)  # queued behind step 1, not delayed by the host
    p.wait(d1); p.wait(d2)
    assert ft.wall == pytest.approx(0.030)
    st = p.stats
    assert st.steps == 3 and st.modeled_s == pytest.approx(0.030) and st.late_steps == 0
    assert st.host_cpu_s == pytest.approx(0.005)


def test_async_device_waits_for_a_slow_host():
    ft = FakeTime()
    p = ft.pacer()
    d0 = p.launch(0.010)
    d1 = p.launch(0.010)
    p.wait(d0)
    ft.work(0.015)  # step 1 ended at 0.020; the host launches step 2 at 0.025
    d2 = p.launch(0.010)
    assert d2 == pytest.approx(0.035)
    assert p.stats.late_steps == 1 and p.stats.late_s == pytest.approx(0.005)
    p.wait(d1); p.wait(d2)
    # a launch onto an idle device (nothing outstanding) is not late, however long the gap
    ft.idle(3.0)
    d3 = p.launch(0.010)
    assert d3 == pytest.approx(ft.wall + 0.010) and p.stats.late_steps == 1


def test_virtual_pacer_async_moves_the_clock_to_each_steps_end():
    clock = [100.0]

    def advance(dt: float) -> None:
        clock[0] += dt

    p = VirtualPacer(advance, now=lambda: clock[0])
    d0 = p.launch(0.5)
    d1 = p.launch(0.25)  # launched at once, runs after step 0
    assert (d0, d1) == (100.5, 100.75) and clock[0] == 100.0
    p.wait(d0)
    assert clock[0] == 100.5
    p.wait(d1)
    assert clock[0] == 100.75 and p.read == 2
    clock[0] = 200.0  # an idle spell: the next step starts when launched
    assert p.launch(0.1) == pytest.approx(200.1)


# ---------------------------------------------------------------------------- virtual tool cores
def test_virtual_tool_cores_queue_without_burning_cpu():
    """Four CPU-bound tools of 0.2 s on two virtual cores: two wait for a slot (at least
    until the first two finish), and no worker process exists."""
    import asyncio
    import time

    from mars.workloads.toolpool import ToolPool

    async def main():
        async with ToolPool(workers=2, burn_mode="sleep") as pool:
            assert pool._pool is None and pool.cores == []
            cpu0 = time.process_time()
            timings = await asyncio.gather(*(pool.run(0.2, True) for _ in range(4)))
            return timings, time.process_time() - cpu0

    timings, cpu = asyncio.run(main())
    waits = sorted(t.wait_s for t in timings)
    assert waits[:2] == [pytest.approx(0, abs=0.05)] * 2
    assert min(waits[2:]) >= 0.19
    assert all(t.end - t.start >= 0.2 for t in timings) and cpu < 0.15
    with pytest.raises(ValueError, match="not pinned"):
        ToolPool(cores=[0], burn_mode="sleep")
