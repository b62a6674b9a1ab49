"""The emulated GPU's roofline step-time model (GPUs nobody has timed, calibrated CPU
profiles): shapes and roofline behaviour. The measured model: tests/test_measured_step.py;
published points: tests/test_emulated_profiles.py."""

from __future__ import annotations

import dataclasses

import pytest

from mars.emulate import BatchEntry, StepCoefficients, StepTimeModel, get_gpu, get_model

QWEN = get_model("qwen3-coder-30b-a3b")
OSS = get_model("gpt-oss-120b")


def test_model_shapes_match_the_published_sizes():
    # Qwen3-Coder-30B-A3B: 30.5B total, 3.3B active incl. embeddings (model card: 30.5B / 3.3B)
    assert QWEN.total_params / 1e9 == pytest.approx(30.5, abs=0.2)
    assert QWEN.kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2  # 96 KiB per token
    # gpt-oss-120b: 117B total, 5.1B active (model card)
    assert OSS.total_params / 1e9 == pytest.approx(117, abs=1.5)
    assert OSS.active_params / 1e9 == pytest.approx(5.1, abs=0.15)
    # only the 18 full-attention layers grow with the context; sliding ones hold 128 tokens
    assert OSS.kv_bytes_per_sequence(10_000) == pytest.approx(
        (10_000 * 18 + 128 * 18) * 2 * 8 * 64 * 2)


def test_decode_is_memory_bound_and_prefill_compute_bound():
    m = StepTimeModel(QWEN, get_gpu("h100"))
    one = m.breakdown([(1, 1000)])
    assert one.mlp > 0 and one.total < 0.02
    # a single decode reads the touched experts' and attention weights: bandwidth, not flops
    bytes_read = (QWEN.num_layers * (8 * QWEN.expert_params + QWEN.attn_params) * 2)
    assert one.mlp + one.projections == pytest.approx(
        bytes_read / (3.35e12 * 0.8), rel=0.05)
    # prefill: time grows ~linearly in tokens (compute bound) once all experts are touched
    t4k, t8k = m.step_time([(4096, 0)]), m.step_time([(8192, 0)])
    assert 1.8 < t8k / t4k < 2.6
    # attention over a long context makes a chunk slower than the same chunk at the start
    assert m.step_time([(2048, 100_000)]) > 1.5 * m.step_time([(2048, 0)])


def test_more_work_never_takes_less_time():
    m = StepTimeModel(OSS, get_gpu("h100"))
    base = [(1, 2000)] * 8
    t = m.step_time(base)
    assert m.step_time(base + [(1, 2000)]) >= t
    assert m.step_time(base + [(512, 0)]) > t
    assert m.step_time([(1, 4000)] * 8) >= t
    assert m.step_time([]) == 0.0
    assert m.step_time([BatchEntry(1, 2000)] * 8) == t


def test_faster_memory_means_faster_decode():
    h100, h200 = (StepTimeModel(QWEN, get_gpu(g)) for g in ("h100", "h200"))
    assert h200.decode_step(32, 8000) < h100.decode_step(32, 8000)
    # same compute: a big prefill takes about as long on both
    assert h200.step_time([(8192, 0)]) == pytest.approx(h100.step_time([(8192, 0)]), rel=0.1)


def test_moe_experts_touched_saturate():
    m = StepTimeModel(QWEN, get_gpu("h100"))
    # weight traffic of the experts stops growing once every expert is touched
    d64, d256 = m.breakdown([(1, 0)] * 64), m.breakdown([(1, 0)] * 256)
    assert d256.mlp < 1.5 * d64.mlp


def test_sliding_window_layers_cap_the_attention_cost():
    m = StepTimeModel(OSS, get_gpu("h100"))
    full = StepTimeModel(dataclasses.replace(OSS, sliding_layers=0, sliding_window=None),
                         get_gpu("h100"))
    assert m.breakdown([(1, 100_000)]).attention < full.breakdown([(1, 100_000)]).attention


def test_kv_capacity_follows_memory_minus_weights():
    cap = {g: StepTimeModel(QWEN, get_gpu(g)).kv_capacity_tokens()
           for g in ("h100", "h100-nvl", "h200")}
    assert 0 < cap["h100"] < cap["h100-nvl"] < cap["h200"]
    assert StepTimeModel(QWEN.with_kv_bytes(1), get_gpu("h100")).kv_capacity_tokens() \
        == pytest.approx(2 * cap["h100"], rel=0.001)


def test_coefficients_are_checked():
    with pytest.raises(ValueError):
        StepCoefficients(gemm_efficiency=0.0)
    with pytest.raises(ValueError):
        StepCoefficients(step_overhead_s=-1)
    with pytest.raises(ValueError):
        get_gpu("a100")


@pytest.mark.parametrize("model", [QWEN, OSS], ids=["moe", "sliding"])
def test_steps_priced_together_cost_what_each_costs_alone(model):
    """The calibration fit prices all its samples at once (``StepWork.stack``); the formula
    over arrays must give each step exactly its own time, with the occupancy and cache
    terms on, for MoE and sliding-window models."""
    import random

    from mars.emulate import StepWork

    rng = random.Random(3)
    coefs = [StepCoefficients(),
             StepCoefficients(attention_parallelism=64.0, attention_occupancy_exponent=0.7,
                              cache_bytes=32 * 2**20, cache_bandwidth_ratio=4.0)]
    for coef in coefs:
        m = StepTimeModel(model, get_gpu("h100"), coef)
        works = [m.work([(rng.choice([1, 1, 7, 512, 2048]), rng.randrange(0, 60_000))
                         for _ in range(rng.randrange(1, 9))]) for _ in range(200)]
        together = m.time_of(StepWork.stack(works))
        for i, w in enumerate(works):
            alone = m.time_of(w)
            for part in ("projections", "mlp", "attention", "logits", "overhead"):
                assert getattr(together, part)[i] == pytest.approx(getattr(alone, part),
                                                                   rel=1e-12)
    with pytest.raises(ValueError, match="compute tokens"):
        StepWork.stack([m.work([(0, 10)])])
