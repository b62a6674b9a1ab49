"""Every shipped emulated GPU x model starts with default arguments and serves, through the
same argument path as ``mars-vllm serve --emulate GPU:MODEL`` (vLLM's own start-up checks,
its KV cache manager), and the published end-to-end points the docs table shows are what the
emulation predicts (issue #31)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from mars.emulate.specs import GPUS, MODELS

pytestmark = pytest.mark.engine


def _sim(gpu: str, model: str, policy: str = "mars"):
    from mars.sim.runner import SimConfig, Simulation

    return Simulation(SimConfig(gpu, model, policy, progress=False))


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_profile_starts_and_completes_a_run(gpu, model):
    """`mars sim run` on each profile: vLLM accepts the context limit derived from the pool
    the card holds (h100 x qwen3-coder refused to start before: 160,889 tokens against a
    pool of 160,864) and two sessions complete on the measured (or derived) step model."""
    from mars.emulate.measured import measured_source
    from mars.workloads.generator import generate

    sim = _sim(gpu, model)
    try:
        eng = sim.engine
        m = MODELS[model]
        assert eng.max_model_len <= m.max_model_len and eng.max_model_len % eng.block_size == 0
        src = measured_source(gpu, model)
        assert eng.step_model.kind == (f"{src[1]} {gpu}" + (f" (from measured {src[0]})"
                                                            if src[1] == "derived" else ""))
        trace = generate("ILR-1", num_tasks=2, rate=0.5, seed=0,
                         context_limit=eng.max_model_len)
        res = sim.run(trace, "load", "mars")
        assert res.summary["tasks"]["completed"] == 2, res.summary
    finally:
        sim.close()


def test_the_server_starts_on_the_h100_with_default_arguments():
    """`mars-vllm serve --emulate h100:qwen3-coder-30b-a3b`, as a new user types it."""
    pytest.importorskip("vllm")
    from mars.launch import ServerProcess

    srv = ServerProcess(args=["--emulate", "h100:qwen3-coder-30b-a3b", "--no-sidecar"]).start()
    try:
        models = httpx.get(srv.url + "/v1/models").json()["data"]
        assert models[0]["max_model_len"] % 16 == 0
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": models[0]["id"], "prompt": [1, 2, 3], "max_tokens": 4,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert "measured h100; async scheduling" in srv.tail(400)
    finally:
        srv.stop()


@pytest.mark.parametrize("flag", [None, "--no-async-scheduling"])
def test_the_emulated_gpu_runs_the_scheduler_class_a_gpu_gets(flag):
    """vLLM turns async scheduling on by default on a GPU, and MarsAsyncScheduler is what a
    GPU user runs: the emulated GPU decides the same (the executor supports it; the platform
    plugin keeps the decision the CPU platform would drop), and vLLM's own
    `--no-async-scheduling` gives the sync class. The real CPU engine is left as vLLM's CPU
    platform decides it (sync)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from mars.sim.clock import VirtualClock
    from mars.engine.harness.offline import tiny_model_dir
    from mars.engine.harness.sim_engine import SimEngine

    assert type(current_platform).__name__ == "EmulationAwareCpuPlatform"
    eng = SimEngine("h100:qwen3-coder-30b-a3b", "mars", clock=VirtualClock(),
                    sink=lambda _e: None, extra_args=[flag] if flag else [])
    try:
        want = "MarsScheduler" if flag else "MarsAsyncScheduler"
        assert type(eng.scheduler).__name__ == want
        assert eng.async_scheduling is (flag is None)
        assert eng.vllm_config.scheduler_config.async_scheduling is (flag is None)
    finally:
        eng.close()
    cpu = EngineArgs(model=tiny_model_dir(), max_model_len=2048).create_engine_config()
    assert cpu.scheduler_config.async_scheduling is False


@pytest.mark.parametrize("key", ["qwen-h100nvl-1024x128", "oss-h100-c4-ttft"])
def test_published_points_are_predicted_as_documented(key):
    """Two of the published points (the rest: ``python -m mars.engine.harness.serving_bench``,
    a few minutes): the emulation, in virtual time, predicts exactly what the docs table
    records, for the measured model and the roofline it replaced."""
    from mars.emulate.published import POINTS
    from mars.engine.harness.serving_bench import compare

    p = next(p for p in POINTS if p.key == key)
    got = compare([p])[key]
    for sm, documented in p.documented.items():
        assert got[sm] / p.measured - 1 == pytest.approx(documented, abs=0.002), (sm, got)


def test_emulate_config_picks_the_step_model():
    from mars.engine.serve.cli import apply_emulation  # noqa: F401  (import check)
    from mars.engine.harness.sim_engine import engine_args_for

    args = engine_args_for("h200:qwen3-coder-30b-a3b", "fcfs",
                           ["--emulate-config", json.dumps({"step_model": "roofline"})])
    cfg = args.additional_config["mars_emulate"]
    assert cfg["step_model"] == "roofline"
    with pytest.raises(SystemExit, match="step_model"):
        engine_args_for("h200:qwen3-coder-30b-a3b", "fcfs",
                        ["--emulate-config", json.dumps({"step_model": "vidur"})])


def test_the_platform_plugin_answers_only_for_vllms_plain_cpu_platform(monkeypatch):
    """Where vLLM would pick another platform (its ZenCpuPlatform on AMD Zen with zentorch,
    or a GPU's) the plugin answers nothing, so that platform is not replaced."""
    import vllm.platforms as platforms

    from mars.engine.executor import platform

    for builtin, want in [("vllm.platforms.cpu.CpuPlatform", platform.QUALNAME),
                          ("vllm.platforms.zen_cpu.ZenCpuPlatform", None), (None, None)]:
        monkeypatch.setattr(platforms, "cpu_platform_plugin", lambda b=builtin: b)
        assert platform.detect() == want, builtin


def test_async_is_kept_for_the_emulated_executor_and_its_subclasses_only():
    from types import SimpleNamespace

    from mars.engine.executor.emulated_executor import QUALNAME, EmulatedExecutor
    from mars.engine.executor.emulated_platform import runs_emulated_executor

    class Mine(EmulatedExecutor):
        pass

    def cfg(backend):
        return SimpleNamespace(parallel_config=SimpleNamespace(
            distributed_executor_backend=backend))

    assert runs_emulated_executor(cfg(QUALNAME))
    assert runs_emulated_executor(cfg(EmulatedExecutor)) and runs_emulated_executor(cfg(Mine))
    for other in ("mp", "uni", None, "vllm.v1.executor.uniproc_executor.UniProcExecutor"):
        assert not runs_emulated_executor(cfg(other)), other


def test_bad_profiles_are_refused_by_serve_and_sim(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    r = subprocess.run([sys.executable, "-m", "mars.cli", "sim", "run", "ILR-1", "--num-tasks",
                        "1", "--profile", str(bad), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "not a device profile" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mars.engine.serve.cli", "serve", "--emulate",
                        str(tmp_path / "missing.json")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "cannot read device profile" in r.stderr, r.stderr[-2000:]


def test_flags_that_would_resize_a_profiles_pool_are_refused(tmp_path):
    """A device profile fixes the KV pool it was measured with: ``serve --emulate PROFILE``
    refuses the flags that would size or shape it otherwise (any profile file, a calibrated
    one as this one)."""
    from tests.test_calibrate_unit import _profile

    profile = tmp_path / "dev.json"
    _profile().write(profile)
    for flag in (["--gpu-memory-utilization", "0.5"], ["--kv-cache-dtype", "fp8"]):
        r = subprocess.run([sys.executable, "-m", "mars.engine.serve.cli", "serve",
                            "--emulate", str(profile), *flag], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and "does not apply to a device profile" in r.stderr, \
            r.stderr[-2000:]


@pytest.fixture(scope="module")
def written_profile(tmp_path_factory):
    """A device profile file of the embedded model on the CPU engine's settings, as ``mars
    emulate calibrate`` writes one (tests/test_calibrate.py calibrates a real one, in the
    quiet tier; what is checked here needs a profile, not a measurement)."""
    from tests.test_calibrate_unit import _profile

    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    _profile().write(path)
    return path


def test_the_emulated_engine_on_a_profile_has_the_real_engines_pool(written_profile):
    """``--emulate PROFILE`` schedules with the measured engine's settings: same block size,
    token budget, context limit and KV pool as the real engine it stands in for (those a
    calibration records: tests/test_calibrate.py)."""
    profile = written_profile
    from mars.sim.clock import VirtualClock
    from mars.engine.harness.sim_engine import SimEngine

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


def test_bench_simulates_a_grid_on_the_profile(written_profile, tmp_path):
    """``mars bench --sim PROFILE``: the grid in virtual time on a device profile."""
    profile = written_profile
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
