"""Held-out agent workloads: traces drawn from distributions the generator never uses, to check
that MARS's mechanisms carry beyond the seven regimes every policy was developed on.

The regimes (mars/workloads/generator.py) come from one task pool tilted by context size. A
mechanism can fit that pool without following the paper's reasoning, so this script writes
traces with other shapes, each a kind of agent work the paper's argument covers (long
multi-round sessions, long tool calls, bursts, short sessions), with their own distributions
(lognormals: median / sigma of ln, [truncation range]; every one is OUR CHOICE unless a source
is named):

``swe-long``
    OpenHands on SWE-rebench-like tasks: many rounds on a growing context. Rounds 48 / 0.4,
    [10, 100] (nebius/SWE-rebench-openhands-trajectories: 64.3 turns on average, at most
    100); shared prefix 7,000; task context 1,500 / 0.8, [200, 30K]; output 150 / 1.0,
    [8, 4096] (Artificial Analysis AgentPerf: median ~150 output tokens per call);
    observations 300 / 1.3, [1, 8192]; tools: 35 % CPU-bound (``terminal.run``, 1.5 s / 1.6,
    [0.05, 300] s: mean ~5 s, the SWE-agent runs' 3.4-4.6 s per step are all tools), 65 %
    light (``file_editor.view``, 0.05 s / 1.0). Context limit 131,072.
``tool-heavy``
    Build-and-test loops: few rounds on a large context, every tool a long CPU-bound test run
    (``terminal.test``, 15 s / 0.8, [1, 300] s). Rounds 8 / 0.4, [2, 30]; prefix 6,000; task
    context 30,000 / 0.6, [5K, 120K]; output 200 / 1.0; observations 800 / 1.0. Context
    limit 262,144. Where keeping a session's KV through its tool call (InferCept, Continuum)
    decides.
``burst``
    The generator's ILR-3 tasks, arriving in bursts of 16 within one second (a fleet of
    agents launched together), bursts Poisson at rate / 16. Admission under bursts.
``short``
    Short sessions: prefix 2,000, task context 600 / 0.6, [100, 4K], rounds 6 / 0.5,
    [2, 20], output 200 / 0.9, observations 150 / 1.0, light tools (0.1 s / 1.0). Little KV
    pressure and no long prefills: MARS has little to manage and must not cost anything.

Usage (writes OUT/TRACE-rate-R.jsonl for each workload and rate):

    .venv/bin/python experiments/heldout_workloads.py --out runs/heldout/traces \\
        --num-tasks 100 swe-long:0.05,0.1 tool-heavy:0.1,0.2 burst:0.12,0.24 short:1,2

then each trace with ``mars sim run --trace FILE --policies ...`` (docs/workloads.md,
*Held-out workloads*).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mars.workloads.generator import generate
from mars.workloads.trace import Round, Task, Trace, TraceHeader, write_trace


@dataclass(frozen=True, slots=True)
class LN:
    """A truncated lognormal: median, sigma of ln, [lo, hi] (redrawn, not clipped)."""

    median: float
    sigma: float
    lo: float
    hi: float

    def draw(self, rng: np.random.Generator) -> float:
        for _ in range(1000):
            x = float(rng.lognormal(np.log(self.median), self.sigma))
            if self.lo <= x <= self.hi:
                return x
        raise ValueError(f"{self} rejects every draw")


@dataclass(frozen=True, slots=True)
class Shape:
    """One held-out workload's task distribution."""

    prefix: int
    task: LN
    rounds: LN
    output: LN
    observation: LN
    cpu_share: float
    cpu_tool: str
    cpu_time: LN
    light_tool: str
    light_time: LN
    context_limit: int
    template: int = 10


SHAPES: dict[str, Shape] = {
    "swe-long": Shape(
        prefix=7000, task=LN(1500, 0.8, 200, 30_000), rounds=LN(48, 0.4, 10, 100),
        output=LN(150, 1.0, 8, 4096), observation=LN(300, 1.3, 1, 8192),
        cpu_share=0.35, cpu_tool="terminal.run", cpu_time=LN(1.5, 1.6, 0.05, 300),
        light_tool="file_editor.view", light_time=LN(0.05, 1.0, 0.001, 5),
        context_limit=131_072),
    "tool-heavy": Shape(
        prefix=6000, task=LN(30_000, 0.6, 5000, 120_000), rounds=LN(8, 0.4, 2, 30),
        output=LN(200, 1.0, 8, 4096), observation=LN(800, 1.0, 1, 8192),
        cpu_share=1.0, cpu_tool="terminal.test", cpu_time=LN(15, 0.8, 1, 300),
        light_tool="file_editor.view", light_time=LN(0.05, 1.0, 0.001, 5),
        context_limit=262_144),
    "short": Shape(
        prefix=2000, task=LN(600, 0.6, 100, 4000), rounds=LN(6, 0.5, 2, 20),
        output=LN(200, 0.9, 8, 2048), observation=LN(150, 1.0, 1, 8192),
        cpu_share=0.0, cpu_tool="terminal.run", cpu_time=LN(1, 1, 0.1, 10),
        light_tool="terminal.search", light_time=LN(0.1, 1.0, 0.001, 5),
        context_limit=131_072),
}

#: tasks arriving together in a ``burst`` and the spread of one burst's arrivals (s)
BURST_SIZE = 16
BURST_SPREAD_S = 1.0


def _task(shape: Shape, rng: np.random.Generator, task_id: str, arrival: float) -> Task:
    """Draw one task; rounds whose prompt plus output would pass the limit are cut."""
    task_tokens = int(shape.task.draw(rng))
    n = max(1, int(round(shape.rounds.draw(rng))))
    rounds: list[Round] = []
    context = shape.prefix + task_tokens
    for k in range(n):
        out = max(1, int(shape.output.draw(rng)))
        if context + out > shape.context_limit:
            break
        last = k == n - 1
        if last:
            rounds.append(Round(output_tokens=out))
            break
        cpu = rng.random() < shape.cpu_share
        tool = shape.cpu_tool if cpu else shape.light_tool
        dur = (shape.cpu_time if cpu else shape.light_time).draw(rng)
        obs = int(shape.observation.draw(rng))
        rounds.append(Round(output_tokens=out, tool=tool, tool_duration_s=round(dur, 4),
                            observation_tokens=obs, template_tokens=shape.template))
        context += out + obs + shape.template
    if not rounds:
        raise ValueError(f"{task_id}: first prompt passes the context limit")
    if rounds[-1].tool is not None:  # cut by the limit: the last round that fits ends it
        rounds[-1] = Round(output_tokens=rounds[-1].output_tokens)
    return Task(task_id=task_id, arrival_s=round(arrival, 4), prefix_tokens=shape.prefix,
                task_tokens=task_tokens, rounds=tuple(rounds))


def shaped_trace(name: str, num_tasks: int, rate: float, seed: int) -> Trace:
    shape = SHAPES[name]
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    arrivals = np.cumsum(rng.exponential(1.0 / rate, num_tasks))
    arrivals -= arrivals[0]
    tasks = tuple(_task(shape, rng, f"{name}-s{seed}-{i:05d}", float(a))
                  for i, a in enumerate(arrivals))
    params = {"workload": name, "rate": rate, "shape": repr(shape), "held_out": True}
    return Trace(TraceHeader(regime=name, num_tasks=num_tasks, seed=seed, params=params), tasks)


def burst_trace(num_tasks: int, rate: float, seed: int) -> Trace:
    """ILR-3 tasks re-timed into bursts; their content and ids are the generator's."""
    base = generate("ILR-3", num_tasks=num_tasks, rate=rate, seed=seed)
    rng = np.random.default_rng([seed, 7])
    n_bursts = -(-num_tasks // BURST_SIZE)
    starts = np.cumsum(rng.exponential(BURST_SIZE / rate, n_bursts))
    starts -= starts[0]
    arr = sorted(float(starts[i // BURST_SIZE] + rng.uniform(0, BURST_SPREAD_S))
                 for i in range(num_tasks))
    tasks = tuple(Task(task_id=f"burst-{t.task_id}", arrival_s=round(a, 4),
                       prefix_tokens=t.prefix_tokens, task_tokens=t.task_tokens,
                       rounds=t.rounds, meta=t.meta) for t, a in zip(base.tasks, arr))
    params = {"workload": "burst", "rate": rate, "burst_size": BURST_SIZE,
              "burst_spread_s": BURST_SPREAD_S, "base": "ILR-3", "held_out": True}
    return Trace(TraceHeader(regime="burst", num_tasks=num_tasks, seed=seed, params=params),
                 tasks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="+", metavar="NAME:RATES",
                    help=f"one of {', '.join([*SHAPES, 'burst'])} with comma-separated rates")
    ap.add_argument("--num-tasks", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    for spec in a.workloads:
        name, _, rates = spec.partition(":")
        if name not in SHAPES and name != "burst":
            ap.error(f"unknown workload {name!r}")
        for r in (float(x) for x in rates.split(",") if x):
            trace = (burst_trace(a.num_tasks, r, a.seed) if name == "burst"
                     else shaped_trace(name, a.num_tasks, r, a.seed))
            path = a.out / f"{name}-rate-{r:g}.jsonl"
            write_trace(trace, path)
            rounds = sum(len(t.rounds) for t in trace.tasks)
            tool = sum(x.tool_duration_s for t in trace.tasks for x in t.rounds)
            print(f"{path}: {len(trace.tasks)} tasks, {rounds / len(trace.tasks):.1f} rounds "
                  f"and {tool / len(trace.tasks):.0f} s of tools per task")
    return 0


if __name__ == "__main__":
    sys.exit(main())
