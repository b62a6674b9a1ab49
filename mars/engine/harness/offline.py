"""The offline engine: vLLM's real ``Scheduler`` and KV-cache manager, no model, no workers.

Used by the tests (exact, deterministic scheduling scenarios), the scheduler benchmark
(``experiments/bench_scheduler.py``) and the simulator: the *same* scheduler classes the
served engine loads through ``--scheduler-cls`` (any ``--policy``), built as vLLM's
EngineCore builds them, on a KV config of a chosen number of blocks, driven with synthetic
model outputs. After every ``schedule()``, ``update_from_output`` gets one sampled token for
each scheduled request that finished its prefill (an empty list for a partial prefill chunk,
as the model runner reports it).

Time: the mars scheduler reads every clock through an injectable clock. The offline engine
gives it a :class:`VirtualClock` by default, advanced after each step by ``step_time(out)``
(:func:`linear_step_time` unless a step-time model is passed), so a scenario gives the same decisions on a
loaded machine as on an idle one; ``wall_clock=True`` keeps real time (the benchmark, which
measures the real cost of the hooks).
"""

from __future__ import annotations

import collections
import math
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mars.emulate.pacing import VirtualClock

#: block size of the embedded tiny model's engine on CPU (``mars-vllm serve`` default)
BLOCK_SIZE = 32
_VOCAB_LO, _VOCAB_HI = 16, 4000  # stay clear of the tiny model's special tokens


# --------------------------------------------------------------------------- set-up
def tiny_model_dir() -> str:
    from mars.model.tiny import default_model_dir, write_tiny_model

    return str(write_tiny_model(default_model_dir()))


def build_vllm_config(policy: str | None, max_num_seqs: int, *, model_config=None,
                      max_num_batched_tokens: int = 2048, block_size: int = BLOCK_SIZE,
                      mars: dict[str, Any] | None = None, max_model_len: int = 16384,
                      async_scheduling: bool = False, scheduling_policy: str = "fcfs",
                      offload_bytes: int | None = None):
    """A ``VllmConfig`` as ``mars-vllm serve`` makes one; ``policy=None``: stock vLLM.
    ``async_scheduling``: as vLLM sets it on a GPU (its default there), so the scheduler
    built is ``MarsAsyncScheduler`` (stock: ``AsyncScheduler``). ``offload_bytes``: vLLM's
    KV offloading to that much host memory (``--kv-offloading-size``)."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    mc = model_config or ModelConfig(model=tiny_model_dir(), max_model_len=max_model_len,
                                     dtype="bfloat16", seed=0)
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=mc.max_model_len, enable_chunked_prefill=True,
        is_encoder_decoder=False, async_scheduling=async_scheduling,
        policy=scheduling_policy)
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True,
                     kv_offloading_size=None if offload_bytes is None
                     else offload_bytes / (1 << 30))
    extra: dict[str, Any] = {}
    if policy is not None:
        extra["mars"] = {"policy": policy, "events_endpoint": None, "events_file": None,
                         "tick_s": 0.05, "policy_config": {}, **(mars or {})}
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc,
                    additional_config=extra)
    # vLLM's CPU platform turns async scheduling off (platforms/cpu.py); a GPU platform keeps
    # it (its default there): the offline engine has no device, so it decides as a GPU does
    vc.scheduler_config.async_scheduling = async_scheduling
    return vc


def build_scheduler(vllm_config, num_blocks: int, *, log_stats: bool = True):
    """The scheduler as EngineCore builds it, on a KV config with ``num_blocks`` blocks:
    the mars flavour when the config carries mars settings, else stock vLLM's.
    Returns ``(scheduler, hash_block_size)``."""
    import torch
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    mc = vllm_config.model_config
    bs = vllm_config.cache_config.block_size
    spec = FullAttentionSpec(block_size=bs,
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
    if "mars" not in (vllm_config.additional_config or {}):
        if vllm_config.scheduler_config.async_scheduling:
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler

            return AsyncScheduler(**kwargs), hash_block_size
        return Scheduler(**kwargs), hash_block_size
    from mars.engine.sched.scheduler import make_scheduler

    return make_scheduler(**kwargs), hash_block_size


def block_hasher(vllm_config, hash_block_size: int):
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    return get_request_block_hasher(hash_block_size, fn)


def synthetic_token(request, position: int | None = None) -> int:
    """The "sampled" token: a deterministic function of the request and the position it is
    sampled at (default: after the whole sequence so far), so every policy, sync or async,
    produces exactly the same outputs for the same requests."""
    pos = request.num_tokens if position is None else position
    return _VOCAB_LO + (pos * 2654435761 + len(request.request_id)) % (_VOCAB_HI - _VOCAB_LO)


def linear_step_time(out, fixed_s: float = 0.005, per_token_s: float = 2e-5) -> float:
    """The offline engine's default synthetic step time: a fixed cost plus a cost per
    scheduled token. Synthetic (no hardware behind it); it only has the shape every real
    engine has -- a step with more tokens takes longer -- so rules that trade tokens per step
    against step time behave as they would on one. The emulated-GPU step-time model replaces
    it where numbers matter."""
    return fixed_s + per_token_s * out.total_num_scheduled_tokens


# --------------------------------------------------------------------------- engine
@dataclass
class KvAccount:
    """Where every block of the pool is (distinct blocks)."""

    total: int
    free: int
    #: held by at least one request
    used: int
    #: held by pins only
    pinned: int

    @property
    def balanced(self) -> bool:
        return self.free + self.used + self.pinned == self.total


def kv_account(sched, pins=None) -> KvAccount:
    """Where every block of ``sched``'s pool is; ``pins``: the mars scheduler's pin table
    (None for stock vLLM). Shared by the offline engine and the simulator."""
    pool = sched.kv_cache_manager.block_pool
    used: set[int] = set()
    for mgr in sched.kv_cache_manager.coordinator.single_type_managers:
        for blocks in mgr.req_to_blocks.values():
            used.update(b.block_id for b in blocks if not b.is_null)
    pinned = pins.block_ids() - used if pins is not None else set()
    return KvAccount(total=pool.num_gpu_blocks - 1, free=pool.get_num_free_blocks(),
                     used=len(used), pinned=len(pinned))


#: what the offline engines of a test module run when not told (tests/conftest.py runs the
#: scheduler modules once each way); the served engine follows vLLM's own decision
DEFAULT_ASYNC = False


class OfflineEngine:
    """One scheduler; requests are added by the caller; ``step()`` runs one engine step.

    ``async_scheduling``: the scheduler is vLLM's async flavour (``MarsAsyncScheduler``, or
    stock ``AsyncScheduler``) and :meth:`step` drives it as vLLM's
    ``EngineCore.step_with_batch_queue`` does with a queue of two batches: a step is
    scheduled while the one before it is still executing, and its outputs reach the
    scheduler only after that (running requests carry output placeholders meanwhile; a
    request can finish, be aborted or preempted with a step in flight)."""

    def __init__(self, policy: str | None, *, num_blocks: int, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 2048, block_size: int = BLOCK_SIZE,
                 model_config=None, log_stats: bool = True, wall_clock: bool = False,
                 step_time: Callable[[Any], float] | None = None,
                 mars: dict[str, Any] | None = None, max_model_len: int = 16384,
                 async_scheduling: bool | None = None,
                 scheduling_policy: str = "fcfs", offload_bytes: int | None = None,
                 host_link=None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request

        self._Request, self._SP, self._MRO = Request, SamplingParams, ModelRunnerOutput
        self.policy = policy
        self.async_scheduling = DEFAULT_ASYNC if async_scheduling is None \
            else async_scheduling
        self.vllm_config = build_vllm_config(
            policy, max_num_seqs, model_config=model_config,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, mars=mars,
            max_model_len=max_model_len, async_scheduling=self.async_scheduling,
            scheduling_policy=scheduling_policy, offload_bytes=offload_bytes)
        self.sched, hbs = build_scheduler(self.vllm_config, num_blocks, log_stats=log_stats)
        self._hasher = block_hasher(self.vllm_config, hbs)
        self.clock: Callable[[], float]
        if wall_clock:
            self.clock = time.time
        else:
            self.clock = VirtualClock()
            if policy is not None:
                self.sched.set_mars_clock(self.clock)
        self._step_time = step_time or linear_step_time
        #: vLLM's offloading's worker side on an emulated host link (``offload_bytes``)
        self.offload = None
        if offload_bytes is not None:
            if host_link is None or not isinstance(self.clock, VirtualClock):
                raise ValueError("offloading needs a host_link and the virtual clock")
            from mars.engine.executor.offload import EmulatedOffload

            self.offload = EmulatedOffload(self.vllm_config, self.sched.kv_cache_config,
                                           host_link, now=self.clock,
                                           wait_until=self.clock.advance_to)
        self.live: dict[str, Any] = {}
        #: finished request id -> all token ids (prompt + output)
        self.done: dict[str, list[int]] = {}
        self.steps = 0
        #: tokens the latest step scheduled
        self.last_scheduled_tokens = 0
        #: async: batches scheduled and "executing", newest first, with their outputs
        #: (decided when scheduled, as the GPU computes them then); vLLM's batch_queue_size
        self._batch_queue: collections.deque = collections.deque()
        self.batch_queue_size = 2 if self.async_scheduling else 1

    @property
    def model_config(self):
        return self.vllm_config.model_config

    @property
    def is_mars(self) -> bool:
        return self.policy is not None

    def make_request(self, rid: str, prompt: list[int], max_tokens: int, *,
                     priority: int = 0, **xargs):
        sp = self._SP(max_tokens=max_tokens, ignore_eos=True, extra_args=xargs or None)
        return self._Request(rid, prompt, sp, None, block_hasher=self._hasher,
                             arrival_time=self.clock(), priority=priority)

    def add(self, rid: str, prompt: list[int], max_tokens: int, *, priority: int = 0,
            **xargs):
        req = self.make_request(rid, prompt, max_tokens, priority=priority, **xargs)
        self.add_request(req)
        return req

    def add_request(self, req) -> None:
        self.live[req.request_id] = req
        self.sched.add_request(req)

    def model_output(self, out):
        """The step's synthetic output; with offloading, the connector's worker side runs
        the step (as vLLM's model runner does) and reports the transfers that landed."""
        mo = self._sampled(out)
        if self.offload is not None:
            now = self.clock()
            self.offload.begin(out, now, now + (self._step_time(out)
                                                if out.total_num_scheduled_tokens else 0.0))
            mo.kv_connector_output = self.offload.end(out)
        return mo

    def load_marks(self) -> tuple[int, int]:
        """:func:`mars.engine.executor.offload.load_marks` of this engine."""
        from mars.engine.executor.offload import load_marks

        return load_marks(self.offload, self.sched)

    def wake_at(self) -> float | None:
        """When the next transfer on the host link lands (None: none in flight)."""
        return None if self.offload is None else self.offload.next_done()

    def _sampled(self, out):
        live = self.live
        req_ids = list(out.num_scheduled_tokens)
        # the token follows everything computed once this step ran: the whole sequence in a
        # synchronous step; under async scheduling also the tokens of the step still in
        # flight (their placeholders), which the request's num_tokens does not count yet
        sampled = [[] if live[rid].is_prefill_chunk
                   else [synthetic_token(live[rid], live[rid].num_computed_tokens)]
                   for rid in req_ids]
        return self._MRO(req_ids=req_ids,
                         req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
                         sampled_token_ids=sampled)

    def step(self) -> list[str]:
        """One engine step; returns the ids of the requests that finished in it."""
        if self.async_scheduling:
            return self._step_with_batch_queue()
        out = self.sched.schedule()
        self.last_scheduled_tokens = out.total_num_scheduled_tokens
        eco = self.sched.update_from_output(out, self.model_output(out))
        if isinstance(self.clock, VirtualClock):
            self.clock.advance(self._step_time(out))
        self.steps += 1
        return self.collect_finished(eco)

    def _step_with_batch_queue(self) -> list[str]:
        """vLLM's ``EngineCore.step_with_batch_queue`` (vllm/v1/engine/core.py), with the
        model's output known when the batch is scheduled: schedule a batch if the queue has
        room and return at once while it has; otherwise finish the oldest batch (its step
        time passes) and hand its output to the scheduler."""
        q = self._batch_queue
        sched = self.sched
        if sched.has_requests():
            out = sched.schedule()
            self.last_scheduled_tokens = out.total_num_scheduled_tokens
            executed = out.total_num_scheduled_tokens > 0
            # the step's output and time are what the device makes of the batch as it was
            # scheduled (the next schedule() moves the requests on); an empty batch is not
            # executed (the worker returns at once)
            q.appendleft((out, self.model_output(out),
                          self._step_time(out) if executed else 0.0))
            if len(q) < self.batch_queue_size and (executed or sched.has_requests()):
                return []
        elif not q:
            return []
        out, mo, dt = q.pop()
        if isinstance(self.clock, VirtualClock):
            self.clock.advance(dt)
        eco = sched.update_from_output(out, mo)
        self.steps += 1
        return self.collect_finished(eco)

    @property
    def in_flight(self) -> int:
        """Batches scheduled whose outputs the scheduler has not had yet (async only)."""
        return len(self._batch_queue)

    def collect_finished(self, eco) -> list[str]:
        """Record the requests an ``update_from_output`` result finished; their ids."""
        finished = []
        for outs in eco.values():
            for o in outs.outputs:
                if o.finish_reason is not None:
                    req = self.live.pop(o.request_id)
                    self.done[o.request_id] = list(req.all_token_ids)
                    finished.append(o.request_id)
        return finished

    def run_until_idle(self, max_steps: int = 20_000) -> None:
        """Step until every request has finished. With offloading, a step that scheduled
        nothing and moved no load while a transfer is in flight advances the virtual clock
        to the transfer's end (the engine would poll until then), as the simulator does."""
        start = self.steps
        while (self.live or self._batch_queue) and self.steps - start < max_steps:
            marks = self.load_marks()
            self.step()
            wake = self.wake_at()
            if (not self.last_scheduled_tokens and self.load_marks() == marks
                    and wake is not None and wake > self.clock()):
                self.clock.advance_to(wake)
        if self.live:
            raise AssertionError(f"{len(self.live)} requests never finished "
                                 f"in {max_steps} steps: {self.describe()}")

    # ------------------------------------------------------------------ state
    @property
    def pool(self):
        return self.sched.kv_cache_manager.block_pool

    def kv_account(self) -> KvAccount:
        return kv_account(self.sched, self.sched.mars_cosched.pins if self.is_mars else None)

    def pinned_blocks(self) -> int:
        return self.sched.mars_cosched.pins.pinned_blocks if self.is_mars else 0

    def describe(self) -> str:
        acc = self.kv_account()
        return (f"running={len(self.sched.running)} waiting={len(self.sched.waiting)} "
                f"free={acc.free} used={acc.used} pinned={acc.pinned} total={acc.total}")

    def events(self) -> list[dict]:
        """The events written so far (needs ``mars={"events_file": ...}``)."""
        import json

        path = self.vllm_config.additional_config["mars"].get("events_file")
        self.sched.mars_events._drain()
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def close(self) -> None:
        for part in (self.sched, self.offload):
            try:
                if part is not None:
                    part.shutdown()
            except Exception:  # pragma: no cover - best effort
                pass


# --------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class AgentLoop:
    """A closed-loop agent-like workload: ``slots`` jobs in flight, each of ``job_rounds``
    rounds; round 0 is a fresh ``prompt_tokens`` prompt, every later round is the previous
    round's full context plus ``turn_tokens`` new tokens (a tool result), so it mostly hits
    the prefix cache, as agent rounds do. Output lengths are drawn from
    ``[min_output, max_output]``. A finished request is replaced at once by its job's next
    round (or a new job), as the EngineCore would add it between steps."""

    prompt_tokens: int = 512
    turn_tokens: int = 64
    min_output: int = 16
    max_output: int = 128
    job_rounds: int = 4
    seed: int = 0

    def max_context(self) -> int:
        return self.prompt_tokens + self.job_rounds * (self.turn_tokens + self.max_output)


class AgentLoopDriver:
    """Keeps ``slots`` jobs of an :class:`AgentLoop` running on an :class:`OfflineEngine`.

    ``on_add`` (if given) wraps every ``add_request`` call (the benchmark times it)."""

    def __init__(self, engine: OfflineEngine, slots: int, workload: AgentLoop, *,
                 tag: str = "") -> None:
        self.engine, self.slots, self.wl, self.tag = engine, slots, workload, tag
        self._serial = 0
        self._jobs = [0] * slots
        self._where: dict[str, tuple[int, int]] = {}  # live request id -> (slot, round)
        self.finished = 0
        self.add_ns: list[int] = []

    def start(self) -> None:
        for slot in range(self.slots):
            self._submit(slot, 0, None, record=False)

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
        self._serial += 1
        rid = f"{self.tag}{self._serial}-s{slot}j{job}r{rnd}"
        req = self.engine.make_request(
            rid, prompt, rng.randint(wl.min_output, wl.max_output),
            job_id=f"job-{slot}-{job}", round=rnd, last_round=last)
        self._where[rid] = (slot, rnd)
        t0 = time.perf_counter_ns()
        self.engine.add_request(req)
        if record:
            self.add_ns.append(time.perf_counter_ns() - t0)

    def on_finished(self, finished: Iterable[str], *, record: bool = True) -> None:
        for rid in finished:
            slot, rnd = self._where.pop(rid)
            self.finished += 1
            if rnd + 1 >= self.wl.job_rounds:
                self._jobs[slot] += 1
                self._submit(slot, 0, None, record=record)
            else:
                self._submit(slot, rnd + 1, self.engine.done.pop(rid), record=record)

    def step(self, record: bool = True) -> None:
        self.on_finished(self.engine.step(), record=record)


def default_num_blocks(slots: int, workload: AgentLoop, block_size: int = BLOCK_SIZE) -> int:
    """A pool roomy enough that the loop never runs short (twice its peak need + slack)."""
    per_req = math.ceil(workload.max_context() / block_size) + 2
    return slots * per_req * 2 + 256
