"""llm-d's retention finding, reproduced in this runtime (issue #35).

llm-d's agentic benchmark (llm-d/llm-d-router, ``deploy/poc/agentic-serving``, REPORT.md)
protected every main-agent turn's whole context for its predicted gap; subagent requests got
no protection. The prefix-cache hit rate fell from 93.45 % under plain LRU to 79.18 %: the
protected contexts filled the pool, and what was left to evict were the subagents'
contexts, which were about to be re-read. This scenario has that shape, small enough for a
test: a few main sessions with large contexts whose tools (waiting on subagents) last
20-30 s, and more subagent sessions with small contexts re-read every 3 s; the pool holds
the subagents' working set or the mains' contexts, not both. Each policy runs the same
trace on the EMULATED GPU in virtual time (SIMULATED); ``kv_hint`` is llm-d's rule
(:mod:`mars.policy.engine.hint`) marking the main sessions' rounds (their tool, ``task``),
``kv_hint_all`` the same rule marking every round::

    .venv/bin/python experiments/llmd_retention.py                      # pools 4000,5000,6000
    .venv/bin/python experiments/llmd_retention.py --pools 5000 --policies fcfs,kv_hint,mars

Prints one table: prefix hit rate of later rounds (token-weighted), mean and P90 task
latency, first-round TTFT, recomputed context tokens.
"""

from __future__ import annotations

import argparse
import json
import sys

GPU, MODEL = "h100-nvl", "qwen3-coder-30b-a3b"
#: the tool a main session's rounds end with (it waits on subagents): what llm-d marks
MAIN_TOOL = "task"
SUB_TOOL = "read"
#: kv_hint as llm-d ran it: the main sessions' rounds marked
HINT_MAIN = {"retention": {"tools": [MAIN_TOOL]}}
VARIANTS = {
    "kv_hint": ("kv_hint", HINT_MAIN),
    "kv_hint_all": ("kv_hint", None),
}
DEFAULT_POLICIES = "fcfs,kv_hint,kv_hint_all,mars,mars_no_ctrl,continuum,continuum_dy,infercept"


def scenario(n_main: int = 4, n_sub: int = 16, main_tokens: int = 9000,
             sub_tokens: int = 3000, main_rounds: int = 6, sub_rounds: int = 20,
             sub_gap_s: float = 3.0):
    """Main sessions (context ~9K tokens, gaps of 20-30 s) arriving first, then subagent
    sessions (~3K tokens growing to ~5K, a 3 s tool between rounds) every 0.5 s."""
    from mars.workloads.trace import Round, Task, Trace

    tasks = []
    for i in range(n_main):
        rounds = tuple(Round(64, MAIN_TOOL, 20.0 + 2.0 * ((i + k) % 6), 200, 8)
                       for k in range(main_rounds - 1)) + (Round(64),)
        tasks.append(Task(f"main{i}", float(i), 256, main_tokens, rounds))
    for j in range(n_sub):
        rounds = tuple(Round(32, SUB_TOOL, sub_gap_s, 64, 8)
                       for _ in range(sub_rounds - 1)) + (Round(32),)
        tasks.append(Task(f"sub{j}", 5.0 + 0.5 * j, 256, sub_tokens, rounds))
    return Trace.build("llmd-retention", sorted(tasks, key=lambda t: t.arrival_s),
                       params={"n_main": n_main, "n_sub": n_sub, "main_tokens": main_tokens,
                               "sub_tokens": sub_tokens, "sub_gap_s": sub_gap_s})


def run(name: str, pool_blocks: int, trace=None) -> dict:
    """One policy (or variant) on the scenario with a pool of ``pool_blocks`` blocks of 16."""
    from mars.sim.runner import SimConfig, Simulation

    policy, cfg = VARIANTS.get(name, (name, None))
    args = ["--num-gpu-blocks-override", str(pool_blocks), "--max-model-len", "32000"]
    if cfg:
        args += ["--mars-config", json.dumps(cfg)]
    sim = Simulation(SimConfig(GPU, MODEL, policy, progress=False, engine_args=tuple(args)))
    try:
        res = sim.run(trace if trace is not None else scenario(), "load", name)
        pinned = sim.engine.scheduler.mars_cosched.pins.pinned_blocks
        pins = sim.engine.scheduler.mars_counters["pinned"]
    finally:
        sim.close()
    s = res.summary
    ttft0 = next((r["mean"] for r in s["ttft_by_round"] if r["round"] == 0), float("nan"))
    return {"policy": name, "pool": pool_blocks, "done": s["tasks"].get("completed", 0),
            "tasks": s["tasks"]["total"],
            "hit": s["cached_fraction"]["later_rounds_token_weighted"],
            "mean": s["latency_s"]["mean"], "p90": s["latency_s"]["p90"], "ttft0": ttft0,
            "recomputed": s["recomputed_context_tokens"], "pins": pins,
            "pinned_at_end": pinned}


def table(rows: list[dict]) -> str:
    out = ["| pool (blocks) | policy | prefix hit, rounds ≥ 1 | vs LRU | mean (s) | P90 (s) | "
           "TTFT, round 0 (s) | recomputed (K tokens) |",
           "|---:|---|---:|---:|---:|---:|---:|---:|"]
    lru = {r["pool"]: r["hit"] for r in rows if r["policy"] == "fcfs"}
    for r in rows:
        base = lru.get(r["pool"])
        diff = round((r["hit"] - base) * 100, 2) if base is not None else None
        vs = "n/a" if diff is None else f"{diff:+.2f} pt" if diff else "±0.00 pt"
        out.append(f"| {r['pool']:,} | {r['policy']} | {r['hit']:.1%} | {vs} | {r['mean']:.1f} "
                   f"| {r['p90']:.1f} | {r['ttft0']:.2f} | {r['recomputed'] / 1e3:,.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pools", default="4000,5000,6000",
                    help="KV pool sizes in blocks of 16 tokens, comma-separated")
    ap.add_argument("--policies", default=DEFAULT_POLICIES,
                    help="policies (and kv_hint_all) comma-separated; fcfs is LRU, the "
                         "reference of the 'vs LRU' column")
    args = ap.parse_args(argv)
    try:
        pools = [int(p) for p in args.pools.split(",") if p]
    except ValueError:
        ap.error(f"--pools takes integers, got {args.pools!r}")
    if not pools or min(pools) < 1:
        ap.error("--pools needs at least one positive block count")
    from mars.policy.registry import POLICY_NAMES

    names = [p for p in args.policies.split(",") if p]
    bad = [p for p in names if p not in POLICY_NAMES and p not in VARIANTS]
    if bad or not names:
        ap.error(f"unknown policy {', '.join(bad) or '(none)'}; choose from "
                 f"{', '.join([*POLICY_NAMES, *VARIANTS])}")
    trace = scenario()
    rows = []
    for pool in pools:
        for name in names:
            rows.append(run(name, pool, trace))
            print(f"  {name} at {pool} blocks: hit {rows[-1]['hit']:.1%}, "
                  f"mean {rows[-1]['mean']:.1f} s", file=sys.stderr, flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    import os

    # the table on stdout alone: vLLM's own log lines (it logs to stdout by default) go to
    # stderr, as the other experiments' runs keep them out of their tables
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    raise SystemExit(main())
