#!/usr/bin/env bash
# Times both shipped models' operators at their real shapes on a lent GPU (PyTorch only; no
# vLLM there) over the dense grid the shipped tables use, every attention kernel PyTorch has
# (the fastest kept, and recorded), the device peaks launched eagerly, and whole decoder
# layers (the check of the operators' sum); leaves the timings in $OUT. Took 43-68 s per
# model on an H200 or H100 (2026-11-28; each model is capped at 140 s), the whole script
# 115-141 s. One call of the device tool, e.g.
#   run(command="bash scripts/device_time_ops.sh", timeout_s=420)
# then pack them (scripts/pack_gpu_tables.py) or fit the roofline to them:
# then, on any machine: mars emulate fit-ops dense-qwen3-coder-30b-a3b.json (the GPU profile
# follows the timed device's name)
# (docs/emulation.md, "Fitting a GPU profile to operator timings"). Each file is written
# after every operator class and attention point, so a run cut short keeps what it timed.
set -uo pipefail
OUT=${OUT:-runs/op-timings}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv \
    >"$OUT/nvidia-smi.csv" 2>&1 || true
rc=0
for m in qwen3-coder-30b-a3b gpt-oss-120b; do
    PYTHONUNBUFFERED=1 timeout 140 python3 -m mars.emulate.op_timing --model "$m" --dense \
        --out "$OUT/dense-$m.json" 2>"$OUT/log-$m.txt" || rc=$?
    tail -n 2 "$OUT/log-$m.txt"
done
exit $rc
