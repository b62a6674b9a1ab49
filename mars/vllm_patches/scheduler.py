"""The mars scheduler classes, loaded by vLLM's EngineCore through ``--scheduler-cls``.

They subclass vLLM's own ``Scheduler`` / ``AsyncScheduler`` and override only narrow hooks;
``schedule()`` itself is never copied. What each hook does, and why it is enough:

* **Order** (``schedule`` entry). vLLM serves ``self.running`` front to back and, under its
  FCFS policy, preempts from the back (``self.running.pop()``); it admits from the front of
  ``self.waiting``. Sorting both lists by the ordering policy's key therefore gives priority
  service *and* priority-aligned eviction (lowest level, largest initial footprint preempted
  first) with vLLM's own loop. Requests admitted in a step are appended after the running
  loop, so a just-admitted call is never a victim in that step. Keys are refreshed on a short
  tick (``tick_s``), and within a tick only for calls whose key the policy's ``horizon`` says
  may have changed, so the added cost per step stays small and flat in the batch size.
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
* **Headroom** (same hook, waiting loop). Admission has its own rule instead
  (:mod:`mars.policy.headroom`): a waiting or preempted call is admitted only if the running
  calls keep room to grow; returning 0 makes vLLM stop admitting for the step.
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
from bisect import bisect_left, insort
from collections import OrderedDict
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from mars.policy.base import FcfsOrdering, KvPressure, PinCandidate, SessionMeta
from mars.policy.events import make_event
from mars.policy.headroom import AdmissionHeadroom
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


def _no_horizon(call, now: float) -> tuple[float, float]:
    return 0, 0.0


class _Call:
    """What the adapter tracks about one request; it doubles as the policies' ``CallView``.

    One object per request, made at ``add_request`` and dropped at ``_free_request``: the
    static fields are set once and the moving ones (computed / output tokens, blocks, status)
    are read through from vLLM's ``Request`` when a policy looks, so refreshing keys costs no
    allocation and no copying (building a fresh view per call per tick was most of the
    adapter's cost per step).
    """

    __slots__ = ("req", "request_id", "meta", "session_id", "round", "prompt_tokens",
                 "max_tokens", "arrival_time", "cached_tokens", "seen", "pending",
                 "last_served", "first_sched", "key", "horizon", "until", "_bs")

    def __init__(self, req: Request, meta: SessionMeta, block_size: int) -> None:
        self.req = req
        self.request_id = req.request_id
        self.meta = meta
        self.session_id = meta.job_id
        self.round = meta.round
        self.prompt_tokens = req.num_prompt_tokens
        self.max_tokens = req.max_tokens
        self.arrival_time = req.arrival_time
        #: prefix-cache hit at admission (service is counted from there); 0 until admitted
        self.cached_tokens = 0
        #: computed tokens already observed, and those not yet charged to the ordering policy
        self.seen = 0
        self.pending = 0
        self.last_served = req.arrival_time
        #: when the request was first scheduled (None: not yet)
        self.first_sched: float | None = None
        self.key: tuple = ()
        #: the policy's promise: the key holds for ``horizon`` more tokens and until ``until``
        self.horizon: float = 0
        self.until = 0.0
        self._bs = block_size

    @property
    def computed_tokens(self) -> int:
        return self.req.num_computed_tokens

    @property
    def output_tokens(self) -> int:
        return self.req.num_output_tokens

    @property
    def num_blocks(self) -> int:
        return -(-self.req.num_tokens // self._bs)

    @property
    def running(self) -> bool:
        return self.req.status == RequestStatus.RUNNING


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
        headroom = AdmissionHeadroom(int(cfg.get("admit_headroom_tokens",
                                                 spec.admit_headroom_tokens)))
        self._mars_headroom = headroom if headroom.tokens_per_running else None
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
        self._mars_calls: dict[str, _Call] = {}
        calls = self._mars_calls
        self._mars_sortkey = lambda r: calls[r.request_id].key
        # admitted, no output token yet: watched at each step for ``gpu_1st_token``
        self._mars_awaiting_first: dict[str, _Call] = {}
        # charge service and re-key in one policy call where the policy offers it
        self._mars_served = getattr(self.mars_ordering, "served", None) or self._mars_charge_key
        # how long a key stays valid; without the policy's word, re-key on every tick
        self._mars_horizon = getattr(self.mars_ordering, "horizon", None) or _no_horizon
        # vLLM's own lookahead rule, bound once (a super() lookup per request per step shows);
        # None when it is the identity: its only effect is for multi-token-prediction drafters
        # (num_prefill_lookahead > 1), see Scheduler._reserve_prefill_lookahead
        stock = super()._reserve_prefill_lookahead
        self._mars_stock_lookahead = stock if self.num_prefill_lookahead > 1 else None
        if not (self._mars_order_on or self._mars_shrink_on or self._mars_pin_on
                or self._mars_headroom is not None):
            # nothing to yield, shrink, reclaim or hold back (fcfs and the pure-retention-less
            # baselines): vLLM calls its own method directly, per request, every step
            self._reserve_prefill_lookahead = stock
        # per-session state: when the last round ended and which tool followed (bounded)
        self._mars_round_end: OrderedDict[str, tuple[float, str | None]] = OrderedDict()
        self._mars_next_tick = 0.0
        self._mars_roomy = True
        self._mars_budget_blocks = -(-self.max_num_scheduled_tokens // self.block_size) + 1
        self._mars_blocks_per_running = 2 + -(-self.num_lookahead_tokens // self.block_size)
        self._mars_next_snapshot = 0.0
        self._mars_sorted_tail: Request | None = None
        self._mars_waiting_dirty = True
        self._mars_running_dirty = True
        # waiting keys (sorted) and the prefix sums of their token demand, for yielding
        self._mars_wkeys: list[tuple] = []
        self._mars_wdemand: list[int] = []
        self._mars_waiting_demand_blocks = 0
        self.mars_counters = {"submitted": 0, "finished": 0, "preempted": 0, "steps": 0,
                              "shrunk": 0, "yielded": 0, "held_back": 0, "pinned": 0,
                              "unpinned": 0}
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
        call = self._mars_calls.get(request.request_id)
        if call is not None:
            return call.meta
        sp = request.sampling_params
        extra = sp.extra_args if sp is not None else None
        return SessionMeta.from_extra_args(extra, getattr(request, "session_id", None))

    def _mars_blocks_of(self, request_id: str) -> int:
        # the first (full-attention) group's block list, without building id lists
        try:
            mgr = self.kv_cache_manager.coordinator.single_type_managers[0]
            return len(mgr.req_to_blocks.get(request_id, ()))
        except (AttributeError, IndexError):
            return 0

    def _mars_charge_key(self, call: _Call, tokens: int, now: float) -> tuple:
        self.mars_ordering.on_scheduled(call, tokens, now)
        return self.mars_ordering.key(call, now)

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
        if self._mars_order_on:
            key, served, horizon = self.mars_ordering.key, self._mars_served, self._mars_horizon
            calls = self._mars_calls
            changed = False
            for r in self.running:
                c = calls[r.request_id]
                done = r.num_computed_tokens
                if done != c.seen:
                    if done > c.seen:
                        c.pending += done - c.seen
                    c.seen = done
                    c.last_served = now
                    if c.pending < c.horizon and now < c.until:
                        continue  # the policy said this much service cannot move the key
                elif now < c.until:
                    continue
                old = c.key
                if c.pending:
                    c.key = served(c, c.pending, now)
                    c.pending = 0
                else:
                    c.key = key(c, now)
                c.horizon, c.until = horizon(c, now)
                changed = changed or c.key != old
            for r in self.waiting:
                c = calls[r.request_id]
                if now >= c.until:
                    old = c.key
                    c.key = key(c, now)
                    c.horizon, c.until = horizon(c, now)
                    if c.key != old:
                        self._mars_waiting_dirty = True
            if changed:
                self._mars_running_dirty = True
        bs = self.block_size
        self._mars_waiting_demand_blocks = sum(
            -(-(r.num_tokens - r.num_computed_tokens) // bs) for r in self.waiting)
        if len(self._mars_pins):
            self._mars_judge_pins(now)

    def _mars_sort(self) -> None:
        keyf = self._mars_sortkey
        if self._mars_waiting_dirty:
            if len(self.waiting) > 1:
                items = sorted(self.waiting, key=keyf)
                self.waiting.clear()
                self.waiting.extend(items)
            self._mars_waiting_dirty = False
        running = self.running
        if running and (self._mars_running_dirty or running[-1] is not self._mars_sorted_tail):
            if self._mars_running_dirty or not self._mars_insert_new(running, keyf):
                running.sort(key=keyf)
            self._mars_running_dirty = False
        self._mars_sorted_tail = running[-1] if running else None
        self._mars_admissible_prefix()

    def _mars_insert_new(self, running: list, keyf) -> bool:
        """vLLM appends the calls it admitted after the running ones (and removes finished
        calls in place): when the list was sorted last step, only that tail is out of order.
        Insert it by bisection instead of re-sorting (re-keying every element each step was
        the sort's cost). False when the old tail is gone (preempted): sort everything."""
        tail = self._mars_sorted_tail
        if tail is None:
            return False
        i = len(running) - 1
        while i >= 0 and running[i] is not tail:
            i -= 1
        if i < 0:
            return False
        new = running[i + 1:]
        del running[i + 1:]
        for r in new:
            insort(running, r, key=keyf)
        return True

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
            calls = self._mars_calls
            for r in self.waiting:
                if slots <= 0 or acc >= budget:
                    break
                need = r.num_tokens - r.num_computed_tokens
                blocks += -(-need // bs)
                if blocks > free:
                    break
                acc += need
                wkeys.append(calls[r.request_id].key)
                demand.append(acc)
                slots -= 1
        self._mars_wkeys, self._mars_wdemand = wkeys, demand

    # ------------------------------------------------------------ step hooks
    def schedule(self, *args, **kwargs):
        now = time.time()
        if self._mars_awaiting_first:
            self._mars_first_tokens(now)
        if now >= self._mars_next_tick:
            self._mars_next_tick = now + self._mars_tick_s
            self._mars_tick(now)
        if self._mars_order_on:
            self._mars_sort()
        # whether this step's allocations cannot run out of blocks whatever they are (every
        # running call takes at most a couple of blocks, plus the whole token budget as
        # prefill): then no decode can need a pin reclaimed, and decodes skip the hook
        self._mars_roomy = not self._mars_pins.pinned_blocks or (
            self._mars_pool.get_num_free_blocks()
            >= self._mars_blocks_per_running * len(self.running) + self._mars_budget_blocks)
        self.mars_counters["steps"] += 1
        out = super().schedule(*args, **kwargs)
        if now >= self._mars_next_snapshot:
            # after scheduling: a request that just arrived at an idle engine is running
            # now, not "waiting with nothing running" (which the sidecar reads as a queue)
            self._mars_next_snapshot = now + self._mars_snapshot_s
            self._mars_snapshot(now)
        if out.scheduled_new_reqs:
            calls = self._mars_calls
            for new in out.scheduled_new_reqs:
                c = calls.get(new.req_id)
                if c is None or c.first_sched is not None:
                    continue
                # computed tokens at admission of a fresh request = its prefix-cache hit;
                # service is counted from there, so cache hits are not service
                c.cached_tokens = c.seen = new.num_computed_tokens
                c.first_sched = now
                self._mars_awaiting_first[c.request_id] = c
                sid = c.session_id
                if sid is not None:
                    pin = self._mars_pins.get(sid)
                    if pin is not None and pin.resumed_by == c.request_id:
                        self._mars_unpin(sid, "resumed", now)
                    elif c.round and self._mars_queue_delay_sink is not None:
                        # a later round that found no pin: its queueing delay is what an
                        # eviction costs (Continuum-Dy's T-bar)
                        self._mars_queue_delay_sink(max(now - c.arrival_time, 0.0))
        return out

    def _mars_first_tokens(self, now: float) -> None:
        """``gpu_1st_token`` for admitted calls whose first output token came in the last
        step. Checked here, over the few calls still in prefill, rather than in vLLM's
        per-request output hook, which runs for every running request on every step."""
        done = [c for c in self._mars_awaiting_first.values() if c.req.num_output_tokens]
        for c in done:
            self._mars_note_first_token(c, now)

    def _mars_note_first_token(self, c: _Call, now: float) -> None:
        del self._mars_awaiting_first[c.request_id]
        req = c.req
        if c.first_sched is not None and req.num_preemptions == 0:
            observe = getattr(self.mars_retention, "observe_prefill", None)
            if observe is not None:
                observe(max(c.prompt_tokens - c.cached_tokens, 0),
                        max(now - c.first_sched, 1e-6))
        self.mars_events.publish(make_event(
            "gpu_1st_token", ts=now, session_id=c.session_id, request_id=c.request_id,
            round=c.round, launch_delay_s=max(now - c.arrival_time, 0.0),
            cached_tokens=c.cached_tokens,
        ))

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        stock = self._mars_stock_lookahead
        n = stock(request, num_computed_tokens, num_new_tokens) if stock is not None \
            else max(num_new_tokens, 0)
        prefill = num_computed_tokens < request.num_prompt_tokens
        if not prefill and self._mars_roomy:
            return n  # decodes: nothing to yield or shrink, no pin to reclaim (hot path)
        if n <= 0:
            return n
        if request.status != RequestStatus.RUNNING:
            # admission (vLLM's full-prompt check still applies after this)
            headroom = self._mars_headroom
            if headroom is not None and self.running:
                bs = self.block_size
                need = -(-(request.num_tokens - num_computed_tokens) // bs)
                if not headroom.allows(self._mars_pool.get_num_free_blocks(), need,
                                       len(self.running), bs):
                    self.mars_counters["held_back"] += 1
                    return 0  # vLLM stops admitting for this step
            return n
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
        idx = bisect_left(self._mars_wkeys, self._mars_calls[request.request_id].key)
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
        call = self._mars_calls.get(request.request_id)
        meta = call.meta if call is not None else None
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
        known = request.request_id in self.requests
        super().add_request(request)
        if known:
            return  # a streaming-input session's next chunk: the request is already tracked
        now = time.time()
        meta = self._mars_session(request)
        call = self._mars_calls[request.request_id] = _Call(request, meta, self.block_size)
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
            call.key = self.mars_ordering.key(call, now)
            level_of = getattr(self.mars_ordering, "level_of", None)
            level = level_of(request.request_id) if level_of else None
        n = request.num_prompt_tokens
        self.mars_events.publish(make_event(
            "gpu_submit", ts=now, session_id=sid, request_id=request.request_id,
            round=meta.round, prompt_tokens=n,
            projected_blocks=-(-n // self.block_size), level=level,
        ))

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
        call = self._mars_calls.pop(rid, None)
        if call is not None and rid in self._mars_awaiting_first and request.num_output_tokens:
            self._mars_note_first_token(call, now)  # its first token was also its last
        self._mars_awaiting_first.pop(rid, None)
        meta = call.meta if call is not None else SessionMeta()
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
        call = self._mars_calls.get(request.request_id)
        if call is not None:
            call.seen = 0  # its KV is gone: recomputing it is service again
            call.until = 0.0  # re-key at the next tick
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
