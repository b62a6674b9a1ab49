"""The multi-engine simulator's loop without vLLM: stand-in engines that accept calls and
never schedule them must end the run with a liveness error, with one engine as with several
(the loop of several engines once reset its stall timer at every sidecar tick and spun)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


class NeverSchedules:
    """A SimEngine's interface; holds every call and runs none."""

    block_size, num_blocks, max_model_len = 16, 1000, 262144
    served_model, async_scheduling, progress = "stand-in", False, 0

    def __init__(self, emulate, policy, *, clock, sink, extra_args=()) -> None:
        self.held: list[str] = []
        self.pacer_stats = SimpleNamespace(steps=0, modeled_s=0.0)
        self.scheduler = SimpleNamespace(running=[], waiting=self.held)

    @property
    def has_work(self) -> bool:
        return bool(self.held)

    def add(self, request_id, prompt, max_tokens, extra_args=None) -> None:
        self.held.append(request_id)

    def step(self):
        # a loop that does not see the stall asks forever: fail instead of hanging
        self.pacer_stats.steps += 1
        assert self.pacer_stats.steps < 1000, "the simulator keeps stepping a stalled engine"
        return []

    def counters(self):
        return {"preempted": 0}

    def kv_balanced(self):
        return True, {}

    def wake_at(self):
        return None  # no KV transfer in flight (no offloading)

    def link_stats(self):
        return None

    def close(self) -> None:
        pass


@pytest.mark.parametrize("engines", [1, 2])
def test_calls_no_engine_runs_end_the_run_with_a_liveness_error(engines, monkeypatch):
    import mars.engine.harness.sim_engine as sim_engine
    from mars.sim.runner import SimConfig, SimError, Simulation
    from mars.workloads.generator import generate

    monkeypatch.setattr(sim_engine, "SimEngine", NeverSchedules)
    sim = Simulation(SimConfig("h100-nvl", "qwen3-coder-30b-a3b", "mars", progress=False,
                               engines=engines))
    try:
        with pytest.raises(SimError, match="liveness: 2 tasks unfinished, nothing has run "
                                           "for .* holds requests it does not schedule"):
            sim.run(generate("ILR-3", num_tasks=2, rate=1.0, seed=0))
        # within a few sidecar ticks of the last call, not at some far virtual time
        assert sim.clock() - 1_700_000_000.0 < 60, sim.clock()
    finally:
        sim.close()
