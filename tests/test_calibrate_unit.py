"""Calibration's framework-free parts: the fit recovers coefficients it is shown, the search,
device profile files (no vLLM, no engine)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest

from mars.emulate.fit import Measured, fit_coefficients, nelder_mead, relative_errors
from mars.emulate.profile import DeviceProfile, EngineSettings, is_profile_path
from mars.emulate.specs import GpuSpec, hf_config, model_from_hf_config
from mars.emulate.step_time import StepCoefficients, StepTimeModel

#: a small dense model (the embedded model's shapes) on a made-up slow device
TINY = model_from_hf_config("tiny", {
    "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 1008, "max_position_embeddings": 65536,
    "intermediate_size": 256})
DEVICE = GpuSpec("dev", bf16_tflops=0.9, fp8_tflops=0.9, hbm_tb_s=0.05, memory_gib=16)


def _batches(seed: int = 0) -> list[tuple[tuple[int, int], ...]]:
    """Prefill chunks over growing context, decodes of many sizes and contexts, mixed steps:
    the shapes ``mars emulate calibrate`` measures."""
    rng = random.Random(seed)
    out = []
    for ctx in range(0, 40_000, 2048):
        out.append(((2048, ctx),))
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        for c in (256, 4096, 16384, 49152):
            out.append(tuple((1, c + rng.randrange(8)) for _ in range(b)))
            out.append(tuple((1, c) for _ in range(b)) + ((rng.choice((32, 256, 1536)), c),))
    for n in (32, 128, 512):
        out.append(((n, 49152),))
    return out


@pytest.mark.slow
def test_the_fit_recovers_the_coefficients_that_made_the_steps():
    truth = StepCoefficients(gemm_efficiency=0.15, attention_efficiency=0.3,
                             memory_efficiency=0.7, step_overhead_s=9e-4, layer_overhead_s=0.0,
                             request_overhead_s=1.5e-5, attention_parallelism=30,
                             attention_query_tile=16, attention_occupancy_exponent=0.5)
    stm = StepTimeModel(TINY, DEVICE, truth)
    samples = [Measured(b, stm.step_time(b)) for b in _batches()]
    fit = fit_coefficients(TINY, DEVICE, samples)
    assert fit.samples == len(samples)
    # the same model, so the same times: what is identifiable is recovered
    assert fit.errors["max"] < 0.02, fit.errors
    errs = relative_errors(TINY, fit.gpu, fit.coefficients, samples)
    assert max(map(abs, errs)) < 0.02
    c = fit.coefficients
    assert c.attention_query_tile == 16 and c.layer_overhead_s == 0.0
    assert c.step_overhead_s == pytest.approx(9e-4, rel=0.05)


@pytest.mark.slow
def test_noisy_steps_fit_within_their_noise():
    truth = StepCoefficients(step_overhead_s=1e-3, layer_overhead_s=0.0,
                             gemm_efficiency=0.2, attention_efficiency=0.25)
    stm = StepTimeModel(TINY, DEVICE, truth)
    rng = random.Random(1)
    samples = [Measured(b, stm.step_time(b) * math.exp(rng.gauss(0, 0.1))) for b in _batches()]
    fit = fit_coefficients(TINY, DEVICE, samples)
    assert fit.errors["median"] < 0.12, fit.errors
    assert set(fit.errors) >= {"mean", "median", "p90", "max", "mean_decode", "mean_prefill",
                               "mean_mixed"}


@pytest.mark.slow
def test_an_engine_faster_than_the_measured_peaks_raises_the_peaks_not_the_rules():
    """Efficiencies stay in (0, 1]: what the engine exceeds is the measured peak (a CPU's
    caches beat its copy bandwidth), so the device's peak is raised instead."""
    truth = StepCoefficients(memory_efficiency=1.0, step_overhead_s=5e-4, layer_overhead_s=0)
    fast = replace(DEVICE, hbm_tb_s=0.2)  # the engine really sees 4x the copy bandwidth
    stm = StepTimeModel(TINY, fast, truth)
    samples = [Measured(b, stm.step_time(b)) for b in _batches()]
    fit = fit_coefficients(TINY, DEVICE, samples)
    # what the steps show is the effective bandwidth (0.2 TB/s x 1.0), 4x the measured peak
    assert fit.gpu.hbm_tb_s * fit.coefficients.memory_efficiency == pytest.approx(0.2, rel=0.05)
    assert fit.gpu.hbm_tb_s > 3 * DEVICE.hbm_tb_s
    assert fit.errors["max"] < 0.05


def test_checked_coefficients_keep_every_product():
    from mars.emulate.fit import _Unchecked

    u = _Unchecked(StepCoefficients(), gemm_efficiency=3.0, attention_efficiency=1.5,
                   moe_efficiency=0.5, memory_efficiency=2.0)
    coef, dev = u.checked(DEVICE)
    assert coef.gemm_efficiency == 1.0 and coef.memory_efficiency == 1.0
    assert dev.bf16_tflops * coef.attention_efficiency == pytest.approx(DEVICE.bf16_tflops * 1.5)
    assert dev.bf16_tflops * coef.moe_efficiency == pytest.approx(DEVICE.bf16_tflops * 0.5)
    assert dev.fp8_tflops == pytest.approx(DEVICE.fp8_tflops * 3)
    assert dev.hbm_tb_s == pytest.approx(DEVICE.hbm_tb_s * 2)
    # under the peaks: nothing moves
    coef, dev = _Unchecked(StepCoefficients()).checked(DEVICE)
    assert coef == replace(StepCoefficients(), layer_overhead_s=StepCoefficients().layer_overhead_s)
    assert dev == DEVICE


def test_kv_that_fits_the_cache_is_read_at_the_cache_rate():
    """The cache term: a step's KV, re-read every step, is read at ``ratio x`` the memory
    rate while it fits the cache; beyond it only the cached part is; off by default (the
    shipped GPU profiles' times are unchanged)."""
    mem_bound = replace(StepCoefficients(), attention_efficiency=1.0, step_overhead_s=0.0,
                        layer_overhead_s=0.0, request_overhead_s=0.0)
    cached = replace(mem_bound, cache_bytes=8 * 2**20, cache_bandwidth_ratio=4.0)
    plain, fast = StepTimeModel(TINY, DEVICE, mem_bound), StepTimeModel(TINY, DEVICE, cached)
    per_token = TINY.kv_bytes_per_token()  # 512 B: 8 MiB is 16,384 tokens
    small, big = [(1, 8192)], [(1, 8192)] * 16  # 4 MiB, 64 MiB of KV
    assert fast.breakdown(small).attention == pytest.approx(plain.breakdown(small).attention / 4)
    hot = 8 * 2**20 / (16 * 8193 * per_token)
    assert fast.breakdown(big).attention == pytest.approx(
        plain.breakdown(big).attention * (hot / 4 + 1 - hot))
    # off: bit-identical to the model without the term
    assert StepTimeModel(TINY, DEVICE, replace(mem_bound, cache_bandwidth_ratio=4.0)) \
        .step_time(big) == plain.step_time(big)


@pytest.mark.slow
def test_the_fit_finds_the_cache_the_steps_show():
    truth = StepCoefficients(gemm_efficiency=0.2, attention_efficiency=0.3,
                             memory_efficiency=0.3, step_overhead_s=9e-4, layer_overhead_s=0.0,
                             request_overhead_s=1.5e-5, cache_bytes=8 * 2**20,
                             cache_bandwidth_ratio=3.0)
    stm = StepTimeModel(TINY, DEVICE, truth)
    samples = [Measured(b, stm.step_time(b)) for b in _batches()]
    fit = fit_coefficients(TINY, DEVICE, samples, cache_hint_bytes=32 * 2**20)
    assert fit.errors["max"] < 0.03, fit.errors
    assert fit.coefficients.cache_bytes == pytest.approx(8 * 2**20, rel=0.2)


@pytest.mark.parametrize("bad", [
    {"step_overhead_s": float("nan")}, {"attention_parallelism": float("inf")},
    {"attention_query_tile": 8.5}, {"gemm_efficiency": float("nan")},
    {"cache_bytes": -1.0}, {"cache_bandwidth_ratio": 0.5}, {"cache_bytes": float("inf")},
])
def test_non_finite_coefficients_are_refused(bad):
    with pytest.raises(ValueError):
        StepCoefficients(**bad)


def test_too_few_samples_is_an_error():
    with pytest.raises(ValueError, match="needs at least"):
        fit_coefficients(TINY, DEVICE, [Measured(((1, 10),), 1e-3)] * 3)


def test_measured_step_kinds():
    assert Measured(((1, 5), (1, 9)), 1.0).kind == "decode"
    assert Measured(((64, 0),), 1.0).kind == "prefill"
    assert Measured(((1, 5), (64, 0)), 1.0).kind == "mixed"


def test_nelder_mead_finds_a_quadratic_minimum():
    x, v = nelder_mead(lambda p: (p[0] - 3) ** 2 + 2 * (p[1] + 1) ** 2 + 5, [0.0, 0.0])
    assert x == pytest.approx([3, -1], abs=1e-3) and v == pytest.approx(5, abs=1e-6)


def test_occupancy_slows_attention_only_below_the_parallelism():
    base = StepCoefficients()
    occ = replace(base, attention_parallelism=32, attention_query_tile=16,
                  attention_occupancy_exponent=1.0)
    a, b = StepTimeModel(TINY, DEVICE, base), StepTimeModel(TINY, DEVICE, occ)
    one = [(1, 30_000)]
    assert b.breakdown(one).attention == pytest.approx(32 * a.breakdown(one).attention)
    big = [(2048, 0)]  # 128 query tiles >= 32: full rate
    assert b.breakdown(big).attention == pytest.approx(a.breakdown(big).attention)
    assert b.work(big).query_tiles == 128
    with pytest.raises(ValueError, match="occupancy"):
        StepCoefficients(attention_parallelism=-1)


# ---------------------------------------------------------------------------- profiles
def _profile(**kw) -> DeviceProfile:
    cfg = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 1008, "max_position_embeddings": 65536,
           "intermediate_size": 256}
    return DeviceProfile(name="tiny@cpu", gpu=DEVICE, model_config=cfg,
                         coefficients=StepCoefficients(step_overhead_s=1e-3),
                         engine=EngineSettings(32, 2048, 128, 65536, 1 << 30),
                         fit={"samples": 10}, served_model_name="mars-tiny", **kw)


def test_profile_round_trips_through_its_file(tmp_path):
    p = _profile()
    path = tmp_path / "dev.json"
    p.write(path)
    q = DeviceProfile.load(path)
    assert q == p and q.model.num_layers == 2 and q.model.name == "tiny@cpu"
    assert is_profile_path(str(path)) and not is_profile_path("h100:qwen3-coder-30b-a3b")


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d.pop("format"), "not a device profile"),
    (lambda d: d.pop("coefficients"), "lacks 'coefficients'"),
    (lambda d: d["device"].update(hbm_tb_s=float("nan")), "hbm_tb_s"),
    (lambda d: d["engine"].update(block_size=0), "block_size"),
    (lambda d: d["coefficients"].update(gemm_efficiency=2), r"\(0, 1\]"),
    (lambda d: d["coefficients"].update(bogus=1), "bogus"),
    (lambda d: d["model_config"].pop("hidden_size"), "hidden_size"),
])
def test_bad_profiles_are_refused_with_a_reason(tmp_path, mutate, msg):
    d = _profile().as_dict()
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=msg):
        DeviceProfile.load(path)


def test_unreadable_profiles(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        DeviceProfile.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        DeviceProfile.load(tmp_path / "x.json")


def test_shipped_profiles_keep_attention_occupancy_off():
    """The GPU profiles' coefficients are the documented defaults: occupancy is off."""
    assert StepCoefficients().attention_parallelism == 0
    q = model_from_hf_config("q", hf_config("qwen3-coder-30b-a3b"))
    s = StepTimeModel(q, DEVICE)
    assert s.breakdown([(1, 8000)]).attention > 0


def test_the_search_survives_coordinates_far_outside_any_device():
    """Nelder-Mead may walk a coordinate the samples barely constrain far out (the robust
    loss grows only linearly): the coefficients it builds there stay finite and the loss
    counts them as a bad fit, instead of `mars emulate calibrate` dying of an overflow (it
    did, on a busy machine)."""
    from mars.emulate.fit import FITTED, _coefficients

    base = StepCoefficients()
    for v in (800.0, -800.0, 1e6):
        c = _coefficients([v] * len(FITTED), base)
        assert all(math.isfinite(getattr(c, n)) for n in FITTED)
        stm = StepTimeModel(TINY, DEVICE, c)
        t = stm.time_of(stm.work(((512, 4096), (1, 8192)))).total
        assert not math.isnan(t)
