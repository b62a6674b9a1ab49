"""Fitting a GPU profile to operator timings: the PyTorch timing harness (run here on the CPU,
on a small model's shapes) and the fit (checked on timings the step-time model itself made,
with known efficiencies, so a fit that cannot find them fails)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from mars.cli import main
from mars.emulate.op_fit import OpPredictor, OpTiming, OpTimings, fit_op_efficiencies
from mars.emulate.op_grid import FORMAT, OpGrid
from mars.emulate.specs import get_gpu, get_model
from mars.emulate.step_time import StepCoefficients

SMALL_MOE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
             "num_key_value_heads": 2, "head_dim": 32, "moe_intermediate_size": 128,
             "num_experts": 16, "num_experts_per_tok": 4, "vocab_size": 8192,
             "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def _synthetic(model_name: str, gpu_name: str, coef: StepCoefficients,
               dtype_bytes: float = 2.0) -> OpTimings:
    """The default grid's timings as the step-time model with ``coef`` predicts them, each
    off by a deterministic -4..+4 % (a measurement's noise)."""
    model, gpu, g = get_model(model_name), get_gpu(gpu_name), OpGrid()
    recs = [OpTiming("projections", 1.0, tokens=t) for t in g.tokens]
    recs += [OpTiming("moe", 1.0, tokens=t) for t in g.tokens] if model.num_experts else []
    recs += [OpTiming("attention", 1.0, requests=b, new=n, context=c)
             for b, n, c in g.attention_points(model.max_model_len)]
    recs += [OpTiming("logits", 1.0, requests=r) for r in g.logits_requests]
    pred = OpPredictor(model, gpu, dtype_bytes).predict(coef, recs)
    noisy = [replace(r, seconds=p * (1 + 0.04 * math.sin(7.0 * i)))
             for i, (r, p) in enumerate(zip(recs, pred))]
    return OpTimings(model, dtype_bytes, tuple(noisy))


@pytest.mark.parametrize("model", ["qwen3-coder-30b-a3b", "gpt-oss-120b"])
def test_the_fit_finds_the_efficiencies_its_timings_were_made_with(model):
    truth = StepCoefficients(gemm_efficiency=0.72, moe_efficiency=0.31,
                             attention_efficiency=0.44, memory_efficiency=0.66)
    timings = _synthetic(model, "h100", truth)
    fit = fit_op_efficiencies(timings, get_gpu("h100"))
    for k in fit.fitted:
        assert getattr(fit.coefficients, k) == pytest.approx(getattr(truth, k), rel=0.05), k
    assert set(fit.fitted) == {"gemm_efficiency", "moe_efficiency", "attention_efficiency",
                               "memory_efficiency"}
    # the noise is all that is left; the shipped coefficients are further off
    for op, e in fit.errors.items():
        assert e["mean"] < 0.04, op
        assert fit.errors_before[op]["mean"] > e["mean"], op
    # fixed overheads are host-side work no kernel timing sees: kept as shipped
    assert fit.coefficients.step_overhead_s == StepCoefficients().step_overhead_s
    cfg = fit.emulate_config()["coefficients"]
    assert set(cfg) == set(fit.fitted) and all(0 < v <= 1 for v in cfg.values())


def test_a_dense_model_keeps_the_shipped_moe_efficiency_and_efficiencies_stay_at_most_1():
    dense = replace(get_model("qwen3-coder-30b-a3b"), name="dense", num_experts=0,
                    experts_per_token=0, expert_intermediate=0, dense_intermediate=6144)
    gpu = get_gpu("h200")
    g = OpGrid()
    recs = [OpTiming("projections", 1.0, tokens=t) for t in g.tokens]
    recs += [OpTiming("logits", 1.0, requests=r) for r in g.logits_requests]
    recs += [OpTiming("attention", 1.0, requests=b, new=1, context=4096) for b in (1, 64)]
    # faster than the card's peaks can explain: the fit says so by stopping at 1
    fast = StepCoefficients(gemm_efficiency=1.0, memory_efficiency=1.0,
                            attention_efficiency=1.0)
    pred = OpPredictor(dense, gpu, 2.0).predict(fast, recs)
    timings = OpTimings(dense, 2.0, tuple(replace(r, seconds=p / 1.5)
                                          for r, p in zip(recs, pred)))
    fit = fit_op_efficiencies(timings, gpu)
    # nothing timed depends on the experts, nor on attention compute (decodes only:
    # memory-bound): both stay shipped rather than fitted to nothing
    assert set(fit.kept) == {"moe_efficiency", "attention_efficiency"}
    shipped = StepCoefficients()
    assert fit.coefficients.moe_efficiency == shipped.moe_efficiency
    assert fit.coefficients.attention_efficiency == shipped.attention_efficiency
    assert fit.coefficients.gemm_efficiency == 1.0
    assert fit.coefficients.memory_efficiency == 1.0
    assert set(fit.emulate_config()["coefficients"]) == {"gemm_efficiency",
                                                         "memory_efficiency"}


def test_the_gpu_profile_follows_the_timed_device():
    from mars.cli.emulate import gpu_for_device

    assert gpu_for_device("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_for_device("NVIDIA H100 NVL") == "h100-nvl"
    assert gpu_for_device("NVIDIA H200") == "h200"
    assert gpu_for_device("NVIDIA H200 NVL") == "h200-nvl"
    assert gpu_for_device("NVIDIA A100-SXM4-80GB") is None


def test_expanded_kv_heads_are_priced_with_the_bytes_they_moved():
    model, gpu = get_model("qwen3-coder-30b-a3b"), get_gpu("h100")
    p = OpPredictor(model, gpu, 2.0)
    native = OpTiming("attention", 1.0, requests=64, new=1, context=32768, gqa=True)
    expanded = replace(native, gqa=False)
    a, b = p.predict(StepCoefficients(), [native, expanded])
    # a decode batch is memory-bound: 8x the K/V heads read, 8x the time
    assert b / a == pytest.approx(model.num_heads / model.num_kv_heads, rel=0.01)


def test_op_timing_on_this_cpu_times_every_operator_and_the_fit_reads_it(tmp_path, capsys):
    """The real PyTorch harness, on a small MoE model's shapes (seconds on this CPU)."""
    cfg = tmp_path / "small-moe.json"
    cfg.write_text(json.dumps(SMALL_MOE))
    out = tmp_path / "ops.json"
    assert main(["emulate", "time-ops", "--model", str(cfg), "--device", "cpu", "--quick",
                 "--dtype", "float32", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["format"] == FORMAT and data["dtype_bytes"] == 4
    assert data["model"] == "small-moe" and data["peaks"]["gemm_flops"] > 0
    ops = {r["op"] for r in data["records"]}
    assert ops == {"projections", "moe", "attention", "logits", "layer"}
    assert data["peaks"]["eager"] is True  # peaks never under graph capture
    assert data["graphs_fell_back"] is None  # no capture on a CPU, so none given up
    # every attention point records the kernel kept; a chunk over a cache also tried the
    # flash split (cache + chunk merged by log-sum-exp), on this CPU too
    kernels = {(r["new"], r["context"]): r["kernel"] for r in data["records"]
               if r["op"] == "attention"}
    assert set(kernels.values()) <= {"sdpa", "split"} and all(kernels.values())
    # the whole layers: every shape of the quick grid (the check of the operators' sum)
    layers = [r for r in data["records"] if r["op"] == "layer"]
    assert [(r["requests"], r["new"], r["context"]) for r in layers] == \
        list(OpGrid.quick().layers)
    ops = ops - {"layer"}
    g = OpGrid.quick()
    att = [(r["requests"], r["new"], r["context"]) for r in data["records"]
           if r["op"] == "attention"]
    assert att == g.attention_points(SMALL_MOE["max_position_embeddings"])
    assert all(r["seconds"] > 0 for r in data["records"])
    timings = OpTimings.load(out)
    assert timings.model.num_experts == 16 and timings.dtype_bytes == 4
    fit_path = tmp_path / "fit.json"
    assert main(["emulate", "fit-ops", str(out), "--gpu", "measured",
                 "--out", str(fit_path)]) == 0
    fit = json.loads(fit_path.read_text())
    assert set(fit["abs_relative_error"]) == ops
    assert fit["device"]["type"] == "cpu"
    # a CPU matches no shipped GPU profile: fit-ops says to name one
    with pytest.raises(SystemExit, match="--gpu"):
        main(["emulate", "fit-ops", str(out)])
    # a run cut short (the harness checkpoints after every operator) still fits, with a
    # warning
    data["complete"] = False
    data["records"] = [r for r in data["records"] if r["op"] != "logits"]
    out.write_text(json.dumps(data))
    assert main(["emulate", "fit-ops", str(out), "--gpu", "measured"]) == 0
    assert "cut short" in capsys.readouterr().err


def test_the_split_attention_computes_what_the_masked_one_does(tmp_path):
    """The flash split the harness times for a chunk over a cache (cache and chunk apart,
    merged by log-sum-exp) is the same attention as the masked kernel's: a faster time for
    it is a faster way to the same result."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention.bias import causal_lower_right

    from mars.emulate.op_grid import load_model
    from mars.emulate.op_timing import OpTimer

    cfg = tmp_path / "small-moe.json"
    cfg.write_text(json.dumps(SMALL_MOE))
    timer = OpTimer(load_model(str(cfg)), "cpu", "float32", OpGrid.quick())
    m = timer.model
    new, ctx, rep = 48, 200, m.num_heads // m.num_kv_heads
    q = timer._rand(1, m.num_heads, new, m.head_dim) * 50
    k, v = (timer._rand(1, m.num_kv_heads, ctx + new, m.head_dim) * 50 for _ in range(2))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(new, ctx + new), enable_gqa=True)
    got = timer.split_attention_fn(q, (k, v), ctx, rep)(0)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4


def test_the_expanded_kv_fallback_runs_and_is_recorded(tmp_path):
    pytest.importorskip("torch")
    from mars.emulate.op_grid import load_model
    from mars.emulate.op_timing import OpTimer

    cfg = tmp_path / "small-moe.json"
    cfg.write_text(json.dumps(SMALL_MOE))
    timer = OpTimer(load_model(str(cfg)), "cpu", "float32", OpGrid.quick())
    timer.force_expanded = True  # as when the backend has no grouped-query path
    s, gqa = timer.attention(2, 1, 256)
    assert s > 0 and gqa is False


@pytest.mark.parametrize("model", ["qwen3-coder-30b-a3b", "gpt-oss-120b"])
def test_the_default_grid_fits_a_lent_h100(model):
    """The grid run on a GPU: its largest operand set (BF16, rotated copies past a 50 MB
    L2) leaves most of an 80 GB H100 free, and it reaches the paper's contexts."""
    from mars.emulate.op_grid import largest_operands

    m, g = get_model(model), OpGrid()
    assert largest_operands(m, g, 2, cache_bytes=50 * 2**20) < 16 * 2**30
    ctx = [c for _, n, c in g.attention_points(m.max_model_len) if n == 1]
    # the model's whole context (gpt-oss: 131072 positions, taken at 131071)
    assert max(ctx) == min(131072, m.max_model_len - 1) and min(ctx) <= 1024


def test_the_timing_and_fit_modules_import_without_torch():
    """The fit runs where torch is not installed; the harness travels to a GPU machine that
    has PyTorch alone (it imports torch only when timing starts)."""
    code = ("import sys, mars.emulate.op_fit, mars.emulate.op_timing; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("mutate,msg", [
    (lambda d: d.update(format="x"), "not operator timings"),
    (lambda d: d["records"][0].update(seconds=-1), "positive"),
    (lambda d: d["records"][0].update(op="softmax"), "unknown operator"),
    (lambda d: d.pop("model_spec"), "lack 'model_spec'"),
    (lambda d: d["records"].clear(), "no records"),
])
def test_bad_timings_are_a_clear_error(tmp_path, mutate, msg):
    model = get_model("qwen3-coder-30b-a3b")
    from dataclasses import asdict

    d = {"format": FORMAT, "model_spec": asdict(model), "dtype_bytes": 2,
         "records": [{"op": "projections", "tokens": 1, "seconds": 1e-5}]}
    mutate(d)
    p = tmp_path / "t.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=msg):
        OpTimings.load(p)
    with pytest.raises(SystemExit, match="fit-ops"):
        main(["emulate", "fit-ops", str(p), "--gpu", "h100"])


def test_time_ops_refuses_bad_arguments(tmp_path):
    with pytest.raises(SystemExit, match="unknown model"):
        main(["emulate", "time-ops", "--model", "llama", "--device", "cpu",
              "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match=".json"):
        main(["emulate", "time-ops", "--model", "gpt-oss-120b", "--out", str(tmp_path / "x")])
