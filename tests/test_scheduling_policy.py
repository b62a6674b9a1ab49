"""vLLM's own ``--scheduling-policy priority`` under mars: served by request priority with
``--policy fcfs`` (stock vLLM plus our event hooks), refused at start-up with a clear message
by every other policy (their schedulers order the waiting queue themselves, which vLLM's
priority heap does not allow: the EngineCore used to die at its first request)."""

from __future__ import annotations

import pytest

from mars.policy.registry import POLICY_NAMES

pytest.importorskip("vllm")


@pytest.mark.parametrize("policy", [p for p in POLICY_NAMES if p != "fcfs"])
def test_every_reordering_policy_refuses_priority_scheduling_at_start(policy):
    from mars.engine.harness.sim_engine import engine_args_for

    with pytest.raises(SystemExit, match=r"--scheduling-policy priority is not supported "
                                         rf"with --policy {policy}.*--policy fcfs"):
        engine_args_for(None, policy, ["--scheduling-policy", "priority"])
    # without it, the same policy starts
    assert engine_args_for(None, policy, []).policy == policy


def test_fcfs_serves_by_request_priority():
    """The mars scheduler class with --policy fcfs on vLLM's priority queue: lower priority
    values first, every request completes, the event hooks run."""
    from mars.engine.harness.offline import OfflineEngine

    eng = OfflineEngine("fcfs", num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64,
                        scheduling_policy="priority")
    try:
        assert type(eng.sched.waiting).__name__ == "PriorityRequestQueue"
        order = []
        for rid, prio in (("late", 5), ("urgent", 0), ("middle", 2)):
            eng.add(rid, [100 + i for i in range(40)], 4, priority=prio, job_id=rid,
                    last_round=True)
        while eng.live:
            before = set(eng.live)
            eng.step()
            order += [r for r in before if r not in eng.live]
        assert order == ["urgent", "middle", "late"]
        assert eng.sched.mars_counters["finished"] == 3
    finally:
        eng.close()
