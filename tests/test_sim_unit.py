"""The simulator's own pieces, without vLLM: timeline, virtual tool cores, the admission
core's virtual-time shell, and the task script the replay and the simulator share."""

from __future__ import annotations

import pytest

from mars.sim.clock import Timeline, VirtualClock
from mars.sim.tools import VirtualCores


def test_timeline_runs_due_callbacks_in_time_then_scheduling_order():
    tl, seen = Timeline(), []
    tl.at(2.0, lambda t: seen.append(("b", t)))
    tl.at(1.0, lambda t: seen.append(("a", t)))
    tl.at(2.0, lambda t: seen.append(("c", t)))
    # a callback may schedule more work that is already due: it runs in the same pass
    tl.at(1.5, lambda t: tl.at(t, lambda u: seen.append(("chained", u))))
    assert tl.run_due(1.9) == 3 and seen == [("a", 1.0), ("chained", 1.5)]
    assert tl.next_due() == 2.0
    tl.run_due(5.0)
    assert [s[0] for s in seen] == ["a", "chained", "b", "c"] and tl.next_due() is None


def test_virtual_clock_never_runs_backwards():
    c = VirtualClock(10.0)
    c.advance(0.5)
    c.advance_to(3.0)  # in the past: no effect
    assert c() == 10.5
    with pytest.raises(ValueError):
        c.advance(-1)


def test_cpu_bound_tools_queue_for_cores_light_tools_do_not():
    tl, log = Timeline(), []
    cores = VirtualCores(2, tl)

    def tool(name, t, dur, cpu):
        cores.submit(t, dur, cpu, lambda s: log.append((name, "start", s)),
                     lambda e: log.append((name, "end", e)))

    tool("a", 0.0, 10.0, True)
    tool("b", 0.0, 4.0, True)
    tool("c", 1.0, 3.0, True)     # both cores busy: waits for b (ends at 4)
    tool("light", 1.0, 2.0, False)  # holds no core, starts at once
    assert cores.running == 2 and cores.waiting == 1
    tl.run_due(100.0)
    starts = {n: t for n, what, t in log if what == "start"}
    ends = {n: t for n, what, t in log if what == "end"}
    assert starts == {"a": 0.0, "b": 0.0, "c": 4.0, "light": 1.0}
    assert ends == {"a": 10.0, "b": 4.0, "c": 7.0, "light": 3.0}
    assert cores.waited_s == pytest.approx(3.0) and cores.running == 0


def test_control_admits_queued_sessions_and_times_them_out():
    """The shell around the sidecar's AdmissionCore: a new session queues and is admitted
    by the step the simulator settles at the same instant; one that is never admitted fails
    once the admitted sessions stall for the sidecar's admission timeout."""
    from mars.sim.control import SimControl, sidecar_config

    clock, tl = VirtualClock(0.0), Timeline()
    admitted, failed, events = [], [], []
    sc = sidecar_config(True, 4, 16)
    ctl = SimControl(sc, clock, tl, admitted=lambda s, t: admitted.append((s.id, t)),
                     failed=lambda s, why, t: failed.append((s.id, why, t)),
                     record=events.append)
    s = ctl.arrive("job-1", 0.0, prompt_tokens=1000)
    assert not s.is_admitted
    ctl.settle(0.0)
    assert admitted == [("job-1", 0.0)] and s.is_admitted
    assert any(e["kind"] == "session_admit" for e in events)
    ctl.forward(s, 0.0, last_round=True)
    ctl.finish(s, "ok", 1.0)
    assert any(e["kind"] == "session_end" and e["reason"] == "last_round" for e in events)
    # a window of one, held: the next session waits, then times out
    sc1 = sidecar_config(True, 4, 16)
    sc1.admission_config.aimd.initial_window = sc1.admission_config.aimd.max_window = 1
    sc1.admission_config.aimd.min_window = 1
    sc1.idle_timeout_s = 10 * sc1.admission_timeout_s  # a stays admitted while it idles
    ctl = SimControl(sc1, clock, tl, admitted=lambda s, t: admitted.append((s.id, t)),
                     failed=lambda s, why, t: failed.append((s.id, why, t)), record=events.append)
    a = ctl.arrive("a", 0.0, 10)
    ctl.settle(0.0)
    assert a.is_admitted
    b = ctl.arrive("b", 0.0, 10)
    ctl.settle(0.0)
    assert not b.is_admitted
    # a's rounds go on past the bound: b waits its turn (the bound is on stalls)
    bound = sc1.admission_timeout_s
    for k in range(1, 4):
        t = k * 0.6 * bound
        clock.advance_to(t)
        tl.run_due(t)
        ctl.forward(a, t, last_round=False)
        ctl.finish(a, "ok", t + 1.0)
    assert not failed and not b.is_admitted and b.waiting == 1
    # then a holds its slot and does nothing: b gives up one bound after a's last progress
    last = 3 * 0.6 * bound + 1.0
    clock.advance_to(last + bound - 1.0)
    tl.run_due(clock())
    assert not failed
    clock.advance_to(last + bound + 0.01)
    tl.run_due(clock())
    assert failed and failed[-1][0] == "b" and "nothing progressed" in failed[-1][1]
    assert failed[-1][2] == pytest.approx(last + bound)
    assert "b" not in ctl.core.sessions


def test_task_script_builds_the_replays_prompts_and_cuts_at_the_context_limit():
    from mars.workloads.generator import generate
    from mars.workloads.prompts import TokenSpace
    from mars.workloads.task_script import TaskScript

    task = next(t for t in generate("ILR-1", num_tasks=8, rate=1, seed=0) if t.num_rounds >= 3)
    space = TokenSpace(0)
    s = TaskScript(task, space, "job", None)
    c0 = s.call()
    assert c0.index == 0 and c0.meta.round == 0 and c0.meta.prev_tool is None
    assert len(c0.prompt) == task.prefix_tokens + task.task_tokens
    assert c0.output_tokens == task.rounds[0].output_tokens
    gen = list(range(7, 7 + c0.output_tokens))
    assert s.after(gen) is None
    c1 = s.call()
    r0 = task.rounds[0]
    assert c1.prompt[:len(c0.prompt) + len(gen)] == c0.prompt + gen  # append-only history
    assert len(c1.prompt) == len(c0.prompt) + len(gen) + r0.observation_tokens + r0.template_tokens
    assert c1.meta.prev_tool == r0.tool and c1.meta.next_tool == task.rounds[1].tool
    # a limit the second round does not fit: truncated after the first
    limit = len(c1.prompt) + task.rounds[1].output_tokens - 1
    s2 = TaskScript(task, space, "job", limit)
    assert s2.skip_reason() is None
    assert "would need" in s2.after(gen) and s2.k == 0
    assert "over the server's max_model_len" in TaskScript(task, space, "j", 10).skip_reason()


def test_a_session_moved_away_and_back_waits_on_its_latest_stay():
    """A queued session moved A -> B -> A (late binding between two engines' control
    planes): the timeout timer of its first stay at A must not come back to life when it
    returns; it waits one stall bound from its return."""
    from mars.sim.control import SimControl, sidecar_config

    clock, tl = VirtualClock(0.0), Timeline()
    failed: list = []
    ctls = []
    for rank in range(2):
        sc = sidecar_config(True, 4, 16)
        sc.admission_config.aimd.initial_window = sc.admission_config.aimd.max_window = 1
        sc.admission_config.aimd.min_window = 1
        sc.idle_timeout_s = 10 * sc.admission_timeout_s
        ctl = SimControl(sc, clock, tl, admitted=lambda s, t: None,
                         failed=lambda s, why, t: failed.append((s.id, t)),
                         record=lambda ev: None, engine=rank)
        held = ctl.arrive(f"held-{rank}", 0.0, 10)  # the window's one slot, idle
        ctl.settle(0.0)
        assert held.is_admitted
        ctls.append(ctl)
    a, b = ctls
    bound = a.sidecar.admission_timeout_s
    s = a.arrive("s", 0.0, 10)
    a.settle(0.0)
    assert not s.is_admitted
    for t, src, dst in ((10.0, a, b), (20.0, b, a)):
        clock.advance_to(t)
        tl.run_due(t)
        got = src.core.transfer_out("s", t)
        assert got is not None
        dst.take_queued(*got, t)
    clock.advance_to(bound + 1.0)
    tl.run_due(clock())  # its first stay's bound has passed: not its latest
    assert not failed and a.core.sessions["s"] is s and s.waiting == 1
    clock.advance_to(20.0 + bound + 0.01)
    tl.run_due(clock())
    assert failed == [("s", pytest.approx(20.0 + bound))]


def test_the_sidecar_config_takes_admission_overrides_as_mars_sidecar_does():
    """``mars sim run --admission-config`` reaches the simulated sidecar as ``mars sidecar
    --admission-config`` reaches the served one; the engine's block size stays unless the
    object sets it, and bad objects are refused before any run starts."""
    import subprocess
    import sys

    from mars.sim.control import sidecar_config

    sc = sidecar_config(True, 4, 32, {"host_tier": False, "packing": {"max_queue_wait_s": 9}})
    cfg = sc.admission_config
    assert cfg.host_tier is False and cfg.packing.max_queue_wait_s == 9
    assert cfg.packing.block_size == 32 and cfg.pressure.tool_cores == 4
    assert sidecar_config(True, 4, 32).admission_config.host_tier is True
    for bad, why in (('{"host_tyre": false}', "host_tyre"), ('{"host_tier": 1}', "true or false"),
                     ("[1]", "JSON object")):
        p = subprocess.run([sys.executable, "-m", "mars.cli", "sim", "run", "ILR-1",
                            "--num-tasks", "1", "--admission-config", bad],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 1 and "--admission-config" in p.stderr and why in p.stderr, \
            p.stderr[-500:]
