#!/usr/bin/env bash
# Times both shipped models' operators at their real shapes on a lent GPU (PyTorch only; no
# vLLM there) and leaves the timings in $OUT. One call of the device tool, e.g.
#   run(command="bash scripts/device_time_ops.sh", timeout_s=540)
# then, on any machine: mars emulate fit-ops ops-qwen3-coder-30b-a3b.json (the GPU profile
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
    PYTHONUNBUFFERED=1 timeout 240 python3 -m mars.emulate.op_timing --model "$m" \
        --out "$OUT/ops-$m.json" 2>"$OUT/log-$m.txt" || rc=$?
    tail -n 2 "$OUT/log-$m.txt"
done
exit $rc
