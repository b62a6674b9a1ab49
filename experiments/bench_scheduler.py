"""Benchmark (not a test): what the mars hooks add to vLLM's ``schedule()`` step.

    .venv/bin/python experiments/bench_scheduler.py [--running 16,64,256] [--steps 2000]
                                                    [--configs stock,fcfs,mars,mars-tick0]
                                                    [--json out.json]

No model and no server: the offline engine (:mod:`mars.engine.harness.offline`: the real
``vllm.v1.core.sched.scheduler.Scheduler`` and KV-cache manager, and the mars schedulers built
by ``make_scheduler``) driven with synthetic model outputs, with ``N`` requests kept running
by a closed agent-like loop (:class:`~mars.engine.harness.offline.AgentLoop`: multi-round jobs
whose later rounds extend the previous context, so they mostly hit the prefix cache).

Configurations: ``stock`` (vLLM's ``Scheduler``), ``fcfs`` (mars scheduler, policy ``fcfs``:
hooks and events only), ``mars`` (policy ``mars``, default ``tick_s``) and ``mars-tick0``
(policy ``mars`` with ``tick_s=0``: keys refreshed on every step, the regime of a real engine
whose steps take longer than ``tick_s``; here the synthetic steps take well under a
millisecond, so with the default tick the refresh is amortised over many steps).

Only ``schedule()`` is in the headline timing; ``update_from_output`` and ``add_request`` are
timed separately. All configurations live in one process and run in interleaved rounds (the
order rotates every round) so machine noise hits all of them alike; the mars event publishers
are drained between rounds, outside the timed region. Python's cyclic collector is off inside
a round and run between rounds, so a collection of the shared heap is not charged to whichever
configuration is running when it triggers. Prints markdown tables and the load average.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mars.engine.harness.offline import (  # noqa: E402
    AgentLoop, AgentLoopDriver, OfflineEngine, default_num_blocks)

CONFIGS: tuple[str, ...] = ("stock", "fcfs", "mars", "mars-tick0")

#: (policy, mars settings) per configuration (policy None: stock vLLM)
_SETTINGS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "stock": (None, {}),
    "fcfs": ("fcfs", {}),
    "mars": ("mars", {}),
    "mars-tick0": ("mars", {"tick_s": 0.0}),
}
Workload = AgentLoop


@dataclass
class Stats:
    median_us: float
    mean_us: float
    p99_us: float
    n: int

    @classmethod
    def of(cls, ns: list[int]) -> "Stats":
        if not ns:
            return cls(0.0, 0.0, 0.0, 0)
        s = sorted(ns)
        return cls(statistics.median(s) / 1e3, statistics.fmean(s) / 1e3,
                   s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))] / 1e3, len(s))


@dataclass
class Result:
    config: str
    running: int
    schedule: Stats
    schedule_cpu: Stats
    update: Stats
    update_cpu: Stats
    add_request: Stats
    avg_running: float
    avg_waiting: float
    avg_scheduled_tokens: float
    finished: int
    preempted: int
    counters: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- driver
class Driver:
    """One configuration: an offline engine on the wall clock, its agent loop, timings."""

    def __init__(self, config: str, running: int, workload: AgentLoop, *, model_config=None,
                 max_num_batched_tokens: int = 2048, num_blocks: int | None = None,
                 log_stats: bool = True, tick_s: float | None = None) -> None:
        policy, mars = _SETTINGS[config]
        mars = dict(mars)
        if tick_s is not None and config != "mars-tick0":
            mars["tick_s"] = tick_s
        self.config, self.running, self.wl = config, running, workload
        self.engine = OfflineEngine(
            policy, num_blocks=num_blocks or default_num_blocks(running, workload),
            max_num_seqs=running, max_num_batched_tokens=max_num_batched_tokens,
            model_config=model_config, log_stats=log_stats, wall_clock=True, mars=mars)
        self.sched = self.engine.sched
        self.loop = AgentLoopDriver(self.engine, running, workload, tag=f"{config}-")
        self.loop.start()
        self.schedule_ns: list[int] = []      # wall clock (perf_counter_ns)
        self.schedule_cpu_ns: list[int] = []  # this thread's CPU time (thread_time_ns)
        self.update_ns: list[int] = []
        self.update_cpu_ns: list[int] = []
        self.running_samples: list[int] = []
        self.waiting_samples: list[int] = []
        self.tokens_samples: list[int] = []

    @property
    def model_config(self):
        return self.engine.model_config

    def step(self, record: bool = True) -> None:
        sched, engine = self.sched, self.engine
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        t0 = wall()
        c0 = cpu()
        out = sched.schedule()
        c1 = cpu()
        t1 = wall()
        mro = engine.model_output(out)
        t2 = wall()
        c2 = cpu()
        eco = sched.update_from_output(out, mro)
        c3 = cpu()
        t3 = wall()
        if record:
            self.schedule_ns.append(t1 - t0)
            self.schedule_cpu_ns.append(c1 - c0)
            self.update_ns.append(t3 - t2)
            self.update_cpu_ns.append(c3 - c2)
            self.running_samples.append(len(out.num_scheduled_tokens))
            self.waiting_samples.append(len(sched.waiting))
            self.tokens_samples.append(out.total_num_scheduled_tokens)
        self.loop.on_finished(engine.collect_finished(eco), record=record)

    def drain_events(self) -> None:
        if self.engine.is_mars:
            self.sched.mars_events._drain()

    @property
    def finished(self) -> int:
        return self.loop.finished

    def result(self) -> Result:
        counters = dict(self.sched.mars_counters) if self.engine.is_mars else {}
        n = len(self.running_samples) or 1
        return Result(
            config=self.config, running=self.running,
            schedule=Stats.of(self.schedule_ns), schedule_cpu=Stats.of(self.schedule_cpu_ns),
            update=Stats.of(self.update_ns), update_cpu=Stats.of(self.update_cpu_ns),
            add_request=Stats.of(self.loop.add_ns),
            avg_running=sum(self.running_samples) / n,
            avg_waiting=sum(self.waiting_samples) / n,
            avg_scheduled_tokens=sum(self.tokens_samples) / n,
            finished=self.finished, preempted=counters.get("preempted", 0),
            counters=counters)

    def close(self) -> None:
        self.engine.close()


# --------------------------------------------------------------------------- run
def run(running: list[int], *, steps: int = 2000, warmup: int = 300, rounds: int = 10,
        configs: tuple[str, ...] = CONFIGS, workload: Workload = Workload(),
        max_num_batched_tokens: int = 2048, log_stats: bool = True,
        tick_s: float | None = None, keep_drivers: bool = False,
        progress=None) -> tuple[list[Result], dict[int, dict[str, Driver]]]:
    """Interleaved A/B rounds per ``N``; returns the results (and the drivers if asked)."""
    for c in configs:
        if c not in _SETTINGS:
            raise ValueError(f"unknown configuration {c!r}; valid: {', '.join(CONFIGS)}")
    model_config = None
    results: list[Result] = []
    kept: dict[int, dict[str, Driver]] = {}
    rounds = max(1, min(rounds, steps))
    for n in running:
        drivers: dict[str, Driver] = {}
        for c in configs:
            d = Driver(c, n, workload, model_config=model_config,
                       max_num_batched_tokens=max_num_batched_tokens, log_stats=log_stats,
                       tick_s=tick_s)
            model_config = d.model_config
            drivers[c] = d
        gc.collect()
        gc.freeze()  # as EngineCore does after start-up: the set-up heap is not rescanned
        order = list(configs)
        # warm-up: fill the running set and mix the phases (interleaved as well)
        per = max(1, warmup // rounds) if warmup else 0
        left = warmup
        while left > 0:
            k = min(per, left)
            for c in order:
                for _ in range(k):
                    drivers[c].step(record=False)
            left -= k
        sizes = [steps // rounds + (1 if i < steps % rounds else 0) for i in range(rounds)]
        for i, k in enumerate(sizes):
            rot = order[i % len(order):] + order[:i % len(order)]
            for c in rot:
                for other in drivers.values():
                    other.drain_events()
                # the collector runs between rounds, not inside one: a full collection of a
                # heap holding every configuration's requests would land on whichever
                # configuration happened to allocate last (measured: +-10 % swings)
                gc.collect()
                gc.disable()
                try:
                    step = drivers[c].step
                    for _ in range(k):
                        step()
                finally:
                    gc.enable()
            if progress:
                progress(f"N={n}: round {i + 1}/{rounds}")
        for c in configs:
            results.append(drivers[c].result())
        if keep_drivers:
            kept[n] = drivers
        else:
            for d in drivers.values():
                d.close()
            del drivers
        gc.unfreeze()
    return results, kept


def _ratio(x: float, base: float) -> str:
    return f"{x / base:.2f}x" if base > 0 else "n/a"


def format_tables(results: list[Result], command: str | None = None) -> str:
    base = {r.running: r for r in results if r.config == "stock"}
    lines = []
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += ["`schedule()` per step, µs: wall clock (`perf_counter_ns`) and the calling "
              "thread's CPU time (`thread_time_ns`, robust to other processes on the machine)",
              "",
              "| N running | config | wall median | wall mean | wall p99 | median / stock "
              "| mean / stock | CPU median | CPU mean | CPU median / stock | CPU mean / stock "
              "| avg running | tokens/step | preempted |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def rat(x: float, y: float | None) -> str:
        return _ratio(x, y) if y is not None else "n/a"

    for r in results:
        b = base.get(r.running)
        s, c = r.schedule, r.schedule_cpu
        lines.append(
            f"| {r.running} | {r.config} | {s.median_us:.1f} | {s.mean_us:.1f} | {s.p99_us:.1f} "
            f"| {rat(s.median_us, b.schedule.median_us if b else None)} "
            f"| {rat(s.mean_us, b.schedule.mean_us if b else None)} "
            f"| {c.median_us:.1f} | {c.mean_us:.1f} "
            f"| {rat(c.median_us, b.schedule_cpu.median_us if b else None)} "
            f"| {rat(c.mean_us, b.schedule_cpu.mean_us if b else None)} "
            f"| {r.avg_running:.1f} | {r.avg_scheduled_tokens:.0f} | {r.preempted} |")
    lines += ["", "`update_from_output()` per step (wall and CPU, µs) and `add_request()` per "
              "call (wall, µs):", "",
              "| N running | config | wall median | wall mean | median / stock | CPU median "
              "| CPU mean | CPU median / stock | CPU mean / stock | add_request mean "
              "| mean / stock |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        b = base.get(r.running)
        u, c, a = r.update, r.update_cpu, r.add_request
        lines.append(
            f"| {r.running} | {r.config} | {u.median_us:.1f} | {u.mean_us:.1f} "
            f"| {rat(u.median_us, b.update.median_us if b else None)} "
            f"| {c.median_us:.1f} | {c.mean_us:.1f} "
            f"| {rat(c.median_us, b.update_cpu.median_us if b else None)} "
            f"| {rat(c.mean_us, b.update_cpu.mean_us if b else None)} "
            f"| {a.mean_us:.1f} | {rat(a.mean_us, b.add_request.mean_us if b else None)} |")
    return "\n".join(lines)


def _load() -> str:
    try:
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "load average: n/a"


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", default="16,64,256",
                    help="comma-separated running-set sizes N (default 16,64,256)")
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per config and N")
    ap.add_argument("--warmup", type=int, default=300, help="untimed steps first")
    ap.add_argument("--rounds", type=int, default=10,
                    help="interleaved rounds the timed steps are split into")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=Workload.prompt_tokens)
    ap.add_argument("--turn-tokens", type=int, default=Workload.turn_tokens)
    ap.add_argument("--output-tokens", default=f"{Workload.min_output},{Workload.max_output}",
                    help="min,max output tokens per round")
    ap.add_argument("--job-rounds", type=int, default=Workload.job_rounds)
    ap.add_argument("--tick-s", type=float, default=None,
                    help="override tick_s for fcfs/mars (mars-tick0 always uses 0)")
    ap.add_argument("--no-log-stats", action="store_true",
                    help="build the schedulers with log_stats=False (vllm serve default: on)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    lo, hi = (int(x) for x in args.output_tokens.split(","))
    wl = Workload(prompt_tokens=args.prompt_tokens, turn_tokens=args.turn_tokens,
                  min_output=lo, max_output=hi, job_rounds=args.job_rounds)
    running = [int(x) for x in args.running.split(",") if x.strip()]
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    if "stock" not in configs:
        configs = ("stock", *configs)
    logging_quiet()
    load_before = _load()
    results, _ = run(running, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                     configs=configs, workload=wl,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     log_stats=not args.no_log_stats, tick_s=args.tick_s,
                     progress=lambda m: print(m, file=sys.stderr, flush=True))
    command = " ".join([prog or "experiments/bench_scheduler.py",
                        *(argv if argv is not None else sys.argv[1:])])
    print(format_tables(results, command))
    print()
    print(f"{load_before} (before), {_load()} (after); {os.cpu_count()} CPUs; "
          f"workload {asdict(wl)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"command": command, "workload": asdict(wl),
                       "results": [asdict(r) for r in results]}, f, indent=1)
    return 0


def logging_quiet() -> None:
    import logging

    for name in ("vllm", "mars"):
        logging.getLogger(name).setLevel(logging.WARNING)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:], prog=".venv/bin/python experiments/bench_scheduler.py"))
