"""Measuring the real engine on this machine, step by step, for ``mars emulate calibrate``.

The engine is the one ``mars-vllm serve`` runs (built from the same arguments, embedded model,
this machine's executor with its model worker in its own process, as served), as vLLM's own
``EngineCore`` in this process. Each ``step()`` is timed
whole -- scheduling, the model, output processing -- because on this synchronous engine that is
the step's cadence; the scheduler's output for the step gives the batch it ran (for each
request, the tokens computed and the context they attend to). The grid of batches is made
with prompts alone: unique prompts of growing length (prefill chunks over growing context), N
cached contexts of C tokens each with a short tail (decodes of N requests at a context), and
a prefill added while such a batch decodes (mixed steps).

The device's "peaks" (``torch`` matmul rate in the model's dtype, tensor copy bandwidth) are
measured in the calibrating process, not in the model worker: they only set the scale the
fitted efficiencies are relative to (the fit raises a peak the engine was seen to exceed), so
the predictions do not depend on them.
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mars.emulate.fit import Measured

#: prompt ids stay clear of the embedded tokenizer's special tokens and below its vocab
_TOKEN_LO = 16


@dataclass(frozen=True)
class CalibrationGrid:
    """The batches measured. Every step run is a sample, including the prefills that set up
    a decode batch."""

    #: unique prompts, each prefilled alone (chunks of the token budget over growing context)
    prefill_prompts: tuple[int, ...] = (128, 512, 2048, 8192, 24576, 49152)
    #: decode batches: N requests, each over its own cached context of C tokens (batches
    #: whose contexts exceed a quarter of the KV pool are skipped)
    decode_batches: tuple[int, ...] = (1, 4, 16, 64, 128)
    decode_contexts: tuple[int, ...] = (256, 4096, 16384, 49152)
    #: tokens each decode runs for. The first few steps of a decode batch run 25-35 % slower
    #: than its steady state (B=1..4 at 4-16 K context on this machine: 1.4-2.4 ms over the
    #: first 6 steps, 1.1-2.0 ms from step 30 on); agent rounds decode ~10^2 tokens, so the
    #: steps sampled must be mostly steady ones. At 6 steps the profile over-predicted the
    #: served engine's decodes by ~30 % (docs/sim.md, "CPU fidelity").
    decode_steps: int = 32
    #: a prefill of P new tokens (over the same prefix) joining each decode batch
    mixed_prefills: tuple[int, ...] = (256, 1536)
    #: most context tokens a decode batch holds in all (0: up to a quarter of the KV pool)
    decode_batch_tokens: int = 0
    #: passes over the whole grid; each workload keeps its fastest pass (see run_grid)
    repeats: int = 2
    seed: int = 0

    @classmethod
    def quick(cls) -> "CalibrationGrid":
        """A small grid (about half a minute of steps here): for tests and a first look.
        Four decodes are measured up to 4 K contexts, one and two up to 16 K: on a CPU a
        prefill's attention grows with the square of its context, and caching four 16 K
        contexts took half of the grid's time (35 of 70 s a pass).

        Two decodes over 16 K each are there because agent traffic reads that much KV in a
        step (two or three calls over 8-16 K: up to 32 K tokens), twice what any other decode
        batch of the grid holds. Without them the fit priced those steps by extrapolation,
        where its cache term is free to put a cliff: 2 in 19 quick profiles predicted such
        steps 1.7-4.2x slower than the engine ran them (mean latency 37-45 % off in the
        fidelity test) while fitting every grid step within 8 % on average."""
        return cls(prefill_prompts=(256, 4096, 16384), decode_batches=(1, 2, 4),
                   decode_contexts=(256, 4096, 16384), decode_steps=24, mixed_prefills=(512,),
                   decode_batch_tokens=36864)


class MeasuredEngine:
    """vLLM's ``EngineCore`` with this machine's executor, built as ``mars-vllm serve
    --policy fcfs EXTRA`` builds it, in this process."""

    def __init__(self, extra_args: Sequence[str] = ()) -> None:
        # The executor is the served one: on CPU vLLM runs the model in a worker process
        # whose OpenMP threads are bound to the cores it does not reserve for the scheduler
        # process. An in-process executor (VLLM_ENABLE_V1_MULTIPROCESSING=0) computes on
        # every core instead and measured steps up to 2x faster than `mars-vllm serve` runs
        # them, which is what a profile must predict. Callers need a __main__ guard (the
        # worker is spawned).
        from vllm.engine.arg_utils import EngineArgs
        from vllm.sampling_params import SamplingParams
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.core import EngineCore
        from vllm.v1.executor.abstract import Executor

        from mars.engine.sched.scheduler import scheduled_batch
        from mars.engine.harness.sim_engine import engine_args_for

        self._SP, self._ECR = SamplingParams, EngineCoreRequest
        self._batch_of = scheduled_batch
        args = engine_args_for(None, "fcfs", extra_args)
        if getattr(args, "emulate", None):
            raise ValueError("calibration measures the real engine: no --emulate")
        self.served_model_name = (args.served_model_name or [args.model])[0]
        cfg = EngineArgs.from_cli_args(args).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER)
        backend = cfg.parallel_config.distributed_executor_backend
        if backend != "mp" and str(cfg.device_config.device_type) == "cpu":
            raise ValueError(
                f"the engine would run the {backend!r} executor; `mars-vllm serve` on CPU runs "
                "'mp' (unset VLLM_ENABLE_V1_MULTIPROCESSING=0 and any "
                "--distributed-executor-backend)")
        self.vllm_config = cfg
        self.core = EngineCore(cfg, Executor.get_class(cfg), log_stats=False)
        if self.core.batch_queue is not None or self.core.step_fn != self.core.step:
            # a batch queue pipelines steps: step() would not be one engine step to time
            self.core.shutdown()
            raise ValueError("calibration needs the synchronous engine loop (no async "
                             "scheduling, no pipeline parallelism)")
        self.scheduler = sched = self.core.scheduler
        self._last = None
        schedule = sched.schedule

        def recording_schedule(*a, **k):
            self._last = out = schedule(*a, **k)
            return out

        sched.schedule = recording_schedule  # instance attribute: the class is untouched
        self._n = 0
        self.vocab = self._vocab_size()

    def _vocab_size(self) -> int:
        from mars.engine.executor.emulated_executor import tokenizer_size

        mc = self.vllm_config.model_config
        return min(tokenizer_size(mc), mc.get_vocab_size())

    # ------------------------------------------------------------------ facts
    def model_config(self) -> dict[str, Any]:
        """The served model's config.json."""
        path = Path(str(self.vllm_config.model_config.model)) / "config.json"
        return json.loads(path.read_text())

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer (the pool holds kv_cache_bytes / this)."""
        mc, pc = self.vllm_config.model_config, self.vllm_config.parallel_config
        item = 1 if "fp8" in str(self.vllm_config.cache_config.cache_dtype) else \
            mc.dtype.itemsize
        return 2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size() * item

    def settings(self) -> dict[str, int]:
        c, s, m = (self.vllm_config.cache_config, self.vllm_config.scheduler_config,
                   self.vllm_config.model_config)
        kv = c.kv_cache_memory_bytes
        if not kv:
            raise ValueError("the engine's KV pool is not set in bytes (--kv-cache-memory-bytes);"
                             " calibration records the pool it measured with")
        return {"block_size": int(c.block_size),
                "max_num_batched_tokens": int(s.max_num_batched_tokens),
                "max_num_seqs": int(s.max_num_seqs), "max_model_len": int(m.max_model_len),
                "kv_cache_bytes": int(kv)}

    # ------------------------------------------------------------------ driving
    def add(self, prompt: list[int], max_tokens: int) -> None:
        self._n += 1
        sp = self._SP(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                      detokenize=False)
        req = self._ECR(request_id=f"cal-{self._n}", prompt_token_ids=list(prompt),
                        mm_features=None, sampling_params=sp, pooling_params=None,
                        arrival_time=time.time(), lora_request=None, cache_salt=None,
                        data_parallel_rank=None)
        self.core.add_request(*self.core.preprocess_add_request(req))

    @property
    def busy(self) -> bool:
        return self.scheduler.has_requests()

    def step(self) -> Measured | None:
        """One engine step, timed; None when it computed nothing."""
        t0 = time.perf_counter()
        outputs, _ = self.core.step()
        dt = time.perf_counter() - t0
        so, self._last = self._last, None
        if so is None or not so.total_num_scheduled_tokens:
            return None
        done = sum(1 for eco in outputs.values() for o in eco.outputs
                   if o.finish_reason is not None)
        batch = tuple((n, ctx) for n, ctx in self._batch_of(so))
        return Measured(batch, dt, done)

    #: steps in a row that compute nothing before the engine is declared stuck
    MAX_IDLE_STEPS = 1000

    def drain(self) -> list[Measured]:
        got, idle = [], 0
        while self.busy:
            s = self.step()
            if s is not None:
                got.append(s)
                idle = 0
            else:
                idle += 1
                if idle >= self.MAX_IDLE_STEPS:
                    raise RuntimeError("the engine has requests but schedules nothing (does "
                                       "the grid fit its KV pool and context limit?)")
        return got

    def close(self) -> None:
        self.core.shutdown()


def measure_peaks(dtype_name: str = "bfloat16", matmul_n: int = 1024,
                  copy_mib: int = 256) -> dict[str, float]:
    """This process's dense matmul rate (TFLOP/s, in the model's dtype) and copy bandwidth
    (TB/s): the 'peaks' the fitted efficiencies are relative to (best of a few repeats)."""
    import torch

    dtype = getattr(torch, dtype_name, torch.bfloat16)
    a = torch.randn(matmul_n, matmul_n).to(dtype)
    b = torch.randn(matmul_n, matmul_n).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    tflops = 2 * matmul_n ** 3 / best / 1e12
    n = copy_mib * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    tb_s = 2 * n * 4 / best / 1e12  # read + write
    return {"tflops": tflops, "tb_s": tb_s, "torch_threads": torch.get_num_threads()}


def last_level_cache_bytes() -> int:
    """The largest CPU cache the kernel reports (0 when it reports none): where the fit
    starts the step-time model's cache size."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            txt = f.read_text().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(txt[-1:], 1)
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best


def host_facts() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "hostname": platform.node(),
            "python": platform.python_version(),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return 1.0


@dataclass
class GridRun:
    """The steps kept, and how many workloads a pass measured markedly slower than another
    (timing noise of short workloads, or something else on the machine taking CPU)."""

    steps: list[Measured]
    workloads: int
    disturbed: int


#: a workload whose slowest pass took this much longer than its fastest counts as disturbed
DISTURBED_RATIO = 1.2


def run_grid(engine: MeasuredEngine, grid: CalibrationGrid,
             progress: Callable[[int, int], None] | None = None) -> GridRun:
    """Every step of the grid's workloads, after a discarded warm-up.

    The grid is run ``grid.repeats`` times over, whole pass after whole pass, and each
    workload keeps the pass in which its steps took least time in total. Timing on a shared
    machine only ever errs slow: a neighbour busy for 20 s on one of two cores measured the
    quick grid's decodes 2-4x slower, and a robust loss cannot undo a slowdown that long.
    Passes a grid apart are rarely both hit."""
    rng = random.Random(grid.seed)
    hi = engine.vocab

    def tokens(k: int) -> list[int]:
        return [rng.randrange(_TOKEN_LO, hi) for _ in range(k)]

    # warm-up: first calls of each shape pay one-off costs (allocations, kernel selection)
    for L in (64, 2048):
        engine.add(tokens(L), 8)
    engine.drain()
    for B in (1, 16):
        pre = tokens(512)
        for _ in range(B):
            engine.add(pre + tokens(32), 4)
        engine.drain()

    settings = engine.settings()
    bs = settings["block_size"]
    # the grid within what the engine can hold: prompts (and a prefix plus its mixed prefill)
    # below the context limit, decode batches within the running limit and a quarter of the pool
    top = settings["max_model_len"] - 2 * bs - max(grid.mixed_prefills, default=0) - 16
    pool_tokens = settings["kv_cache_bytes"] // max(1, engine.kv_bytes_per_token())
    prompts = sorted({min(L, top) for L in grid.prefill_prompts if top > 0})
    contexts = sorted({min(C, top) for C in grid.decode_contexts if top > 0})
    batches = sorted({min(B, settings["max_num_seqs"]) for B in grid.decode_batches})
    if not prompts or not contexts:
        raise ValueError(f"max_model_len {settings['max_model_len']} leaves no room for the grid")
    jobs: list[Callable[[], list[Measured]]] = []
    for L in prompts:
        def prefill(L=L):
            engine.add(tokens(L), 1)
            return engine.drain()
        jobs.append(prefill)
    budget = pool_tokens // 4
    if grid.decode_batch_tokens > 0:
        budget = min(budget, grid.decode_batch_tokens)
    for C in contexts:
        C = max(bs, C // bs * bs)
        for B in batches:
            if B * (C + bs + grid.decode_steps + 2) > budget:
                continue  # the batch's contexts would not stay cached together
            # Each request decodes over its own context, as agent sessions do: a prefix
            # shared by the whole batch is read once per step from the CPU's cache and
            # measured a decode batch ~2x faster than the same batch over distinct contexts
            # (B=4 at 16 K: 2.5 vs 4.7 ms), which made the profile wrong for real traffic.
            prefixes: list[list[int]] = []

            def cache(B=B, C=C, prefixes=prefixes):
                prefixes[:] = [tokens(C) for _ in range(B)]
                for p in prefixes:
                    engine.add(p, 1)
                return engine.drain()

            def decode(prefixes=prefixes):
                for p in prefixes:
                    engine.add(p + tokens(bs), grid.decode_steps + 1)
                return engine.drain()
            jobs += [cache, decode]
            for P in grid.mixed_prefills:
                def mixed(P=P, prefixes=prefixes):
                    for p in prefixes:
                        engine.add(p + tokens(bs), grid.decode_steps + 2)
                    got = []
                    while engine.busy and not any(s.kind == "decode" for s in got):
                        s = engine.step()
                        if s is not None:
                            got.append(s)
                    engine.add(prefixes[0] + tokens(P), 1)  # joins the decoding batch
                    return got + engine.drain()
                jobs.append(mixed)
    passes = max(1, grid.repeats)
    best: list[list[Measured] | None] = [None] * len(jobs)
    disturbed = 0
    done = 0
    for _ in range(passes):
        for i, job in enumerate(jobs):
            got = job()
            prev = best[i]
            if prev is not None:
                a, b = sum(s.seconds for s in prev), sum(s.seconds for s in got)
                if max(a, b) > DISTURBED_RATIO * min(a, b):
                    disturbed += 1
                if b < a:
                    best[i] = got
            else:
                best[i] = got
            done += 1
            if progress:
                progress(done, passes * len(jobs))
    steps = [s for got in best for s in (got or [])]
    # When a whole decode batch finishes at once, the step that finishes it and the next one
    # carry host work for every finished request (freeing its KV blocks, dropping it from the
    # worker's batch: 36 ms after 126 requests of 49 K tokens), which the step-time model has
    # no term for and agent traffic does not produce (a step finishes one or two calls).
    # Those steps are measured but not fitted: left in, they made lone decodes look dearer.
    keep, prev = [], 0
    for s in steps:
        if s.finished <= MAX_FINISHED and prev <= MAX_FINISHED:
            keep.append(s)
        prev = s.finished
    return GridRun(keep, len(jobs), disturbed)


#: most requests a fitted step may finish (see run_grid)
MAX_FINISHED = 2
