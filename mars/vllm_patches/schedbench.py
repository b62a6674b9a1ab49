"""Benchmark (not a test): what the mars hooks add to vLLM's ``schedule()`` step.

    .venv/bin/python experiments/bench_scheduler.py [--running 16,64,256] [--steps 2000]

Builds the real vLLM ``Scheduler`` and KV-cache manager (no model, no workers) on the
embedded tiny model's config -- block size 32, prefix caching on, one full-attention group --
and drives it with synthetic model outputs: after every ``schedule()``, ``update_from_output``
gets one sampled token for each scheduled request that finished its prefill (an empty list
for a partial prefill chunk, as the model runner reports it). The same deterministic agent-like
workload runs on every configuration:

* ``N`` slots, each running a *job* of ``--job-rounds`` rounds: round 0 is a fresh
  ``--prompt-tokens`` prompt, every later round is the previous round's full context plus
  ``--turn-tokens`` new tokens (a tool result), so it mostly hits the prefix cache, as agent
  rounds do. Output lengths are drawn from ``--output-tokens`` (``ignore_eos``).
  Requests carry ``extra_args={"job_id", "round", "last_round"}`` like the sidecar's.
* A finished request is replaced at once by its job's next round (or a new job), as the
  EngineCore would add it between steps, so the running set stays at ``N``.

Configurations: ``stock`` (``vllm.v1.core.sched.scheduler.Scheduler``), ``fcfs`` (mars
scheduler, policy ``fcfs``: hooks and events only), ``mars`` (policy ``mars``, default
``tick_s``) and ``mars-tick0`` (policy ``mars`` with ``tick_s=0``: keys refreshed on every
step, which is the regime of a real engine whose steps take longer than ``tick_s``; here the
synthetic steps take well under a millisecond, so with the default tick the O(N) refresh is
amortised over many steps).

Only ``schedule()`` is in the headline timing (``perf_counter_ns`` around the call);
``update_from_output`` and ``add_request`` are timed separately. All configurations live in one
process and run in interleaved rounds (the order rotates every round) so machine noise hits
all of them alike; the mars event publishers are drained between rounds, outside the timed
region, so one configuration's telemetry thread does not run inside another's round (each
mars configuration's own publisher thread does run during its own rounds, as in production).
Python's cyclic collector is off inside a round and run between rounds, so a collection of the
shared heap is not charged to whichever configuration is running when it triggers.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

CONFIGS: tuple[str, ...] = ("stock", "fcfs", "mars", "mars-tick0")

#: what each configuration passes as ``additional_config["mars"]`` (``None``: stock vLLM)
_MARS_SETTINGS: dict[str, dict[str, Any] | None] = {
    "stock": None,
    "fcfs": {"policy": "fcfs"},
    "mars": {"policy": "mars"},
    "mars-tick0": {"policy": "mars", "tick_s": 0.0},
}

BLOCK_SIZE = 32
_VOCAB_LO, _VOCAB_HI = 16, 4000  # stay clear of the tiny model's special tokens


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int = 512
    turn_tokens: int = 64
    min_output: int = 16
    max_output: int = 128
    job_rounds: int = 4
    seed: int = 0

    def max_context(self) -> int:
        return self.prompt_tokens + self.job_rounds * (self.turn_tokens + self.max_output)


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


# --------------------------------------------------------------------------- set-up
def _model_dir() -> str:
    from mars.model.tiny import default_model_dir, write_tiny_model

    return str(write_tiny_model(default_model_dir()))


def build_vllm_config(config: str, running: int, *, model_config=None,
                      max_num_batched_tokens: int = 2048, tick_s: float | None = None):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = model_config or ModelConfig(model=_model_dir(), max_model_len=16384,
                                     dtype="bfloat16", seed=0)
    sc = SchedulerConfig(
        max_num_seqs=running, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=mc.max_model_len, enable_chunked_prefill=True,
        is_encoder_decoder=False, async_scheduling=False)
    cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    settings = _MARS_SETTINGS[config]
    extra: dict[str, Any] = {}
    if settings is not None:
        mars = {"events_endpoint": None, "events_file": None, "tick_s": 0.05,
                "policy_config": {}, **settings}
        if tick_s is not None and config != "mars-tick0":
            mars["tick_s"] = tick_s
        extra["mars"] = mars
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                      additional_config=extra)


def build_scheduler(config: str, vllm_config, num_blocks: int, *, log_stats: bool = True):
    """The scheduler as EngineCore builds it, on a KV config with ``num_blocks`` blocks."""
    import torch
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = vllm_config.model_config
    spec = FullAttentionSpec(block_size=BLOCK_SIZE,
                             num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
                             head_size=mc.get_head_size(), dtype=torch.bfloat16)
    layers = [f"model.layers.{i}.self_attn.attn"
              for i in range(mc.get_num_layers(vllm_config.parallel_config))]
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, vllm_config)
    kv.hash_block_size = hash_block_size
    vllm_config.cache_config.num_gpu_blocks = num_blocks  # as EngineCore sets it
    kwargs = dict(vllm_config=vllm_config, kv_cache_config=kv,
                  structured_output_manager=StructuredOutputManager(vllm_config),
                  block_size=block_size, hash_block_size=hash_block_size,
                  log_stats=log_stats)
    if _MARS_SETTINGS[config] is None:
        return Scheduler(**kwargs), hash_block_size
    from mars.vllm_patches.scheduler import make_scheduler

    return make_scheduler(**kwargs), hash_block_size


def _block_hasher(vllm_config, hash_block_size: int):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    return get_request_block_hasher(hash_block_size, fn)


# --------------------------------------------------------------------------- driver
class Driver:
    """One scheduler plus its workload; ``step()`` runs one engine step."""

    def __init__(self, config: str, running: int, workload: Workload, *, model_config=None,
                 max_num_batched_tokens: int = 2048, num_blocks: int | None = None,
                 log_stats: bool = True, tick_s: float | None = None,
                 events_file: str | None = None) -> None:
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.sampling_params import SamplingParams

        self._Request, self._SamplingParams = Request, SamplingParams
        self._ModelRunnerOutput = ModelRunnerOutput
        self.config, self.running, self.wl = config, running, workload
        if num_blocks is None:
            per_req = math.ceil(workload.max_context() / BLOCK_SIZE) + 2
            num_blocks = running * per_req * 2 + 256
        self.vllm_config = build_vllm_config(
            config, running, model_config=model_config,
            max_num_batched_tokens=max_num_batched_tokens, tick_s=tick_s)
        if events_file and "mars" in self.vllm_config.additional_config:
            self.vllm_config.additional_config["mars"]["events_file"] = events_file
        self.sched, hbs = build_scheduler(config, self.vllm_config, num_blocks,
                                          log_stats=log_stats)
        self._hasher = _block_hasher(self.vllm_config, hbs)
        self._serial = 0
        self._jobs = [0] * running           # job number per slot
        self._slot_of: dict[str, int] = {}   # live request id -> slot
        self._reqs: dict[str, Any] = {}      # live request id -> Request
        self.schedule_ns: list[int] = []      # wall clock (perf_counter_ns)
        self.schedule_cpu_ns: list[int] = []  # this thread's CPU time (thread_time_ns)
        self.update_ns: list[int] = []
        self.update_cpu_ns: list[int] = []
        self.add_ns: list[int] = []
        self.running_samples: list[int] = []
        self.waiting_samples: list[int] = []
        self.tokens_samples: list[int] = []
        self.finished = 0
        for slot in range(running):
            self._submit(slot, 0, None, record=False)

    @property
    def model_config(self):
        return self.vllm_config.model_config

    def _rng(self, slot: int, job: int, rnd: int) -> random.Random:
        return random.Random(f"{self.wl.seed}:{slot}:{job}:{rnd}")

    def _submit(self, slot: int, rnd: int, context: list[int] | None, *, record: bool) -> None:
        wl = self.wl
        job = self._jobs[slot]
        rng = self._rng(slot, job, rnd)
        if context is None:
            prompt = [rng.randrange(_VOCAB_LO, _VOCAB_HI) for _ in range(wl.prompt_tokens)]
        else:
            prompt = context + [rng.randrange(_VOCAB_LO, _VOCAB_HI)
                                for _ in range(wl.turn_tokens)]
        last = rnd >= wl.job_rounds - 1
        sp = self._SamplingParams(
            max_tokens=rng.randint(wl.min_output, wl.max_output), ignore_eos=True,
            extra_args={"job_id": f"job-{slot}-{job}", "round": rnd, "last_round": last})
        self._serial += 1
        rid = f"{self.config}-{self._serial}-s{slot}j{job}r{rnd}"
        req = self._Request(rid, prompt, sp, None, block_hasher=self._hasher)
        req._bench_slot_round = (slot, rnd)  # type: ignore[attr-defined]
        self._slot_of[rid] = slot
        self._reqs[rid] = req
        t0 = time.perf_counter_ns()
        self.sched.add_request(req)
        dt = time.perf_counter_ns() - t0
        if record:
            self.add_ns.append(dt)

    def _model_output(self, out):
        reqs = self._reqs
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in req_ids:
            r = reqs[rid]
            if r.is_prefill_chunk:
                sampled.append([])
            else:  # deterministic "sampled" token
                sampled.append([_VOCAB_LO + (r.num_tokens * 2654435761 + len(rid))
                                % (_VOCAB_HI - _VOCAB_LO)])
        return self._ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled)

    def step(self, record: bool = True) -> None:
        sched = self.sched
        wall, cpu = time.perf_counter_ns, time.thread_time_ns
        t0 = wall()
        c0 = cpu()
        out = sched.schedule()
        c1 = cpu()
        t1 = wall()
        mro = self._model_output(out)
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
        done = []
        for outs in eco.values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    done.append(o.request_id)
        for rid in done:
            req = self._reqs.pop(rid)
            slot = self._slot_of.pop(rid)
            self.finished += 1
            _, rnd = req._bench_slot_round
            if rnd + 1 >= self.wl.job_rounds:
                self._jobs[slot] += 1
                self._submit(slot, 0, None, record=record)
            else:
                self._submit(slot, rnd + 1, list(req.all_token_ids), record=record)

    def drain_events(self) -> None:
        pub = getattr(self.sched, "mars_events", None)
        if pub is not None:
            pub._drain()

    def result(self) -> Result:
        counters = dict(getattr(self.sched, "mars_counters", {}) or {})
        n = len(self.running_samples) or 1
        return Result(
            config=self.config, running=self.running,
            schedule=Stats.of(self.schedule_ns), schedule_cpu=Stats.of(self.schedule_cpu_ns),
            update=Stats.of(self.update_ns), update_cpu=Stats.of(self.update_cpu_ns),
            add_request=Stats.of(self.add_ns),
            avg_running=sum(self.running_samples) / n,
            avg_waiting=sum(self.waiting_samples) / n,
            avg_scheduled_tokens=sum(self.tokens_samples) / n,
            finished=self.finished, preempted=counters.get("preempted", 0),
            counters=counters)

    def close(self) -> None:
        try:
            self.sched.shutdown()
        except Exception:  # pragma: no cover - best effort
            pass


# --------------------------------------------------------------------------- run
def run(running: list[int], *, steps: int = 2000, warmup: int = 300, rounds: int = 10,
        configs: tuple[str, ...] = CONFIGS, workload: Workload = Workload(),
        max_num_batched_tokens: int = 2048, log_stats: bool = True,
        tick_s: float | None = None, keep_drivers: bool = False,
        progress=None) -> tuple[list[Result], dict[int, dict[str, Driver]]]:
    """Interleaved A/B rounds per ``N``; returns the results (and the drivers if asked)."""
    for c in configs:
        if c not in _MARS_SETTINGS:
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
    command = " ".join([prog or "python -m mars.vllm_patches.schedbench",
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
    sys.exit(main())
