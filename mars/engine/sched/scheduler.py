"""The mars scheduler classes, loaded by vLLM's EngineCore through ``--scheduler-cls``.

A thin hook layer: they subclass vLLM's own ``Scheduler`` / ``AsyncScheduler``, override
narrow hooks only (``schedule()`` itself is never copied), publish the engine's events, and
delegate every decision to the paper's two in-engine components:

* :class:`~mars.engine.sched.coordinator.Coordinator` -- the Priority-Aware Coordinator:
  order of ``waiting`` and ``running`` (so vLLM's own loop serves by priority and preempts
  the lowest priority first), and yielding of running prefills to better waiting calls;
* :class:`~mars.engine.sched.coscheduler.CoScheduler` -- the Opportunistic Co-Scheduler:
  admission headroom, chunk shrinking, pinned KV retention and pin reclaim (liveness).

Hooks: ``schedule`` (tick, sort, first tokens, prefill-rate measurement, snapshots),
``_reserve_prefill_lookahead`` (vLLM asks how many tokens a request gets: yielding, headroom,
shrinking, reclaim), ``_free_blocks`` (a finished round may be pinned), ``add_request``,
``_free_request``, ``_preempt_request``, ``reset_prefix_cache`` and ``shutdown``.

Every clock read goes through :attr:`MarsSchedulerMixin.mars_clock` (``time.time`` when
served; the offline engine injects a virtual clock). With ``--policy fcfs`` only the event
hooks run, so behaviour is exactly stock vLLM.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from mars.emulate.pacing import active_stats
from mars.emulate.step_log import StepLogWriter
from mars.protocol.session import SessionMeta
from mars.protocol.events import make_event
from mars.policy.registry import get_policy, with_config
from mars.policy.engine.step_stats import DecodeCost, StepStats
from mars.stream.publisher import EventPublisher, rank_endpoint, rank_path
from mars.engine.sched.calls import EngineCall
from mars.engine.sched.coordinator import Coordinator
from mars.engine.sched.coscheduler import CoScheduler

logger = logging.getLogger("mars.scheduler")

#: key in vLLM's ``--additional-config`` under which ``mars-vllm serve`` passes our settings
CONFIG_KEY = "mars"
_RUNNING = RequestStatus.RUNNING


def scheduled_batch(out) -> list[list[int]]:
    """A ``SchedulerOutput``'s batch as the step-time model takes it: ``[new tokens, cached
    context]`` for each scheduled request."""
    n = out.num_scheduled_tokens
    batch = [[n[r.req_id], r.num_computed_tokens] for r in out.scheduled_new_reqs]
    c = out.scheduled_cached_reqs
    batch += [[n[rid], c.num_computed_tokens[i]] for i, rid in enumerate(c.req_ids)]
    return batch


def mars_settings(vllm_config) -> dict[str, Any]:
    extra = vllm_config.additional_config or {}
    if isinstance(extra, dict):
        return dict(extra.get(CONFIG_KEY) or {})
    return {}


class MarsSchedulerMixin:
    """Hooks shared by both flavours. Keep every method cheap: it runs inside the step."""

    mars_clock: Callable[[], float] = staticmethod(time.time)

    # ------------------------------------------------------------------ set-up
    def _mars_init(self) -> None:
        cfg = mars_settings(self.vllm_config)
        self.mars_policy: str = cfg.get("policy", "fcfs")
        spec = get_policy(self.mars_policy)
        ordering, retention = spec.build()
        overrides = cfg.get("policy_config") or {}
        ordering = with_config(ordering, overrides.get("ordering"))
        retention = with_config(retention, overrides.get("retention"))
        # one of several data-parallel engines: its own endpoint and file, at the rank its
        # API server's header gives it (vLLM's global rank less the first rank that server
        # fronts: 0 but under hybrid or external load balancing, mars.engine.serve.dp_layout;
        # 0 without data parallelism)
        self.mars_dp_rank = int(self.vllm_config.parallel_config.data_parallel_index or 0) \
            - int(cfg.get("rank_base") or 0)
        self.mars_events = EventPublisher(
            endpoint=rank_endpoint(cfg.get("events_endpoint") or None, self.mars_dp_rank),
            jsonl_path=rank_path(cfg.get("events_file") or None, self.mars_dp_rank),
        )
        self.mars_counters = {"submitted": 0, "finished": 0, "preempted": 0, "steps": 0,
                              "shrunk": 0, "yielded": 0, "held_back": 0, "pinned": 0,
                              "unpinned": 0, "reclaimed_for_admission": 0, "stall_released": 0}
        pool = self.kv_cache_manager.block_pool
        self._mars_pool = pool
        total = pool.num_gpu_blocks - 1  # the null block is never handed out
        #: per-request records, the policies' CallViews (dropped when the request is freed)
        self.mars_calls: dict[str, EngineCall] = {}
        self.mars_step_stats = StepStats(min_prefill_tokens=self.block_size)
        #: a decode step's time against its batch's context, for the control plane
        #: (``kv_snapshot``'s ``batch_share``)
        self.mars_decode_cost = DecodeCost()
        self.mars_coord = Coordinator(
            ordering, self.mars_calls, block_size=self.block_size,
            token_budget=self.max_num_scheduled_tokens,
            max_running=self.max_num_running_reqs,
            free_blocks=pool.get_num_free_blocks, prefill_yield=spec.prefill_yield,
            step_stats=self.mars_step_stats,
            interference=float(cfg.get("prefill_interference", spec.prefill_interference)))
        self.mars_cosched = CoScheduler(
            retention, self.kv_cache_manager, block_size=self.block_size,
            total_blocks=total, lookahead_tokens=self.num_lookahead_tokens,
            shrink=spec.chunk_shrink, pin=spec.pin,
            headroom_tokens=int(cfg.get("admit_headroom_tokens", spec.admit_headroom_tokens)),
            emit=self._mars_emit, counters=self.mars_counters,
            full_sequence_must_fit=bool(self.scheduler_reserve_full_isl))
        #: vLLM offloads to host memory: a release is a read over the link, not a recompute
        #: (for the rules that price it); the control plane is told its size
        self._mars_host_tier = None
        if self.vllm_config.kv_transfer_config is not None:
            from mars.engine.executor.emulated_executor import emulated_host_link
            from mars.engine.executor.offload import host_reads, host_tier_for

            self._mars_host_reads = host_reads
            link = emulated_host_link(self.vllm_config)
            tier = host_tier_for(self.vllm_config, self.kv_cache_config, self.block_size,
                                 link.h2d_bytes_per_s if link is not None else None)
            self._mars_host_tier = tier
            if tier is not None:
                retention.attach_host_tier(tier)
            if self.connector is not None and self.mars_cosched.active:
                self._mars_watch_loads()
        self._mars_tick_s = float(cfg.get("tick_s", 0.05))
        self._mars_snapshot_s = float(cfg.get("snapshot_interval_s", 0.5))
        # admitted, no output token yet: watched at each step for ``gpu_1st_token``
        self._mars_awaiting_first: dict[str, EngineCall] = {}
        # vLLM's own lookahead rule, bound once (a super() lookup per request per step shows);
        # None when it is the identity: its only effect is for multi-token-prediction drafters
        # (num_prefill_lookahead > 1), see Scheduler._reserve_prefill_lookahead
        stock = super()._reserve_prefill_lookahead
        self._mars_stock_lookahead = stock if self.num_prefill_lookahead > 1 else None
        if not (self.mars_coord.prefill_yield or self.mars_cosched.active):
            # nothing to yield, shrink, reclaim or hold back: vLLM calls its own method
            self._reserve_prefill_lookahead = stock
        self._mars_next_tick = 0.0
        self._mars_next_snapshot = 0.0
        self._mars_roomy = True
        self._mars_budget_blocks = -(-self.max_num_scheduled_tokens // self.block_size) + 1
        self._mars_blocks_per_running = 2 + -(-self.num_lookahead_tokens // self.block_size)
        # the previous step, for the prefill-rate measurement: (time, tokens, requests,
        # its batch's context tokens if a pure decode step, for the decode cost fit)
        self._mars_last_step: tuple[float, int, int, int | None] | None = None
        #: async scheduling: vLLM schedules a step while the one before it still executes,
        #: so the time between two schedule() calls is not the duration of the step
        #: scheduled first. Steps are measured when their output arrives instead: scheduled
        #: steps in order, each (output, time scheduled, tokens, requests, bounded prefill,
        #: credit reserved for it, its batch's context tokens if a pure decode step)
        self._mars_async = isinstance(self, AsyncScheduler)
        self._mars_in_flight: collections.deque = collections.deque()
        #: when the last step's output arrived (a step starts executing no earlier)
        self._mars_prev_done = 0.0
        #: async: steps measured at their output (every non-empty step, tests check)
        self._mars_steps_measured = 0
        self._mars_idle_published = False
        #: ``--mars-step-log``: every step's batch and wall time (mars.emulate.step_log)
        self._mars_step_log = None
        if cfg.get("step_log"):
            if isinstance(self, AsyncScheduler):
                # vLLM's batch queue schedules step k+1 before step k's output is in: a step
                # would be timed with its neighbour's batch
                logger.warning("--mars-step-log needs synchronous scheduling (no async "
                               "scheduling): no step log is written")
            else:
                self._mars_step_log = StepLogWriter(cfg["step_log"])
        self._mars_updating = False
        self.mars_publish_start()
        logger.info("mars scheduler %s active (policy=%s, %d KV blocks of %d tokens)",
                    type(self).__name__, self.mars_policy, total, self.block_size)

    def mars_publish_start(self) -> None:
        """``scheduler_start``: the pool's size and block size, which the sidecar's KV-aware
        packing needs before any snapshot (published again by a simulator that gives the
        scheduler its own event sink)."""
        self.mars_events.publish(make_event(
            "scheduler_start", ts=self.mars_clock(),
            scheduler_cls=f"{type(self).__module__}.{type(self).__qualname__}",
            policy=self.mars_policy,
            total_blocks=self.mars_cosched.total_blocks,
            block_size=self.block_size,
            pid=os.getpid(),
            **({"host_blocks": tier.capacity_tokens // self.block_size}
               if (tier := self._mars_host_tier) is not None else {}),
        ))

    def set_mars_clock(self, clock: Callable[[], float]) -> None:
        """Read time from ``clock`` (the offline engine's virtual clock) instead of wall time."""
        self.mars_clock = clock

    # ----------------------------------------------------------------- helpers
    def _mars_emit(self, kind: str, **fields) -> None:
        self.mars_events.publish(make_event(kind, ts=self.mars_clock(), **fields))

    @staticmethod
    def _mars_meta(request: Request) -> SessionMeta:
        sp = request.sampling_params
        extra = sp.extra_args if sp is not None else None
        return SessionMeta.from_extra_args(extra, request.session_id)

    def _mars_num_waiting(self) -> int:
        return self.get_request_counts()[1]

    def _mars_on_link(self, r: Request) -> bool:
        """Whether ``r``'s KV is still on its way from another tier (vLLM's
        ``WAITING_FOR_REMOTE_KVS``: a load from host memory under ``--kv-offloading-size``);
        such calls wait, holding their blocks, in ``kv_holding_waiting``. A load that has
        landed is not: vLLM notes it in ``finished_recving_kv_req_ids`` and changes the status
        only when its scan of the waiting queues reaches the request, which a step whose
        budget the running calls take never does -- the call then waits for compute, under
        the old status."""
        return (r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and r.request_id not in self.finished_recving_kv_req_ids)

    def _mars_num_loading(self) -> int:
        """Waiting calls that wait for the link, not for compute."""
        return sum(1 for r in self.kv_holding_waiting if self._mars_on_link(r))

    def _mars_held_ready(self) -> list[Request]:
        """The calls of vLLM's ``kv_holding_waiting`` that this step's scan can admit, in its
        order (vLLM admits those before any of ``waiting``): not on the link, and not in
        another blocked state (structured-output grammar, streaming input)."""
        remote = RequestStatus.WAITING_FOR_REMOTE_KVS
        blocked = self._is_blocked_waiting_status
        return [r for r in self.kv_holding_waiting if not self._mars_on_link(r)
                and (r.status == remote or not blocked(r.status))]

    def _mars_snapshot(self, now: float, idle: bool = False) -> None:
        """``idle``: the last request was just freed (vLLM drops it from ``running`` only
        after the step's bookkeeping, so the lists may still hold it)."""
        free = self._mars_pool.get_num_free_blocks()
        total = self.mars_cosched.total_blocks
        emu = active_stats()  # on an emulated GPU: its pacer's totals
        self.mars_events.publish(make_event(
            "kv_snapshot", ts=now,
            total_blocks=total,
            free_blocks=free,
            used_blocks=max(total - free, 0),
            pinned_blocks=self.mars_cosched.pins.pinned_blocks,
            running=0 if idle else len(self.running),
            waiting=0 if idle else self._mars_num_waiting(),
            loading=0 if idle else self._mars_num_loading(),
            batch_share=self._mars_batch_share(),
            retention_decisions=self.mars_cosched.retention.decision_counts() or None,
            **({"emulated": emu.as_dict()} if emu is not None else {}),
        ))

    def _mars_batch_share(self) -> float | None:
        """The share of a decode step that grows with its batch (its elasticity in the
        batch, :class:`DecodeCost`) at the recent decode steps' mean batch; None while
        unfitted. Reported idle too: the batch is paused then, not gone."""
        share = self.mars_decode_cost.batch_share()
        return None if share is None else round(share, 4)

    def _mars_measure_step(self, now: float) -> None:
        """Prefill throughput and decode step time from step boundaries (the previous step's
        tokens over the time until this one): recompute time is priced with the rate, and the
        coordinator bounds low-priority prefill chunks with both."""
        last = self._mars_last_step
        if last is None:
            return
        ts, tokens, reqs, context = last
        if now > ts:
            self._mars_record_step(tokens, reqs, now - ts, self.mars_coord.take_bounded(),
                                   context=context)

    def _mars_record_step(self, tokens: int, reqs: int, seconds: float,
                          bounded: bool | None, reserved: float = 0.0,
                          context: int | None = None) -> None:
        """One step of ``tokens`` for ``reqs`` calls took ``seconds``: the prefill rate and
        the decode step learn from it, and the bounded prefills' credit is settled (what was
        reserved for it returned, its measured time charged). ``context``: a decode step's
        batch context tokens (None: the step carried a prefill), for the decode cost fit."""
        if seconds > 0:
            sample = self.mars_step_stats.observe(tokens, reqs, seconds)
            if sample is not None:
                self.mars_cosched.retention.observe_prefill(*sample)
            if context is not None:
                self.mars_decode_cost.observe(reqs, context, seconds)
        self.mars_coord.settle(bounded, max(seconds, 0.0), reserved)

    # ------------------------------------------------------------ step hooks
    def _mars_step_done(self, out, now: float) -> None:
        """Async scheduling: the step ``out`` just ended (its output arrived). It started
        when it was scheduled or when the step before it ended, whichever was later (one
        device runs one step at a time): that span is its duration, for the prefill rate,
        the decode step and the bounded prefills' credit."""
        q = self._mars_in_flight
        if not any(e[0] is out for e in q):
            return  # an empty step (nothing scheduled): not queued, nothing to measure
        while q[0][0] is not out:
            q.popleft()  # a step whose output never came (an engine reset): not measured
        _, ts, tokens, reqs, bounded, reserved, context = q.popleft()
        self._mars_steps_measured += 1
        start = max(ts, self._mars_prev_done)
        self._mars_prev_done = now
        self._mars_record_step(tokens, reqs, now - start, bounded, reserved, context)

    def schedule(self, *args, **kwargs):
        now = self.mars_clock()
        if not self._mars_async:
            self._mars_measure_step(now)
        log = self._mars_step_log
        if log is not None:
            log.end()
        if self._mars_awaiting_first:
            self._mars_first_tokens(now)
        cosched = self.mars_cosched
        coord = self.mars_coord
        held = self._mars_held_ready() if self.kv_holding_waiting and coord.active else ()
        if now >= self._mars_next_tick:
            self._mars_next_tick = now + self._mars_tick_s
            coord.refresh(self.running, self.waiting, now, held)
            if cosched.pin_on:
                cosched.refresh_demand(self.waiting, self.mars_calls)
                cosched.judge(now, len(self.running), len(self.waiting))
        coord.sort(self.running, self.waiting, held)
        # whether this step's allocations cannot run out of blocks whatever they are (every
        # running call takes at most a couple of blocks, plus the whole token budget as
        # prefill): then no decode can need a pin reclaimed, and decodes skip the hook
        self._mars_roomy = not cosched.pins.pinned_blocks or (
            self._mars_pool.get_num_free_blocks()
            >= self._mars_blocks_per_running * len(self.running) + self._mars_budget_blocks)
        self.mars_counters["steps"] += 1
        out = super().schedule(*args, **kwargs)
        n_sched = len(out.num_scheduled_tokens)
        if cosched.backstop(len(self.running), out.num_scheduled_tokens, now):
            self.mars_counters["stall_released"] += 1
        if log is not None and n_sched:
            log.begin(now, scheduled_batch(out))
        if self._mars_async:
            bounded = coord.take_bounded()
            if n_sched:
                tokens = out.total_num_scheduled_tokens
                self._mars_in_flight.append(
                    (out, now, tokens, n_sched, bounded,
                     coord.reserve(bounded, tokens - n_sched), self._mars_decode_context(out)))
        else:
            self._mars_last_step = (now, out.total_num_scheduled_tokens, n_sched,
                                    self._mars_decode_context(out)) if n_sched else None
        if now >= self._mars_next_snapshot or (not n_sched and not self._mars_idle_published):
            # after scheduling: a request that just arrived at an idle engine is running now,
            # not "waiting with nothing running" (which the sidecar reads as a queue); and
            # once more when the engine goes idle, so gauges do not keep the last load
            self._mars_next_snapshot = now + self._mars_snapshot_s
            self._mars_snapshot(now)
            self._mars_idle_published = not n_sched
        elif n_sched:
            self._mars_idle_published = False
        if out.scheduled_new_reqs:
            calls = self.mars_calls
            for new in out.scheduled_new_reqs:
                c = calls.get(new.req_id)
                if c is None or c.first_sched is not None:
                    continue
                # computed tokens at admission of a fresh request = its prefix-cache hit;
                # service is counted from there (also for policies without the hook)
                c.cached_tokens = c.seen = new.num_computed_tokens
                c.first_sched = now
                self._mars_awaiting_first[c.request_id] = c
                cosched.on_admitted(c, now)
        return out

    def _mars_decode_context(self, out) -> int | None:
        """The context tokens a pure decode step's calls read (None: it carries a prefill
        chunk, or is not a plain one-token-per-call step), for the decode cost fit. Under
        speculative decoding every step schedules draft tokens, so none is a sample and
        ``batch_share`` stays unknown (docs/control_plane.md, *Known limitations*)."""
        sched = out.num_scheduled_tokens
        if out.total_num_scheduled_tokens != len(sched):
            return None
        reqs = self.requests
        return sum(reqs[rid].num_computed_tokens for rid in sched if rid in reqs)

    def _mars_first_tokens(self, now: float) -> None:
        """``gpu_1st_token`` for admitted calls whose first output token came in the last
        step. Checked here, over the few calls still in prefill, rather than in vLLM's
        per-request output hook, which runs for every running request on every step."""
        done = [c for c in self._mars_awaiting_first.values() if c.req.num_output_tokens]
        for c in done:
            self._mars_note_first_token(c, now)

    def _mars_note_first_token(self, c: EngineCall, now: float) -> None:
        del self._mars_awaiting_first[c.request_id]
        self.mars_events.publish(make_event(
            "gpu_1st_token", ts=now, session_id=c.session_id, request_id=c.request_id,
            round=c.round, launch_delay_s=max(now - c.arrival_time, 0.0),
            cached_tokens=c.cached_tokens, prompt_tokens=c.prompt_tokens,
        ))

    def _mars_watch_loads(self) -> None:
        """A waiting call whose prefix the KV connector will load (vLLM's offloading: from
        host memory) is admitted on a path that never asks :meth:`_reserve_prefill_lookahead`:
        vLLM allocates its blocks straight away. Pins must make room for it there too, or a
        pool held by pins refuses it forever with nothing running (found by Continuum and
        InferCept at ILR-3 with offloading on: 49 calls waiting, 95 % of the pool pinned).
        So the connector's answer is watched: a load to come goes through the same
        admission rule (reclaim what it needs, the backstop if vLLM still refuses)."""
        conn = self.connector
        lookup = conn.get_num_new_matched_tokens

        def matched(request: Request, num_computed_tokens: int, *args, **kwargs):
            ext, load_async = lookup(request, num_computed_tokens, *args, **kwargs)
            if ext and load_async and not request.skip_reading_prefix_cache:
                c = self.mars_calls.get(request.request_id)
                if c is not None:
                    self.mars_coord.on_admitting(c, num_computed_tokens + ext)
                # the pins it needs go now, with what vLLM keeps back from an async load (the
                # in-flight prefills' blocks); headroom holding it back: vLLM's "not yet"
                # (the connector is asked again next step)
                if not self.mars_cosched.admission(
                        request, num_computed_tokens, ext, len(self.running),
                        c.session_id if c is not None else None, self.mars_clock(),
                        reserved=self._inflight_prefill_reserved_blocks()):
                    return None, False
            return ext, load_async

        conn.get_num_new_matched_tokens = matched

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        stock = self._mars_stock_lookahead
        n = stock(request, num_computed_tokens, num_new_tokens) if stock is not None \
            else max(num_new_tokens, 0)
        prefill = num_computed_tokens < request.num_prompt_tokens
        running = request.status is _RUNNING
        if not prefill and self._mars_roomy and running:
            return n  # decodes: nothing to yield or shrink, no pin to reclaim (hot path)
        if n <= 0:
            return n
        c = self.mars_calls.get(request.request_id)
        now = self.mars_clock()
        if not running:
            # admission (vLLM's full-prompt check still applies after this)
            if c is not None:
                self.mars_coord.on_admitting(c, num_computed_tokens)
            return self.mars_cosched.admission(
                request, num_computed_tokens, n, len(self.running),
                c.session_id if c is not None else None, now)
        if prefill and self.mars_coord.prefill_yield:
            before = n
            n = self.mars_coord.yield_tokens(request, num_computed_tokens, n)
            if n < before:
                self.mars_counters["yielded"] += 1
            n = self.mars_coord.interference_cap(request, num_computed_tokens, n,
                                                 self.running)
        return self.mars_cosched.running_chunk(
            request, num_computed_tokens, n, prefill,
            c.session_id if c is not None else None, c.round if c is not None else None, now)

    # ------------------------------------------------------------ lifecycle
    def add_request(self, request: Request) -> None:
        known = request.request_id in self.requests
        super().add_request(request)
        if known:
            return  # a streaming-input session's next chunk: the request is already tracked
        now = self.mars_clock()
        meta = self._mars_meta(request)
        call = self.mars_calls[request.request_id] = EngineCall(
            request, meta, self.block_size, now)
        if self.mars_coord.active or self.mars_cosched.pin_on:
            # expected prefix-cache hit (a pure lookup): what the call still has to compute
            # decides its priority and its demand on the pool, not its full prompt
            call.cached_tokens = self.kv_cache_manager.get_computed_blocks(request)[1]
        self.mars_counters["submitted"] += 1
        self.mars_cosched.on_arrival(call, now)
        level = self.mars_coord.on_arrival(call, now)
        n = request.num_prompt_tokens
        self.mars_events.publish(make_event(
            "gpu_submit", ts=now, session_id=meta.job_id, request_id=request.request_id,
            round=meta.round, prompt_tokens=n,
            projected_blocks=-(-n // self.block_size), level=level,
        ))

    def _free_blocks(self, request: Request):
        # Reached only for finished requests (vLLM's own contract).
        cs = self.mars_cosched
        if cs.pin_on and cs.try_pin(
                request, self.mars_calls.get(request.request_id), len(self.running),
                len(self.waiting), self.mars_clock(),
                self._request_blocks_can_be_freed(request)):
            del self.requests[request.request_id]
            return
        super()._free_blocks(request)

    def _free_request(self, request: Request, *args, **kwargs):
        rid = request.request_id
        blocks = self.mars_cosched.blocks_of(rid)
        result = super()._free_request(request, *args, **kwargs)
        idle = not self.requests
        if idle:
            # the engine goes idle (EngineCore stops stepping): the gap until the next step
            # is no step's duration
            self._mars_last_step = None
        now = self.mars_clock()
        log = self._mars_step_log
        if log is not None:
            log.finished_one()
            if idle and not self._mars_updating:
                log.end(idle=True)  # the last request aborted between steps
        call = self.mars_calls.pop(rid, None)
        if call is not None and rid in self._mars_awaiting_first and request.num_output_tokens:
            self._mars_note_first_token(call, now)  # its first token was also its last
        self._mars_awaiting_first.pop(rid, None)
        meta = call.meta if call is not None else SessionMeta()
        pinned_now = self.mars_cosched.last_pinned == rid
        self.mars_coord.on_finished(call, rid, now)
        self.mars_cosched.on_finished(call, rid, now)
        self.mars_counters["finished"] += 1
        self.mars_events.publish(make_event(
            "gpu_end", ts=now, session_id=meta.job_id, request_id=rid,
            round=meta.round, freed_blocks=0 if pinned_now else blocks,
            output_tokens=request.num_output_tokens,
            status=request.status.name.lower(),
        ))
        if idle:
            # EngineCore does not call schedule() again until new work arrives, so the last
            # periodic snapshot would show the load forever: publish the idle state now
            self._mars_snapshot(now, idle=True)
            self._mars_idle_published = True
        return result

    def update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        if self._mars_async:
            self._mars_step_done(scheduler_output, self.mars_clock())
        if self._mars_host_tier is not None:
            got = self._mars_host_reads(model_runner_output)
            if got is not None:
                self.mars_cosched.retention.observe_host_read(*got)
        args = (model_runner_output, *args)
        log = self._mars_step_log
        if log is None:
            return super().update_from_output(scheduler_output, *args, **kwargs)
        self._mars_updating = True
        try:
            out = super().update_from_output(scheduler_output, *args, **kwargs)
        finally:
            self._mars_updating = False
        if not self.requests:
            log.end(idle=True)  # EngineCore stops stepping: the step ends with its bookkeeping
        return out

    def _preempt_request(self, request: Request, *args, **kwargs) -> None:
        blocks = self.mars_cosched.blocks_of(request.request_id)
        super()._preempt_request(request, *args, **kwargs)
        call = self.mars_calls.get(request.request_id)
        if call is not None:
            self.mars_coord.on_preempted(call)
        meta = call.meta if call is not None else self._mars_meta(request)
        self.mars_counters["preempted"] += 1
        self.mars_events.publish(make_event(
            "preempt", ts=self.mars_clock(), session_id=meta.job_id,
            request_id=request.request_id,
            round=meta.round, blocks=blocks, level=self.mars_coord.level_of(request.request_id),
        ))

    def reset_prefix_cache(self, *args, **kwargs):
        # vLLM refuses to reset while blocks are referenced: pins must go first
        self.mars_cosched.release_all("shutdown", self.mars_clock())
        return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        try:
            now = self.mars_clock()
            self.mars_cosched.release_all("shutdown", now)
            self._mars_snapshot(now)
            self.mars_events.close()
            if self._mars_step_log is not None:
                self._mars_step_log.close()
        finally:
            super().shutdown()


class MarsScheduler(MarsSchedulerMixin, Scheduler):
    """Synchronous flavour (CPU, or GPU with async scheduling off)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mars_init()


class MarsAsyncScheduler(MarsSchedulerMixin, AsyncScheduler):
    """Async flavour: keeps vLLM's overlap of scheduling and model execution on GPU."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mars_init()


def make_scheduler(*args, vllm_config, **kwargs):
    """What ``--scheduler-cls`` points at: the flavour matching vLLM's async decision."""
    cls = MarsAsyncScheduler if vllm_config.scheduler_config.async_scheduling else MarsScheduler
    return cls(*args, vllm_config=vllm_config, **kwargs)
