"""The mars scheduler classes, loaded by vLLM's EngineCore through ``--scheduler-cls``.

They subclass vLLM's own ``Scheduler`` / ``AsyncScheduler`` and override only narrow hooks;
``schedule()`` itself is never copied. What each hook does, and why it is enough:

* **Order** (``schedule`` entry). vLLM serves ``self.running`` front to back and, under its
  FCFS policy, preempts from the back (``self.running.pop()``); it admits from the front of
  ``self.waiting``. Sorting both lists by the ordering policy's key therefore gives priority
  service *and* priority-aligned eviction (lowest level, largest footprint preempted first)
  with vLLM's own loop. Requests admitted in a step are appended after the running loop, so
  a just-admitted call is never a victim in that step. Keys are refreshed on a short tick
  (``tick_s``), not every step, which keeps the added cost per step O(1) when nothing changed.
* **Yield** (``_reserve_prefill_lookahead``, running loop). vLLM serves running requests
  before waiting ones, so a long prefill that is already running would take the whole token
  budget from short calls that just arrived. A running prefill whose key is worse than some
  waiting call's gives up the tokens those better calls need (down to one block per step, so
  it always progresses). This is what makes the MLFQ act "over waiting and running requests".
* **Shrink** (same hook). A running prefill chunk that cannot get its KV blocks is shrunk to
  what the free blocks hold, block-aligned, down to one block, before anything is preempted.
  New admissions are never shrunk: vLLM's full-prompt admission check stays on, because
  disabling it so that new requests could shrink too caused thrashing on the CPU testbed
  (25 preemptions instead of 5-7).
* **Pins** (``_free_blocks``, reached only for finished requests). A finished round whose
  session goes on to a tool keeps its blocks (``pop_blocks_for_free`` without freeing) for
  the τ its retention policy grants; released when the next round is admitted, when τ ends or
  the policy's periodic re-evaluation says so, and when a running call needs memory -- pins
  always go before any running call is preempted.
* **Events**: every decision above is published on the unified stream (non-blocking).

With ``--policy fcfs`` only the event hooks run, so behaviour is exactly stock vLLM.
"""

from __future__ import annotations

import logging
import os
import time
from bisect import bisect_left
from collections import OrderedDict
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from mars.policy.base import CallView, FcfsOrdering, KvPressure, PinCandidate, SessionMeta
from mars.policy.events import make_event
from mars.policy.registry import get_policy, with_config
from mars.stream.publisher import EventPublisher
from mars.vllm_patches.pins import Pin, PinTable

logger = logging.getLogger("mars.scheduler")

#: key in vLLM's ``--additional-config`` under which ``mars-vllm serve`` passes our settings
CONFIG_KEY = "mars"
_PINNABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


def mars_settings(vllm_config) -> dict[str, Any]:
    extra = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(extra, dict):
        return dict(extra.get(CONFIG_KEY) or {})
    return {}


class _MarsSchedulerMixin:
    """Hooks shared by both flavours. Keep every method cheap: it runs inside the step."""

    # ------------------------------------------------------------------ set-up
    def _mars_init(self) -> None:
        cfg = mars_settings(self.vllm_config)
        self.mars_policy: str = cfg.get("policy", "fcfs")
        spec = get_policy(self.mars_policy)
        ordering, retention = spec.build()
        overrides = cfg.get("policy_config") or {}
        self.mars_ordering = with_config(ordering, overrides.get("ordering"))
        self.mars_retention = with_config(retention, overrides.get("retention"))
        self._mars_order_on = not isinstance(self.mars_ordering, FcfsOrdering)
        self._mars_shrink_on = spec.chunk_shrink
        self._mars_pin_on = spec.pin
        self._mars_tick_s = float(cfg.get("tick_s", 0.05))
        self._mars_snapshot_s = float(cfg.get("snapshot_interval_s", 0.5))
        self.mars_events = EventPublisher(
            endpoint=cfg.get("events_endpoint") or None,
            jsonl_path=cfg.get("events_file") or None,
        )
        pool = self.kv_cache_manager.block_pool
        self._mars_pool = pool
        self._mars_total_blocks = pool.num_gpu_blocks - 1  # the null block is never handed out
        self._mars_pins = PinTable(pool)
        # optional feeds some retention rules use (Continuum-Dy)
        self._mars_queue_delay_sink = getattr(self.mars_retention, "observe_queue_delay", None)
        self._mars_session_sink = getattr(self.mars_retention, "observe_session", None)
        # per-request state (dropped at finish)
        self._mars_meta: dict[str, SessionMeta] = {}
        self._mars_cached: dict[str, int] = {}
        self._mars_seen: dict[str, int] = {}         # computed tokens already accounted
        self._mars_served: dict[str, float] = {}     # last time service was observed
        self._mars_first_sched: dict[str, float] = {}
        self._mars_keys: dict[str, tuple] = {}
        # per-session state: when the last round ended and which tool followed (bounded)
        self._mars_round_end: OrderedDict[str, tuple[float, str | None]] = OrderedDict()
        self._mars_next_tick = 0.0
        self._mars_next_snapshot = 0.0
        self._mars_sorted_tail: Request | None = None
        self._mars_waiting_dirty = True
        self._mars_running_dirty = True
        # waiting keys (sorted) and the prefix sums of their token demand, for yielding
        self._mars_wkeys: list[tuple] = []
        self._mars_wdemand: list[int] = []
        self._mars_waiting_demand_blocks = 0
        self.mars_counters = {"submitted": 0, "finished": 0, "preempted": 0, "steps": 0,
                              "shrunk": 0, "yielded": 0, "pinned": 0, "unpinned": 0}
        self.mars_events.publish(make_event(
            "scheduler_start",
            scheduler_cls=f"{type(self).__module__}.{type(self).__qualname__}",
            policy=self.mars_policy,
            total_blocks=self._mars_total_blocks,
            block_size=self.block_size,
            pid=os.getpid(),
        ))
        logger.info("mars scheduler %s active (policy=%s, %d KV blocks of %d tokens)",
                    type(self).__name__, self.mars_policy, self._mars_total_blocks,
                    self.block_size)

    # ----------------------------------------------------------------- helpers
    def _mars_session(self, request: Request) -> SessionMeta:
        meta = self._mars_meta.get(request.request_id)
        if meta is None:
            sp = request.sampling_params
            extra = sp.extra_args if sp is not None else None
            meta = SessionMeta.from_extra_args(extra, getattr(request, "session_id", None))
            self._mars_meta[request.request_id] = meta
        return meta

    def _mars_blocks_of(self, request_id: str) -> int:
        # the first (full-attention) group's block list, without building id lists
        try:
            mgr = self.kv_cache_manager.coordinator.single_type_managers[0]
            return len(mgr.req_to_blocks.get(request_id, ()))
        except (AttributeError, IndexError):
            return 0

    def _mars_view(self, r: Request, now: float) -> CallView:
        rid = r.request_id
        meta = self._mars_meta.get(rid)
        return CallView(
            request_id=rid,
            session_id=meta.job_id if meta else None,
            prompt_tokens=r.num_prompt_tokens,
            computed_tokens=r.num_computed_tokens,
            cached_tokens=self._mars_cached.get(rid, 0),
            output_tokens=r.num_output_tokens,
            max_tokens=r.max_tokens,
            arrival_time=r.arrival_time,
            last_served=self._mars_served.get(rid, r.arrival_time),
            num_blocks=-(-r.num_tokens // self.block_size),
            running=r.status == RequestStatus.RUNNING,
            round=meta.round if meta else None,
        )

    def _mars_key(self, r: Request) -> tuple:
        key = self._mars_keys.get(r.request_id)
        if key is None:
            now = time.time()
            key = self._mars_keys[r.request_id] = self.mars_ordering.key(
                self._mars_view(r, now), now)
        return key

    def _mars_kv_pressure(self) -> KvPressure:
        return KvPressure(
            total_blocks=self._mars_total_blocks,
            free_blocks=self._mars_pool.get_num_free_blocks(),
            pinned_blocks=self._mars_pins.pinned_blocks,
            waiting_demand_blocks=self._mars_waiting_demand_blocks,
            running=len(self.running),
            waiting=len(self.waiting),
        )

    def _mars_snapshot(self, now: float) -> None:
        free = self._mars_pool.get_num_free_blocks()
        self.mars_events.publish(make_event(
            "kv_snapshot", ts=now,
            total_blocks=self._mars_total_blocks,
            free_blocks=free,
            used_blocks=max(self._mars_total_blocks - free, 0),
            pinned_blocks=self._mars_pins.pinned_blocks,
            running=len(self.running),
            waiting=len(self.waiting),
        ))

    # ---------------------------------------------------------------- ordering
    def _mars_tick(self, now: float) -> None:
        """Account service since the last tick, refresh keys, re-judge pins."""
        order_on = self._mars_order_on
        seen, served = self._mars_seen, self._mars_served
        if order_on:
            ordering = self.mars_ordering
            keys = self._mars_keys
            for r in self.running:
                rid = r.request_id
                done = r.num_computed_tokens
                delta = done - seen.get(rid, done)
                seen[rid] = done
                view = self._mars_view(r, now)
                if delta > 0:
                    ordering.on_scheduled(view, delta, now)
                    served[rid] = view.last_served = now
                keys[rid] = ordering.key(view, now)
            for r in self.waiting:
                keys[r.request_id] = ordering.key(self._mars_view(r, now), now)
            self._mars_running_dirty = self._mars_waiting_dirty = True
        bs = self.block_size
        self._mars_waiting_demand_blocks = sum(
            -(-(r.num_tokens - r.num_computed_tokens) // bs) for r in self.waiting)
        if len(self._mars_pins):
            self._mars_judge_pins(now)

    def _mars_sort(self) -> None:
        keyf = self._mars_key
        if self._mars_waiting_dirty:
            if len(self.waiting) > 1:
                items = sorted(self.waiting, key=keyf)
                self.waiting.clear()
                self.waiting.extend(items)
            self._mars_waiting_dirty = False
        tail = self.running[-1] if self.running else None
        if self._mars_running_dirty or tail is not self._mars_sorted_tail:
            self.running.sort(key=keyf)
            self._mars_sorted_tail = self.running[-1] if self.running else None
            self._mars_running_dirty = False
        self._mars_admissible_prefix()

    def _mars_admissible_prefix(self) -> None:
        """Keys and cumulative token demand of the waiting calls vLLM could admit this step
        (they fit in the free blocks and the sequence slots). Running prefills yield only to
        these: yielding to a call that cannot be admitted anyway would waste the budget."""
        wkeys: list[tuple] = []
        demand: list[int] = []
        if self.waiting:
            budget = self.max_num_scheduled_tokens
            slots = self.max_num_running_reqs - len(self.running)
            free = self._mars_pool.get_num_free_blocks()
            bs = self.block_size
            acc = blocks = 0
            keyf = self._mars_key
            for r in self.waiting:
                if slots <= 0 or acc >= budget:
                    break
                need = r.num_tokens - r.num_computed_tokens
                blocks += -(-need // bs)
                if blocks > free:
                    break
                acc += need
                wkeys.append(keyf(r))
                demand.append(acc)
                slots -= 1
        self._mars_wkeys, self._mars_wdemand = wkeys, demand

    # ------------------------------------------------------------ step hooks
    def schedule(self, *args, **kwargs):
        now = time.time()
        if now >= self._mars_next_tick:
            self._mars_next_tick = now + self._mars_tick_s
            self._mars_tick(now)
        if self._mars_order_on:
            self._mars_sort()
        self.mars_counters["steps"] += 1
        out = super().schedule(*args, **kwargs)
        if now >= self._mars_next_snapshot:
            # after scheduling: a request that just arrived at an idle engine is running
            # now, not "waiting with nothing running" (which the sidecar reads as a queue)
            self._mars_next_snapshot = now + self._mars_snapshot_s
            self._mars_snapshot(now)
        if out.scheduled_new_reqs:
            for new in out.scheduled_new_reqs:
                rid = new.req_id
                # computed tokens at admission of a fresh request = its prefix-cache hit;
                # service is counted from there, so cache hits are not service
                self._mars_cached.setdefault(rid, new.num_computed_tokens)
                self._mars_seen.setdefault(rid, new.num_computed_tokens)
                self._mars_first_sched.setdefault(rid, now)
                meta = self._mars_meta.get(rid)
                if meta is not None and meta.job_id is not None:
                    pin = self._mars_pins.get(meta.job_id)
                    if pin is not None and pin.resumed_by == rid:
                        self._mars_unpin(meta.job_id, "resumed", now)
                    elif meta.round and self._mars_queue_delay_sink is not None:
                        # a later round that found no pin: its queueing delay is what an
                        # eviction costs (Continuum-Dy's T-bar)
                        req = self.requests.get(rid)
                        if req is not None:
                            self._mars_queue_delay_sink(max(now - req.arrival_time, 0.0))
        return out

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        prefill = num_computed_tokens < request.num_prompt_tokens
        if not prefill and not self._mars_pins.pinned_blocks:
            return n  # decodes: nothing to yield or shrink, no pin to reclaim (hot path)
        if n <= 0 or request.status != RequestStatus.RUNNING:
            return n  # waiting/preempted: admission keeps vLLM's full-prompt check
        if prefill and self._mars_order_on and self._mars_wkeys:
            n = self._mars_yield(request, num_computed_tokens, n)
        bs = self.block_size
        free = self._mars_pool.get_num_free_blocks()
        if free * bs >= n + bs:
            return n  # fast path: plenty of room
        held = self._mars_blocks_of(request.request_id)
        fit = (held + free) * bs - num_computed_tokens
        if n <= fit:
            return n
        if prefill and self._mars_shrink_on and fit > 0:
            end = ((num_computed_tokens + fit) // bs) * bs
            granted = end - num_computed_tokens if end > num_computed_tokens else fit
            if granted >= min(bs, n) or granted == fit:
                self._mars_note_shrink(request, n, granted)
                return granted
        if len(self._mars_pins):
            self._mars_reclaim(need_free=-(-(num_computed_tokens + n) // bs) - held)
        return n

    def _mars_yield(self, request: Request, computed: int, n: int) -> int:
        """Give the token budget to waiting calls ranked above this running prefill."""
        idx = bisect_left(self._mars_wkeys, self._mars_key(request))
        if idx == 0:
            return n
        budget = self.max_num_scheduled_tokens
        keep = budget - self._mars_wdemand[idx - 1]
        bs = self.block_size
        floor = bs - (computed % bs)  # at least up to the next block boundary
        granted = max(keep, floor)
        if granted < n:
            self.mars_counters["yielded"] += 1
            return granted
        return n

    def _mars_note_shrink(self, request: Request, requested: int, granted: int) -> None:
        self.mars_counters["shrunk"] += 1
        meta = self._mars_session(request)
        self.mars_events.publish(make_event(
            "chunk_shrink", session_id=meta.job_id, request_id=request.request_id,
            round=meta.round, requested_tokens=requested, granted_tokens=granted))

    # -------------------------------------------------------------------- pins
    def _mars_reclaim(self, need_free: int) -> None:
        """Memory is needed by a running call: release pins (oldest first) until the pool has
        ``need_free`` free blocks, before vLLM falls back to preempting anything."""
        now = time.time()
        pool = self._mars_pool
        for pin in self._mars_pins.oldest_first():
            if pool.get_num_free_blocks() >= need_free:
                break
            self._mars_unpin(pin.cand.session_id, "pressure", now)

    def _mars_judge_pins(self, now: float) -> None:
        kv = self._mars_kv_pressure()
        retention = self.mars_retention
        for sid in self._mars_pins.sessions():
            pin = self._mars_pins.get(sid)
            if pin.resumed_by is not None:
                continue  # its next round is queued: keep until that round is admitted
            if now - pin.pinned_at >= pin.tau_s:
                self._mars_unpin(sid, "expired", now)
            elif not retention.keep(pin.cand, kv, now):
                self._mars_unpin(sid, "pressure", now)

    def _mars_unpin(self, session_id: str, reason: str, now: float) -> None:
        pin = self._mars_pins.release(session_id)
        if pin is None:
            return
        self.mars_counters["unpinned"] += 1
        forget = getattr(self.mars_retention, "forget", None)
        if forget is not None:
            forget(session_id)
        self.mars_events.publish(make_event(
            "unpin", session_id=session_id, blocks=pin.num_blocks, reason=reason,
            held_s=max(now - pin.pinned_at, 0.0)))

    def _mars_try_pin(self, request: Request) -> bool:
        """At the end of a round: ask the retention policy; pin if it grants τ > 0."""
        meta = self._mars_meta.get(request.request_id)
        if (meta is None or meta.job_id is None or meta.last_round
                or request.status not in _PINNABLE
                or not self._request_blocks_can_be_freed(request)):
            return False
        now = time.time()
        blocks = self._mars_blocks_of(request.request_id)
        cand = PinCandidate(session_id=meta.job_id, blocks=blocks,
                            context_tokens=request.num_tokens, tool=meta.next_tool,
                            started=now)
        tau = self.mars_retention.admit(cand, self._mars_kv_pressure(), now)
        if tau <= 0 or blocks == 0:
            return False
        held = self.kv_cache_manager.pop_blocks_for_free(request)
        old = self._mars_pins.add(Pin(cand=cand, blocks=held, tau_s=tau, pinned_at=now))
        if old is not None:
            self.mars_events.publish(make_event(
                "unpin", session_id=meta.job_id, blocks=old.num_blocks,
                reason="resumed", held_s=max(now - old.pinned_at, 0.0)))
        self.mars_counters["pinned"] += 1
        self.mars_events.publish(make_event(
            "pin", session_id=meta.job_id, blocks=len(held), tau_s=tau, tool=meta.next_tool))
        return True

    # ------------------------------------------------------------ lifecycle
    def add_request(self, request: Request) -> None:
        super().add_request(request)
        now = time.time()
        meta = self._mars_session(request)
        self.mars_counters["submitted"] += 1
        self._mars_waiting_dirty = True
        sid = meta.job_id
        if sid is not None:
            ended = self._mars_round_end.pop(sid, None)
            if ended is not None:
                # the gap between two rounds is the tool phase (plus client overhead)
                end_ts, tool = ended
                self.mars_retention.observe_tool(meta.prev_tool or tool, max(now - end_ts, 0))
            pin = self._mars_pins.get(sid)
            if pin is not None:
                pin.resumed_by = request.request_id
        level = None
        if self._mars_order_on:
            self._mars_key(request)
            level_of = getattr(self.mars_ordering, "level_of", None)
            level = level_of(request.request_id) if level_of else None
        n = request.num_prompt_tokens
        self.mars_events.publish(make_event(
            "gpu_submit", session_id=sid, request_id=request.request_id,
            round=meta.round, prompt_tokens=n,
            projected_blocks=-(-n // self.block_size), level=level,
        ))

    def _update_request_with_output(self, request: Request, new_token_ids, *args, **kwargs):
        new_token_ids, stopped = super()._update_request_with_output(
            request, new_token_ids, *args, **kwargs)
        if new_token_ids and request.num_output_tokens == len(new_token_ids):
            now = time.time()
            rid = request.request_id
            meta = self._mars_session(request)
            cached = self._mars_cached.get(rid, 0)
            first = self._mars_first_sched.get(rid)
            if first is not None and request.num_preemptions == 0:
                observe = getattr(self.mars_retention, "observe_prefill", None)
                if observe is not None:
                    observe(max(request.num_prompt_tokens - cached, 0), max(now - first, 1e-6))
            self.mars_events.publish(make_event(
                "gpu_1st_token", session_id=meta.job_id, request_id=rid, round=meta.round,
                launch_delay_s=max(now - request.arrival_time, 0.0), cached_tokens=cached,
            ))
        return new_token_ids, stopped

    def _free_blocks(self, request: Request):
        # Reached only for finished requests (vLLM's own contract).
        if self._mars_pin_on and self._mars_try_pin(request):
            del self.requests[request.request_id]
            return
        super()._free_blocks(request)

    def _free_request(self, request: Request, *args, **kwargs):
        rid = request.request_id
        blocks = self._mars_blocks_of(rid)
        result = super()._free_request(request, *args, **kwargs)
        now = time.time()
        meta = self._mars_meta.pop(rid, None) or SessionMeta()
        for d in (self._mars_cached, self._mars_seen, self._mars_served,
                  self._mars_first_sched, self._mars_keys):
            d.pop(rid, None)
        self.mars_ordering.on_finished(rid, meta.job_id, now)
        if meta.job_id is not None:
            if meta.last_round:
                self._mars_round_end.pop(meta.job_id, None)
                if self._mars_session_sink is not None and meta.round is not None:
                    self._mars_session_sink(meta.round + 1)
            else:
                self._mars_round_end[meta.job_id] = (now, meta.next_tool)
                if len(self._mars_round_end) > 4096:
                    self._mars_round_end.popitem(last=False)
            pin = self._mars_pins.get(meta.job_id)
            if pin is not None and pin.resumed_by == rid:
                self._mars_unpin(meta.job_id, "finished", now)  # its next round ended unadmitted
        self.mars_counters["finished"] += 1
        self.mars_events.publish(make_event(
            "gpu_end", session_id=meta.job_id, request_id=rid,
            round=meta.round, freed_blocks=blocks,
            output_tokens=request.num_output_tokens,
            status=request.status.name.lower(),
        ))
        return result

    def _preempt_request(self, request: Request, *args, **kwargs) -> None:
        blocks = self._mars_blocks_of(request.request_id)
        super()._preempt_request(request, *args, **kwargs)
        self._mars_waiting_dirty = True
        self._mars_seen[request.request_id] = 0
        meta = self._mars_session(request)
        self.mars_counters["preempted"] += 1
        level = None
        level_of = getattr(self.mars_ordering, "level_of", None)
        if level_of is not None:
            level = level_of(request.request_id)
        self.mars_events.publish(make_event(
            "preempt", session_id=meta.job_id, request_id=request.request_id,
            round=meta.round, blocks=blocks, level=level,
        ))

    def reset_prefix_cache(self, *args, **kwargs):
        # vLLM refuses to reset while blocks are referenced: pins must go first
        now = time.time()
        for sid in self._mars_pins.sessions():
            self._mars_unpin(sid, "shutdown", now)
        return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        try:
            now = time.time()
            for sid in self._mars_pins.sessions():
                self._mars_unpin(sid, "shutdown", now)
            self._mars_snapshot(now)
            self.mars_events.close()
        finally:
            super().shutdown()


class MarsScheduler(_MarsSchedulerMixin, Scheduler):
    """Synchronous flavour (CPU, or GPU with async scheduling off)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mars_init()


class MarsAsyncScheduler(_MarsSchedulerMixin, AsyncScheduler):
    """Async flavour: keeps vLLM's overlap of scheduling and model execution on GPU."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._mars_init()


def make_scheduler(*args, vllm_config, **kwargs):
    """What ``--scheduler-cls`` points at: the flavour matching vLLM's async decision."""
    cls = MarsAsyncScheduler if vllm_config.scheduler_config.async_scheduling else MarsScheduler
    return cls(*args, vllm_config=vllm_config, **kwargs)
