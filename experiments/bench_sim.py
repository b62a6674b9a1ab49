"""How fast does ``mars sim`` run? Simulated seconds per wall second at N running requests.

For each N, one simulator engine (vLLM's EngineCore with the policy's scheduler on the emulated
GPU, virtual clock) gets N concurrent long decodes of a ``--prompt``-token prompt each; after a
warm-up (every prompt prefilled), ``--steps`` decode steps are timed. Printed per N: the modeled
step time, the wall time per step (everything the simulator runs for real: vLLM's scheduler
and KV manager, our scheduler hooks, the emulated worker, the step-time model), and their ratio
(simulated seconds per wall second: above 1, the simulator is faster than the real GPU).

    .venv/bin/python experiments/bench_sim.py --running 16,64,256 --policy mars --prompt 500 --steps 300
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from mars.sim.clock import VirtualClock
from mars.engine.harness.sim_engine import SimEngine


def measure(n: int, args) -> tuple[float, float]:
    clock = VirtualClock(0.0)
    eng = SimEngine(f"{args.gpu}:{args.model}", args.policy, clock=clock, sink=lambda ev: None,
                    extra_args=("--max-num-seqs", str(max(n, 256))))
    try:
        need = n * (args.prompt + args.steps * 2)
        cap = eng.num_blocks * eng.block_size
        if need > cap:
            raise SystemExit(f"{n} x ({args.prompt} + {args.steps * 2}) tokens do not fit the "
                             f"pool's {cap:,} tokens: lower --prompt or --steps")
        for i in range(n):
            prompt = [100 + (i * 7 + j) % 800 for j in range(args.prompt)]
            eng.add(f"r{i}", prompt, args.steps * 2, {"job_id": f"s{i}", "round": 0})
        while sum(1 for r in eng.scheduler.running if r.num_output_tokens > 0) < n:
            eng.step()
        t0, v0 = time.perf_counter(), clock()
        for _ in range(args.steps):
            eng.step()
        wall, virt = time.perf_counter() - t0, clock() - v0
        assert len(eng.scheduler.running) == n
        return wall / args.steps, virt / args.steps
    finally:
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="h100-nvl")
    ap.add_argument("--model", default="qwen3-coder-30b-a3b")
    ap.add_argument("--policy", default="mars")
    ap.add_argument("--running", default="16,64,256")
    ap.add_argument("--prompt", type=int, default=500)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    print(f"EMULATED GPU {args.gpu} x {args.model}, policy {args.policy}, {args.prompt}-token "
          f"prompts, {args.steps} decode steps\n")
    print("| running | modeled step (ms) | wall per step (ms) | simulated s per wall s |")
    print("|---:|---:|---:|---:|")
    for n in (int(x) for x in args.running.split(",")):
        wall, virt = measure(n, args)
        print(f"| {n} | {virt * 1e3:.2f} | {wall * 1e3:.3f} | {virt / wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
