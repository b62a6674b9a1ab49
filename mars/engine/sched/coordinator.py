"""The Priority-Aware Coordinator (paper §4.3): the order of waiting and running calls.

vLLM serves ``running`` front to back, preempts from its back (FCFS policy:
``self.running.pop()``) and admits from the front of ``waiting``. Keeping both lists sorted by
the ordering policy's key therefore gives priority service *and* priority-aligned eviction
with vLLM's own loop. This class owns that sorting and the two rules that make priority hold
inside a step:

* **Keys** are refreshed on the adapter's tick, and only for calls whose key the policy's
  ``horizon`` says may have moved, so the cost per step stays small and flat in the batch.
  Calls admitted in a step are appended by vLLM after the running loop; they are bisected into
  the sorted list at the next step instead of re-sorting everything.
* **Yielding**: vLLM serves running requests before waiting ones, so a running long prefill
  would take the whole token budget from short calls that just arrived. A running prefill
  ranked below admissible waiting calls gives up the tokens they need (down to the next block
  boundary, so it always progresses). "Admissible" counts a waiting call's *uncached* work
  (its expected prefix-cache hit is known from the lookup at arrival) and stops at the first
  call that would not fit the free blocks, as vLLM's admission loop does.
* **Bounded interference**: once short calls are admitted and decoding, a long prefill
  ranked below them would take a full chunk every step, and their token rate would be that of
  big prefill steps. A running prefill ranked at least two levels (a 4x larger size class)
  below the best running decode gets a *share of the engine's time*: for every second of
  steps without it, it may add ``prefill_interference`` seconds of prefill to later steps. It
  runs in whole chunks while it has credit and sits out (no tokens, a step of decodes only)
  while it has none; the time a chunk added to its step (the step's time minus a decode
  step's, :class:`~mars.policy.engine.step_stats.StepStats`) is charged after the step. With the
  default 1.0 the higher-priority calls' token rate at most halves, whatever the model and
  the GPU, and the prefill still progresses at half the engine's rate. (An earlier rule
  capped the chunk at one decode step's worth of prefill *per step*; on an MoE model a small
  chunk touches many more experts, so that cap came out at 16-30 tokens a step and an
  emulated H100 gave a 60K-token prompt its first token after 50-70 s instead of 5.)
  When the better-ranked call is a waiting one (admitted after vLLM's running loop) the
  prefill keeps at least one block a step, so the step is never empty.

Mechanism only: what a key is comes from :class:`mars.policy.engine.base.OrderingPolicy`.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Sequence
from itertools import chain

from vllm.v1.request import Request

from mars.policy.engine.base import OrderingPolicy
from mars.policy.engine.step_stats import StepStats
from mars.engine.sched.calls import EngineCall


#: a prefill is bounded only when it ranks this many levels below the best decode (two MLFQ
#: levels: a size class at least 4x larger) -- the head-of-line case the rule is for
INTERFERENCE_LEVEL_GAP = 2


class Coordinator:
    def __init__(self, policy: OrderingPolicy, calls: dict[str, EngineCall], *,
                 block_size: int, token_budget: int, max_running: int,
                 free_blocks: Callable[[], int], prefill_yield: bool,
                 step_stats: StepStats | None = None, interference: float = 0.0) -> None:
        self.policy = policy
        #: whether this policy orders at all (arrival order is vLLM's own: nothing to do)
        self.active = policy.reorders
        self.prefill_yield = prefill_yield and self.active
        self._calls = calls
        self._bs = block_size
        self._budget = token_budget
        self._max_running = max_running
        self._free_blocks = free_blocks
        self._sortkey = lambda r: calls[r.request_id].key
        self._waiting_dirty = True
        self._running_dirty = True
        self._sorted_tail: Request | None = None
        #: keys of the admissible waiting calls (sorted) and prefix sums of their token demand
        self._wkeys: list[tuple] = []
        self._wdemand: list[int] = []
        self._stats = step_stats
        self._interference = interference if (self.prefill_yield and step_stats) else 0.0
        #: key of the best running decode this step (None: none, or not looked for yet)
        self._best_decode: tuple | None = None
        self._best_decode_level: int | None = None
        self._decode_scanned = False
        #: level of the best admissible waiting call (None: none)
        self._wtop_level: int | None = None
        #: bounded interference: seconds of prefill the bounded prefills may still add (<0:
        #: they sit out), and what the current step did with them (None: no bound applied)
        self._credit = 0.0
        self._bounded_step: bool | None = None

    # ------------------------------------------------------------------ lifecycle
    def on_arrival(self, call: EngineCall, now: float) -> int | None:
        """Key a new call; returns its level for the ``gpu_submit`` event."""
        self._waiting_dirty = True
        if not self.active:
            return None
        call.key = self.policy.key(call, now)
        return self.policy.level_of(call.request_id)

    def on_admitting(self, call: EngineCall, computed: int) -> None:
        """vLLM is about to admit the call with ``computed`` tokens already in KV (prefix
        hits, also after a preemption): those are not service, so counting starts there."""
        call.seen = computed

    def on_preempted(self, call: EngineCall) -> None:
        # ``seen`` is kept: the cache hits found at re-admission are not service again
        call.until = 0.0  # re-key at the next tick
        self._waiting_dirty = True

    def on_finished(self, call: EngineCall | None, request_id: str, now: float) -> None:
        meta = call.meta if call is not None else None
        self.policy.on_finished(request_id, meta.job_id if meta else None, now)
        if meta is not None and meta.last_round and meta.job_id is not None:
            self.policy.on_session_end(meta.job_id, now)

    def level_of(self, request_id: str) -> int | None:
        return self.policy.level_of(request_id)

    # ------------------------------------------------------------------ keys
    def refresh(self, running: list[Request], waiting, now: float,
                held: Sequence[Request] = ()) -> None:
        """Charge the service seen since the last tick and re-key calls whose key may move
        (``held``: the waiting calls that hold their blocks, see :meth:`sort`)."""
        if not self.active:
            return
        policy = self.policy
        key, served, horizon = policy.key, policy.served, policy.horizon
        calls = self._calls
        changed = False
        for r in running:
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
        for r in chain(held, waiting):
            c = calls[r.request_id]
            if now >= c.until:
                old = c.key
                c.key = key(c, now)
                c.horizon, c.until = horizon(c, now)
                if c.key != old:
                    self._waiting_dirty = True
        if changed:
            self._running_dirty = True

    # ------------------------------------------------------------------ order
    def sort(self, running: list[Request], waiting, held: Sequence[Request] = ()) -> None:
        """Once per step, before vLLM's loop: the order it will serve and preempt by.

        ``held``: the waiting calls that hold their blocks and that vLLM admits before any
        of ``waiting``, in its order (a round whose context was loaded back from the host
        tier). vLLM keeps them in a queue of their own; left out, a running long prefill
        never yielded to a returning short round of a better-ranked session."""
        self._decode_scanned = False  # the best running decode is looked up again this step
        self._bounded_step = None
        if not self.active:
            return
        keyf = self._sortkey
        if self._waiting_dirty:
            if len(waiting) > 1:
                items = sorted(waiting, key=keyf)
                waiting.clear()
                waiting.extend(items)
            self._waiting_dirty = False
        if running and (self._running_dirty or running[-1] is not self._sorted_tail):
            if self._running_dirty or not self._insert_new(running, keyf):
                running.sort(key=keyf)
            self._running_dirty = False
        self._sorted_tail = running[-1] if running else None
        if self.prefill_yield:
            self._admissible_prefix(running, waiting, held)

    def _insert_new(self, running: list, keyf) -> bool:
        """vLLM appends the calls it admitted after the running ones (and removes finished
        calls in place): when the list was sorted last step, only that tail is out of order.
        False when the old tail is gone (preempted): sort everything."""
        tail = self._sorted_tail
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

    def _admissible_prefix(self, running: list, waiting, held: Sequence[Request] = ()) -> None:
        """Keys and cumulative token demand of the waiting calls vLLM could admit this step
        (they fit in the free blocks and the sequence slots), in the order it admits them
        (``held`` first, then ``waiting``). Running prefills yield only to these: yielding to
        a call that cannot be admitted anyway would waste the budget. A call's demand is its
        uncached work, capped at the step budget (a long continuation takes a budget-sized
        chunk, not its whole prompt, in one step). Kept as keys sorted ascending, each with
        the budget vLLM must reach to admit every call ranked at or above it: the cumulative
        demand along the admission order, at most to the last such call (with ``held``
        empty, ``waiting`` is sorted already and that is the plain prefix sum)."""
        order: list[tuple[tuple, int, str]] = []
        if held or waiting:
            budget = self._budget
            slots = self._max_running - len(running)
            free = self._free_blocks()
            bs = self._bs
            acc = blocks = 0
            calls = self._calls
            for r in chain(held, waiting):
                if slots <= 0 or acc >= budget:
                    break
                c = calls[r.request_id]
                need = r.num_tokens - max(r.num_computed_tokens, c.cached_tokens)
                blocks += -(-need // bs)
                if blocks > free:
                    break
                acc += min(need, budget)
                order.append((c.key, acc, r.request_id))
                slots -= 1
        if held:
            order.sort(key=lambda e: e[0])  # (stable; ``waiting`` alone is sorted already)
        wkeys: list[tuple] = []
        demand: list[int] = []
        reach = 0
        for key, cum, _ in order:
            reach = max(reach, cum)
            wkeys.append(key)
            demand.append(reach)
        self._wtop_level = self.policy.level_of(order[0][2]) if order else None
        self._wkeys, self._wdemand = wkeys, demand

    def yield_tokens(self, request: Request, computed: int, n: int) -> int:
        """Tokens a running prefill keeps after giving admissible better calls theirs."""
        if not self._wkeys:
            return n
        idx = bisect_left(self._wkeys, self._calls[request.request_id].key)
        if idx == 0:
            return n
        keep = self._budget - self._wdemand[idx - 1]
        bs = self._bs
        floor = bs - (computed % bs)  # at least up to the next block boundary
        granted = max(keep, floor)
        return granted if granted < n else n

    def interference_cap(self, request: Request, computed: int, n: int,
                         running: list[Request]) -> int:
        """The tokens a running prefill ranked well below a running decode or an admissible
        waiting call (which vLLM admits after the running loop, in this step) gets this
        step: all of ``n`` while the bounded prefills have time credit, else none (or one
        block when the better call is a waiting one)."""
        if not self._interference or self._stats.decode_step_s is None:
            return n
        if not self._decode_scanned:
            # the first decode in the sorted running list is the best-ranked one
            self._decode_scanned = True
            self._best_decode = None
            self._best_decode_level = None
            calls = self._calls
            for r in running:
                if r.num_computed_tokens >= r.num_prompt_tokens:
                    self._best_decode = calls[r.request_id].key
                    self._best_decode_level = self.policy.level_of(r.request_id)
                    break
        mine = self._calls[request.request_id].key
        top = None
        decode_ahead = self._best_decode is not None and self._best_decode < mine
        if decode_ahead:
            top = self._best_decode_level
        if self._wkeys and self._wkeys[0] < mine and self._wtop_level is not None:
            top = self._wtop_level if top is None else min(top, self._wtop_level)
        level = self.policy.level_of(request.request_id)
        if level is None or top is None or level - top < INTERFERENCE_LEVEL_GAP:
            # comparable size classes: spreading the prefill over more steps adds the same
            # total time to the others and keeps its partial KV resident longer (the first
            # victim when decodes grow: 108 instead of 39 preemptions in the agent-loop
            # simulation when every lower-ranked prefill was bounded)
            return n
        if self._credit >= 0.0:
            self._bounded_step = True
            return n
        if self._bounded_step is None:
            self._bounded_step = False
        if decode_ahead:
            return 0  # the better decode is already in this step: it runs without us
        bs = self._bs
        return min(n, bs - computed % bs)

    def take_bounded(self) -> bool | None:
        """Whether the step just scheduled ran a bounded prefill (None: none was ranked
        below a better call), forgotten here, to :meth:`settle` when the step ends: before
        the next one is scheduled (synchronous scheduling) or when its output arrives, after
        the next one (async; the scheduler keeps it with the step until then)."""
        ran, self._bounded_step = self._bounded_step, None
        return ran

    def reserve(self, ran: bool | None, prefill_tokens: int) -> float:
        """Async scheduling: a step with a bounded chunk was just scheduled and the next one
        will be scheduled before it ends. Charge its expected added time now (its prefill
        tokens at the measured prefill rate), so the next step sees the chunk in flight --
        else every bounded prefill gets a second chunk before the first is paid for. The
        charge is returned, and undone when :meth:`settle` charges the measured time."""
        rate = self._stats.prefill_tokens_per_s
        if not ran or rate is None or prefill_tokens <= 0:
            return 0.0
        charge = prefill_tokens / rate
        self._credit -= charge
        return charge

    def settle(self, ran: bool | None, seconds: float, reserved: float = 0.0) -> None:
        """A step that took ``seconds`` ended: charge the time a bounded chunk added to the
        bounded prefills' credit (less what :meth:`reserve` charged for it already), or
        credit them their share of a step without one."""
        if ran is None:
            return
        self._credit += reserved
        if ran:  # a bound applies only once a decode step has been measured
            self._credit -= max(0.0, seconds - self._stats.decode_step_s)
        else:
            self._credit += self._interference * seconds
