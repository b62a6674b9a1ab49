"""The Opportunistic Co-Scheduler (paper §4.3): memory decisions inside the engine step.

Four rules, each applied where vLLM asks how many tokens a request gets
(``_reserve_prefill_lookahead``) or where a round ends (``_free_blocks``):

* **Admission headroom** (:mod:`mars.policy.engine.headroom`): a waiting or preempted call is
  admitted only if the running calls keep room to grow; refusing makes vLLM stop admitting for
  the step.
* **Chunk shrinking**: a running prefill chunk that cannot get its KV blocks is cut to what the
  free blocks hold, block-aligned, down to one block, before anything is preempted. New
  admissions keep vLLM's full-prompt check (letting them shrink too caused thrashing on the CPU
  testbed: 25 preemptions instead of 5-7).
* **Pinned retention**: a finished round whose session goes on to a tool keeps its blocks for
  the τ its retention policy grants; released when the next round is admitted (it then hits
  them), when τ ends or the policy's re-evaluation says so, and when memory is needed.
* **Reclaim before anything waits or is preempted**: pins go, least valuable first
  (``RetentionPolicy.reclaim_rank``), when a running call needs blocks (before vLLM preempts
  anyone) *and* when a waiting call cannot be admitted for lack of blocks (before the step
  gives up on it). The waiting call's own session's pin goes last: it is mostly that call's
  cache hit, and frees room only where the new prompt does not reuse it. The need is vLLM's
  own coordinator's count over every KV cache group. This is the **liveness rule**: a waiting
  call is never blocked by pins, so no state with waiting > 0, running = 0 and pinned > 0
  outlasts two steps (:meth:`CoScheduler.backstop` catches a count that disagrees with
  vLLM's), for every policy that pins.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from vllm.v1.core.single_type_kv_cache_manager import (ChunkedLocalAttentionManager,
                                                        FullAttentionManager,
                                                        SlidingWindowManager)
from vllm.v1.request import Request, RequestStatus

from mars.policy.engine.base import KvPressure, PinCandidate, RetentionPolicy
from mars.policy.engine.headroom import AdmissionHeadroom
from mars.engine.sched.calls import EngineCall
from mars.engine.sched.pins import PinnedRound, PinTable

_PINNABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
_ADMITTABLE = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
#: KV managers whose need for a sequence is at most one block per ``block_size`` tokens plus
#: one (a copy-on-write partial hit): for them a cheap upper bound can skip the exact count
_ATTENTION = (FullAttentionManager, SlidingWindowManager, ChunkedLocalAttentionManager)
#: sessions whose last round-end time is remembered (for tool-gap observations)
_MAX_ROUND_ENDS = 4096

Emit = Callable[..., None]


class CoScheduler:
    def __init__(self, retention: RetentionPolicy, kv_cache_manager, *, block_size: int,
                 total_blocks: int, lookahead_tokens: int, shrink: bool, pin: bool,
                 headroom_tokens: int, emit: Emit, counters: dict[str, int],
                 full_sequence_must_fit: bool = True) -> None:
        self.retention = retention
        self._kvm = kv_cache_manager
        self._pool = kv_cache_manager.block_pool
        self._bs = block_size
        self.total_blocks = total_blocks
        self._lookahead = lookahead_tokens
        #: vLLM admits a waiting call only if its whole sequence fits
        #: (``scheduler_reserve_full_isl``), else only its first chunk
        self._full_sequence = full_sequence_must_fit
        #: KV cache groups: a hybrid model (GPT-OSS: full and sliding-window attention)
        #: takes blocks in each for the same tokens
        managers = kv_cache_manager.coordinator.single_type_managers
        self._group_block_sizes = tuple(m.block_size for m in managers) \
            if all(isinstance(m, _ATTENTION) for m in managers) else None
        self._groups = max(1, len(managers))
        #: the call the admission hook let through last in this step (the backstop's clue)
        self._admitting: Request | None = None
        self.shrink_on = shrink
        self.pin_on = pin
        headroom = AdmissionHeadroom(headroom_tokens)
        self.headroom = headroom if headroom.tokens_per_running else None
        self.pins = PinTable(self._pool)
        self._emit = emit
        self._counters = counters
        #: blocks waiting calls still need (uncached work), refreshed on the tick
        self.waiting_demand_blocks = 0
        #: per session: when its last round ended and which tool followed (bounded)
        self._round_end: OrderedDict[str, tuple[float, str | None]] = OrderedDict()
        #: the request whose blocks the latest pin took (its gpu_end frees nothing)
        self.last_pinned: str | None = None
        #: per session, its latest call still in the engine (rounds may overlap)
        self._latest: dict[str, EngineCall] = {}

    @property
    def active(self) -> bool:
        """Whether any rule here can change what vLLM does."""
        return self.shrink_on or self.pin_on or self.headroom is not None

    # ------------------------------------------------------------------ state
    def pressure(self, running: int = 0, waiting: int = 0) -> KvPressure:
        return KvPressure(
            total_blocks=self.total_blocks,
            free_blocks=self._pool.get_num_free_blocks(),
            pinned_blocks=self.pins.pinned_blocks,
            waiting_demand_blocks=self.waiting_demand_blocks,
            running=running,
            waiting=waiting,
        )

    def refresh_demand(self, waiting, calls: dict[str, EngineCall]) -> None:
        """Blocks the waiting calls still need: their tokens minus what is computed or
        expected to hit the cache (a resumed round's own pinned context is not demand)."""
        bs = self._bs
        total = 0
        for r in waiting:
            c = calls.get(r.request_id)
            hit = max(r.num_computed_tokens, c.cached_tokens if c is not None else 0)
            total += -(-(r.num_tokens - hit) // bs)
        self.waiting_demand_blocks = total

    def _blocks(self, request_id: str):
        """The request's blocks in the first (full-attention) group, without copying."""
        try:
            return self._kvm.coordinator.single_type_managers[0].req_to_blocks.get(
                request_id, ())
        except (AttributeError, IndexError):
            return ()

    def blocks_of(self, request_id: str) -> int:
        return len(self._blocks(request_id))

    # ------------------------------------------------------------------ step rules
    def admission(self, request: Request, computed: int, n: int, running: int,
                  session_id: str | None, now: float, reserved: int = 0) -> int:
        """A waiting or preempted call is about to be admitted with ``n`` new tokens and
        ``computed`` tokens hit in the cache: reclaim pins it needs, then apply headroom.
        ``reserved``: blocks vLLM will keep back from it (for an async load, the in-flight
        prefills' remaining blocks).

        What the call needs is what vLLM's ``allocate_slots`` will ask the pool for, counted
        by vLLM's own coordinator (:meth:`_admission_blocks`): every KV cache group, the hit
        blocks that sit in the free queue (unreferenced cached blocks are taken from it too),
        the watermark. Releasing a pin whose blocks are this call's hits therefore frees no
        room for it, and is tried last."""
        bs = self._bs
        free = self._pool.get_num_free_blocks()
        headroom = self.headroom
        reserve = headroom.reserve_blocks(running, bs) if (headroom and running) else 0
        # blocks vLLM keeps back from this admission (an async load: other prefills' room)
        reserve += reserved
        self._admitting = request
        if free >= self._upper_bound(request) + reserve:
            return n
        hit = self._hit_blocks_by_group(request) if computed > request.num_computed_tokens \
            else self._kvm.empty_kv_cache_blocks.blocks

        def need() -> int:
            return self._admission_blocks(request, computed, n, running > 0, hit)

        wanted = need()
        # more than the pool: vLLM's way to defer a call a step (Mamba), not a lack of room
        if free < wanted + reserve and len(self.pins) and wanted <= self.total_blocks:
            self._counters["reclaimed_for_admission"] += 1
            self.reclaim(lambda: self._pool.get_num_free_blocks() >= need() + reserve, now,
                         last=session_id)
            free = self._pool.get_num_free_blocks()
        if headroom is not None and running and not headroom.allows(free, need(), running, bs):
            self._counters["held_back"] += 1
            self._admitting = None
            return 0  # vLLM stops admitting for this step
        return n

    def _upper_bound(self, request: Request) -> int:
        """A cheap bound on what :meth:`_admission_blocks` can say: every group holding the
        whole sequence plus a copy-on-write block. Only for attention groups (a Mamba group
        counts otherwise): without one, the bound is the pool itself (always counted)."""
        sizes = self._group_block_sizes
        if sizes is None:
            return self.total_blocks + 1
        tokens = request.num_tokens + self._lookahead
        return sum(-(-tokens // b) + 1 for b in sizes) + self._kvm.watermark_blocks

    def _admission_blocks(self, request: Request, computed: int, n: int, has_running: bool,
                          hit: tuple) -> int:
        """The free blocks vLLM 0.32's ``allocate_slots`` requires to admit ``request``:
        its own coordinator's count (the same calls with the same arguments as the
        scheduler's admission: the whole sequence with the admission cap when vLLM reserves
        it, and always the first chunk), plus the watermark it adds while others run.

        Counting one group's blocks, as this did, was short by the sliding-window group's
        on GPT-OSS-120B: admission saw room, vLLM did not, and with 93 calls waiting,
        none running and 93 % of the pool pinned under InferCept the engine stalled."""
        kvm = self._kvm
        need = self._blocks_to_allocate(request, computed, computed + n, hit)
        if self._full_sequence:
            full = min(request.num_tokens, kvm.max_model_len)
            need = max(need, self._blocks_to_allocate(request, computed, full, hit,
                                                      full_sequence=True))
        return need + (kvm.watermark_blocks if has_running else 0)

    def _blocks_to_allocate(self, request: Request, computed: int, main: int, hit: tuple,
                            full_sequence: bool = False) -> int:
        """vLLM's own KV coordinator's count of the blocks ``allocate_slots`` takes to
        grow ``request`` from ``computed`` to ``main`` tokens (plus the lookahead, or the
        whole sequence with vLLM's admission cap), over every KV cache group: one place for
        admission and for a running chunk's reclaim to ask it the scheduler's way."""
        kvm = self._kvm
        tokens = main if full_sequence else min(main + self._lookahead, kvm.max_model_len)
        return kvm.coordinator.get_num_blocks_to_allocate(
            request_id=request.request_id, num_tokens=tokens, new_computed_blocks=hit,
            num_encoder_tokens=0, total_computed_tokens=computed,
            num_local_computed_tokens=computed, num_tokens_main_model=main,
            apply_admission_cap=full_sequence,
            prefill_end=max(request.num_prompt_tokens, request.num_tokens - 1))

    def _hit_blocks_by_group(self, request: Request) -> tuple:
        """The blocks of the request's prefix-cache hit, per KV cache group (the lookup
        vLLM just made)."""
        return self._kvm.get_computed_blocks(request)[0].blocks

    def backstop(self, running: int, scheduled: dict, now: float) -> bool:
        """After a step: if the call the admission hook let through was not scheduled after
        all, nothing runs and pins hold blocks, vLLM's allocator refused it, so the count
        above and vLLM disagreed. Pins then go, least valuable first, until the call's
        upper bound fits (a stalled engine is the worst outcome a pin can have). Calls that
        never reached the hook (a guided-decoding grammar still compiling, a paused engine)
        leave the pins alone. Returns whether it had to act."""
        request, self._admitting = self._admitting, None
        if request is None or running or not len(self.pins):
            return False
        if request.request_id in scheduled or request.status not in _ADMITTABLE:
            return False
        bound = min(self._upper_bound(request), self.total_blocks)
        self.reclaim(lambda: self._pool.get_num_free_blocks() >= bound, now)
        return True

    def running_chunk(self, request: Request, computed: int, n: int, prefill: bool,
                      session_id: str | None, round_: int | None, now: float) -> int:
        """A running call asks for ``n`` tokens: shrink a prefill chunk to the free blocks,
        else reclaim pins before vLLM falls back to preempting anyone."""
        bs = self._bs
        free = self._pool.get_num_free_blocks()
        if free >= self._groups * (-(-n // bs) + 1):
            return n  # fast path: plenty of room in every group
        held = self.blocks_of(request.request_id)
        fit = (held + free) * bs - computed
        if n <= fit:
            return n
        if prefill and self.shrink_on and fit > 0:
            end = ((computed + fit) // bs) * bs
            granted = end - computed if end > computed else fit
            if granted >= min(bs, n) or granted == fit:
                self._counters["shrunk"] += 1
                self._emit("chunk_shrink", session_id=session_id,
                           request_id=request.request_id, round=round_,
                           requested_tokens=n, granted_tokens=granted)
                return granted
        if len(self.pins):
            # what vLLM's allocator will ask for this chunk, over every KV cache group
            need_free = self._blocks_to_allocate(request, computed, computed + n,
                                                 self._kvm.empty_kv_cache_blocks.blocks)
            if need_free <= self.total_blocks:
                self.reclaim(lambda: self._pool.get_num_free_blocks() >= need_free, now)
        return n

    # ------------------------------------------------------------------ pins
    def reclaim(self, enough: Callable[[], bool], now: float, last: str | None = None) -> None:
        """Release pins, least valuable first, until ``enough()``. The pin of session
        ``last`` (a waiting call's own session: its context is that call's cache hit) goes
        only after every other one, as a last resort: its blocks free room only where the
        new prompt does not reuse them (a rewritten history, the partial tail block)."""
        if enough():
            return
        kv = self.pressure()
        rank = self.retention.reclaim_rank
        order = sorted(self.pins.pins(),
                       key=lambda p: (p.cand.session_id == last, rank(p.cand, kv, now)))
        for pin in order:
            if enough():
                break
            self.unpin(pin.cand.session_id, "pressure", now)

    def judge(self, now: float, running: int, waiting: int) -> None:
        """Re-evaluate every pin whose next round has not arrived yet."""
        if not len(self.pins):
            return
        kv = self.pressure(running, waiting)
        keep = self.retention.keep
        for pin in self.pins.pins():
            if pin.resumed_by is not None:
                continue  # its next round is queued: keep until it is admitted (or reclaimed)
            sid = pin.cand.session_id
            if now - pin.pinned_at >= pin.tau_s:
                self.unpin(sid, "expired", now)
            elif not keep(pin.cand, kv, now):
                self.unpin(sid, "pressure", now)

    def unpin(self, session_id: str, reason: str, now: float) -> None:
        pin = self.pins.release(session_id)
        if pin is None:
            return
        self._counters["unpinned"] += 1
        self.retention.forget(session_id)
        self._emit("unpin", session_id=session_id, blocks=pin.num_blocks, reason=reason,
                   held_s=max(now - pin.pinned_at, 0.0))

    def release_all(self, reason: str, now: float) -> None:
        for sid in self.pins.sessions():
            self.unpin(sid, reason, now)

    def try_pin(self, request: Request, call: EngineCall | None, running: int, waiting: int,
                now: float, can_free: bool) -> bool:
        """At the end of a round: ask the retention policy; pin if it grants τ > 0."""
        meta = call.meta if call is not None else None
        if (not self.pin_on or meta is None or meta.job_id is None or meta.last_round
                or request.status not in _PINNABLE or not can_free):
            return False
        blocks = self._blocks(request.request_id)
        if not blocks:
            return False
        # charge only what this pin alone keeps: a block another request or pin references
        # stays resident (and cached) without it
        own = sum(1 for b in blocks if b.ref_cnt == 1)
        cand = PinCandidate(session_id=meta.job_id, blocks=own,
                            context_tokens=request.num_tokens, tool=meta.next_tool,
                            started=now, prompt_tokens=request.num_prompt_tokens)
        nxt = self._latest.get(meta.job_id)
        resumed_by = None
        if nxt is not None and nxt.request_id != request.request_id:
            # the next round arrived before this one ended (overlapping rounds)
            if nxt.req.status == RequestStatus.RUNNING:
                return False  # already admitted: nobody will resume from this pin
            resumed_by = nxt.request_id
        tau = self.retention.admit(cand, self.pressure(running, waiting), now)
        if tau <= 0:
            return False
        held = self._kvm.pop_blocks_for_free(request)
        old = self.pins.add(PinnedRound(cand=cand, blocks=held, tau_s=tau, pinned_at=now,
                                        resumed_by=resumed_by))
        if old is not None:
            self._emit("unpin", session_id=meta.job_id, blocks=old.num_blocks,
                       reason="resumed", held_s=max(now - old.pinned_at, 0.0))
        self._counters["pinned"] += 1
        self.last_pinned = request.request_id
        self._emit("pin", session_id=meta.job_id, blocks=len(held), tau_s=tau,
                   tool=meta.next_tool, rule=self.retention.decision_rule())
        return True

    # ------------------------------------------------------------------ lifecycle
    def on_arrival(self, call: EngineCall, now: float) -> None:
        sid = call.session_id
        if sid is None:
            return
        ended = self._round_end.pop(sid, None)
        if ended is not None:
            # the gap between two rounds is the tool phase (plus client overhead)
            end_ts, tool = ended
            self.retention.observe_tool(call.meta.prev_tool or tool, max(now - end_ts, 0))
        self._latest[sid] = call
        pin = self.pins.get(sid)
        if pin is not None:
            pin.resumed_by = call.request_id

    def on_admitted(self, call: EngineCall, now: float) -> None:
        """A fresh call got its first schedule (``cached_tokens`` is its actual hit)."""
        sid = call.session_id
        if sid is None:
            return
        pin = self.pins.get(sid)
        if pin is not None and pin.resumed_by == call.request_id:
            self.unpin(sid, "resumed", now)
        elif call.round:
            # a later round that found no pin: its queueing delay is what an eviction costs
            # (Continuum-Dy's T-bar)
            self.retention.observe_queue_delay(max(now - call.arrival_time, 0.0))

    def on_finished(self, call: EngineCall | None, request_id: str, now: float) -> None:
        meta = call.meta if call is not None else None
        if meta is None or meta.job_id is None:
            return
        sid = meta.job_id
        if self._latest.get(sid) is call:
            del self._latest[sid]
        pin = self.pins.get(sid)
        if meta.last_round:
            self._round_end.pop(sid, None)
            if meta.round is not None:
                self.retention.observe_session(meta.round + 1)
            if pin is not None and pin.resumed_by != request_id:
                # an earlier round of the same session still held: the session is over
                self.unpin(sid, "finished", now)
        else:
            self._round_end[sid] = (now, meta.next_tool)
            if len(self._round_end) > _MAX_ROUND_ENDS:
                self._round_end.popitem(last=False)
        pin = self.pins.get(sid)
        if pin is not None and pin.resumed_by == request_id:
            self.unpin(sid, "finished", now)  # its next round ended unadmitted
