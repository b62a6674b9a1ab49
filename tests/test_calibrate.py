"""``mars emulate calibrate`` on the real CPU engine, and the simulator on its profile against
that engine (the second fidelity comparison of docs/sim.md, small form)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """A quick calibration of this machine's served engine (the embedded model), on a quiet
    machine: a neighbour busy on one of the two cores while it measures made the quick
    grid's decodes 2-4x slower (the grid's two passes are ~10 s apart, and the engine
    servers of the test before may still be winding down)."""
    from tests.conftest import wait_for_quiet_cpu

    wait_for_quiet_cpu()
    out = tmp_path_factory.mktemp("cal") / "cpu.json"
    r = subprocess.run([sys.executable, "-m", "mars.cli", "emulate", "calibrate", "--quick",
                        "--no-plot", "--out", str(out)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Device profile" in r.stdout and "mean abs error" in r.stdout
    return out


def test_calibrate_writes_the_served_engine_profile(profile):
    from mars.emulate.profile import DeviceProfile
    from mars.vllm_patches.serve import CPU_DEFAULT_BLOCK_SIZE, CPU_DEFAULT_KV_BYTES

    p = DeviceProfile.load(profile)
    # measured with what `mars-vllm serve` runs on CPU, and says so
    assert p.engine.block_size == CPU_DEFAULT_BLOCK_SIZE
    assert p.engine.kv_cache_bytes == CPU_DEFAULT_KV_BYTES
    assert p.engine.max_model_len == 65536 and p.served_model_name == "mars-tiny"
    assert (p.model.num_layers, p.model.hidden, p.model.num_kv_heads) == (2, 128, 2)
    fit = p.fit
    assert fit["samples"] == len(fit["points"]) >= 20
    errs = fit["abs_relative_error"]
    assert all(math.isfinite(v) and v >= 0 for v in errs.values())
    # every sample is a real step: positive times, the model's own prediction beside it
    assert all(pt[5] > 0 and pt[6] > 0 for pt in fit["points"])
    assert {pt[0] for pt in fit["points"]} == {"prefill", "decode", "mixed"}
    json.dumps(p.as_dict())


def test_the_emulated_engine_on_a_profile_has_the_real_engines_pool(profile):
    """``--emulate PROFILE`` schedules with the measured engine's settings: same block size,
    token budget, context limit and KV pool as the real engine it stands in for."""
    from mars.sim.clock import VirtualClock
    from mars.vllm_patches.sim_engine import SimEngine

    import os

    from mars.emulate.profile import DeviceProfile

    measured = DeviceProfile.load(profile)
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    eng = SimEngine(str(profile), "fcfs", clock=VirtualClock(), sink=lambda ev: None)
    try:
        cfg = eng.vllm_config
        assert eng.block_size == measured.engine.block_size == 32
        assert eng.max_model_len == measured.engine.max_model_len
        assert cfg.scheduler_config.max_num_batched_tokens == \
            measured.engine.max_num_batched_tokens
        assert cfg.scheduler_config.max_num_seqs == measured.engine.max_num_seqs
        # 1 GiB of bf16 KV for 2 layers x 2 KV heads x 32 = 512 B per token: 2,097,152 tokens,
        # what the real engine's log reports for the same pool
        assert eng.num_blocks * eng.block_size == 2_097_152
        # served under the profile's name, not as the real engine
        assert eng.served_model == measured.name != measured.served_model_name
    finally:
        eng.close()
    # building an in-process engine leaves no trace in the environment later servers inherit
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == before


def test_bad_profiles_are_refused_by_serve_and_sim(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    r = subprocess.run([sys.executable, "-m", "mars.cli", "sim", "run", "ILR-1", "--num-tasks",
                        "1", "--profile", str(bad), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not a device profile" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mars.vllm_patches.serve", "serve", "--emulate",
                        str(tmp_path / "missing.json")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "cannot read device profile" in r.stderr, r.stderr[-2000:]


def test_sim_on_the_profile_matches_the_real_engine(profile, tmp_path):
    """Fidelity, small form (the full table: docs/sim.md): the same trace through the real
    served engine on this machine (``mars-vllm serve`` on the embedded model, real compute,
    real HTTP and sidecar) and through ``mars sim --profile`` agrees within 15 % on what the
    simulator models: the engine's own time (each call from the scheduler taking it to its
    end, summed) and mean task latency once the host's measured share is taken out of the
    real run (the HTTP path, API server and sidecar around each call, tools' late timers:
    10-17 % of the latency on this busy 2-core machine, docs/sim.md; the same measure is
    taken out of the simulated run, where it is only the wait for a step in progress).
    Tools are 10x shorter so the engine's share of the latency is not small."""
    from mars.launch import ServerProcess
    from mars.sim.fidelity import engine_call_seconds, engine_side_mean, outside_engine
    from tests.conftest import wait_for_quiet_cpu
    from mars.workloads.eventlink import read_events
    from mars.workloads.generator import generate
    from mars.workloads.results import read_results
    from mars.workloads.trace import write_trace

    # contexts within the embedded model's 64K, so every task runs on both sides
    trace = generate("ILR-1", num_tasks=3, rate=0.2, seed=0, time_scale=10,
                     context_limit=60_000)
    write_trace(trace, tmp_path / "trace.jsonl")
    with ServerProcess(args=["--policy", "fcfs", "--tool-cores", "8"],
                       startup_timeout_s=600) as srv:
        idle = wait_for_quiet_cpu()  # the real run is timed against the calibration
        r = subprocess.run([sys.executable, "-m", "mars.cli", "replay", "--trace",
                            str(tmp_path / "trace.jsonl"), "--url", srv.url,
                            "--virtual-tool-cores", "8", "--ideal", "skip", "--no-plots",
                            "--no-progress", "--out", str(tmp_path / "real")],
                           capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "mars.cli", "sim", "run", "--trace",
                        str(tmp_path / "trace.jsonl"), "--profile", str(profile), "--policies",
                        "fcfs", "--tool-cores", "8", "--ideal", "skip", "--no-plots",
                        "--no-progress", "--out", str(tmp_path / "sim")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    real = read_results(tmp_path / "real")
    sim = read_results(tmp_path / "sim" / "fcfs")
    assert real.summary["tasks"]["completed"] == sim.summary["tasks"]["completed"] == 3
    # every call of the trace ran on both sides, and the engine's share of the latency is
    # large enough that a wrong step-time model shows in it
    ev_real = read_events(tmp_path / "real" / "events.jsonl")
    ev_sim = read_events(tmp_path / "sim" / "fcfs" / "events.jsonl")
    eng_real, eng_sim = engine_call_seconds(ev_real), engine_call_seconds(ev_sim)
    assert real.summary["rounds"] == sim.summary["rounds"] == \
        sum(t.num_rounds for t in trace.tasks)
    assert eng_real > 0.2 * sum(t.latency_s for t in real.tasks)
    outside = outside_engine(real, ev_real)
    assert all(o.unmatched == 0 for o in outside.values())
    mean_real, mean_sim = engine_side_mean(real, ev_real), engine_side_mean(sim, ev_sim)
    detail = {"idle_before_real_run": idle, "engine_s": (eng_real, eng_sim), "latency": (real.summary["latency_s"],
              sim.summary["latency_s"]), "outside_engine_real": outside,
              "engine_side_mean": (mean_real, mean_sim)}
    assert eng_sim == pytest.approx(eng_real, rel=0.15), detail
    assert mean_sim == pytest.approx(mean_real, rel=0.15), detail


def test_bench_simulates_a_grid_on_the_profile(profile, tmp_path):
    """``mars bench --sim PROFILE``: the grid in virtual time on the measured device."""
    from mars.workloads.results import read_results

    out = tmp_path / "bench"
    r = subprocess.run([sys.executable, "-m", "mars.cli", "bench", "ILR-1", "--sim", str(profile),
                        "--policies", "fcfs", "--rates", "0.2", "--num-tasks", "2",
                        "--time-scale", "10", "--context-limit", "60000", "--ideal", "skip",
                        "--no-run-plots", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = [read_results(p) for p in out.rglob("results.json")]
    assert len(res) == 1 and res[0].server["emulated"]["profile"] == str(profile.resolve())
    assert res[0].summary["tasks"]["completed"] == 2
    r = subprocess.run([sys.executable, "-m", "mars.cli", "bench", "ILR-1", "--sim",
                        str(tmp_path / "nope.json"), "--out", str(tmp_path / "b2")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "cannot read device profile" in r.stderr


def test_flags_that_would_resize_the_measured_pool_are_refused(profile):
    for flag in (["--gpu-memory-utilization", "0.5"], ["--kv-cache-dtype", "fp8"]):
        r = subprocess.run([sys.executable, "-m", "mars.vllm_patches.serve", "serve",
                            "--emulate", str(profile), *flag], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and "does not apply to a device profile" in r.stderr, \
            r.stderr[-2000:]
