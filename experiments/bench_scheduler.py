"""``schedule()`` time per step, mars vs stock vLLM, on the real scheduler and KV manager.

    .venv/bin/python experiments/bench_scheduler.py [--running 16,64,256] [--steps 2000]
                                                    [--configs stock,fcfs,mars,mars-tick0]
                                                    [--json out.json]

No model and no server: the real ``vllm.v1.core.sched.scheduler.Scheduler`` (and the mars
schedulers built by ``make_scheduler``) driven with synthetic model outputs, with ``N``
requests kept running. Prints markdown tables (median / mean µs per step and the ratio to
stock) and the command. The harness is :mod:`mars.vllm_patches.schedbench` (it touches vLLM
internals, so it lives in the adapter package); see its docstring for the workload.

Not a test: numbers depend on the machine and on what else runs on it (the load average is
printed with the tables).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mars.vllm_patches.schedbench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], prog=".venv/bin/python experiments/bench_scheduler.py"))
