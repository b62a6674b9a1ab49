"""Session admission as a plain state machine (sans-IO): requests and events in, admissions,
session ends and events out, ``now`` passed in.

The policy (which sessions, how many) is :class:`mars.policy.control.admission.BalanceAndAdmit`; this
core keeps the per-session bookkeeping around it and decides when a session starts and ends:

* The first request of a **new** session enqueues it (``QueueFull`` when the queue is full);
  the session is admitted by a later :meth:`step`. In pass-through mode (``admission=False``)
  it is admitted at once and nothing ever waits.
* A session **ends** (its window slot is released) on the explicit last-round marker once that
  request is done, on :meth:`end_session` (``DELETE /v1/mars/sessions/{id}``), after
  ``idle_timeout_s`` without requests, open tool calls or tool events (:meth:`reap_idle`),
  when its client disconnects with nothing else in flight, and, for one-round sessions (no
  identity), when the request ends.
* A waiter that gives up (timeout, disconnect) withdraws the session from the queue when it
  was the last one waiting for it (:meth:`give_up`), so nothing leaks a queue entry or a slot.
* A waiter's timeout is a **stall** bound, not a bound on the wait (:meth:`wait_deadline`):
  it runs out only once nothing has moved for the whole bound -- no admission, no admitted
  session ended, no request finished well, no engine output (:data:`PROGRESS_KINDS`: the
  engine publishes a KV snapshot every half second while it steps) and no tool call of an
  admitted session ended. Under load the queue moves and a session is served late rather
  than refused (the paper's admission queues sessions; it sheds none): a fixed bound on the
  wait shed 25 of 300 tasks past twice the saturation rate in ``mars sim``, where every
  baseline served them all. What does not count: a request forwarded or failed (a dead
  engine with retrying clients), tool starts and counts (a tool runner's chatter while the
  engine hangs).

The asyncio sidecar (:mod:`mars.sidecar.control`) is a thin shell: it turns "queued" into an
awaited future, resolves it from :attr:`Listener.admitted`, fails it from
:attr:`Listener.ended`, and calls :meth:`step` on a timer and after :meth:`observe` says an
event may change the decision. The simulator drives the same object on a virtual clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mars.policy.control.admission import AdmissionConfig, BalanceAndAdmit, QueueFull
from mars.policy.control.packing import QueuedSession
from mars.protocol.events import TOOL_KINDS, make_event

#: events after which a control step may admit someone
STEP_KINDS = frozenset({"gpu_end", "gpu_1st_token", "kv_snapshot", "preempt", "scheduler_start",
                        "tool_start", "tool_end", "tool_num"})
#: engine events that show it working (wait_deadline's progress): it stepped, a call got its
#: first token or ended
PROGRESS_KINDS = frozenset({"kv_snapshot", "gpu_1st_token", "gpu_end"})
#: events BalanceAndAdmit / DualPressureState read (the others would only cost a dispatch on
#: the hot path); our own session_end is not among them: end() already released the session.
#: ``gpu_submit`` updates an admitted session's projected context (the packing room);
#: ``tool_enqueue`` is a sign of life of a session between rounds (quiet sessions)
OBSERVED_KINDS = STEP_KINDS | {"request_end", "gpu_submit", "tool_enqueue"}
_TOOL_KINDS = frozenset(TOOL_KINDS)

__all__ = ["AdmissionCore", "CoreConfig", "Listener", "QueueFull", "SessionState"]


@dataclass(frozen=True, slots=True)
class CoreConfig:
    admission: bool
    admission_config: AdmissionConfig
    idle_timeout_s: float = 300.0
    #: a window event is re-emitted at least this often even when nothing changed
    window_heartbeat_s: float = 5.0


@dataclass(slots=True, eq=False)
class SessionState:
    id: str
    one_shot: bool
    created: float
    last_active: float
    admitted_at: float | None = None
    #: requests forwarded and not finished
    inflight: int = 0
    #: requests waiting for this session's admission
    waiting: int = 0
    requests: int = 0
    #: end the session once nothing is in flight (set by the last-round marker)
    end_reason: str | None = None
    ended: bool = False

    @property
    def is_admitted(self) -> bool:
        return self.admitted_at is not None


@dataclass(slots=True)
class Listener:
    """What the core tells its shell (plain callbacks; the core does no I/O itself)."""

    #: an event for the unified stream (``make_event`` dict)
    emit: Callable[[dict[str, Any]], None]
    #: a queued session was admitted (wake its waiters)
    admitted: Callable[[SessionState, float], None] = lambda s, queued_s: None
    #: a session ended (fail its waiters if it was still queued)
    ended: Callable[[SessionState, str], None] = lambda s, reason: None
    #: a queued session left for another engine's queue (its waiters follow it there)
    requeued: Callable[[SessionState], None] = lambda s: None


class AdmissionCore:
    def __init__(self, config: CoreConfig, listener: Listener, *,
                 oneshot_prefix: str = "oneshot-") -> None:
        self.config = config
        self.admission = config.admission
        self.balance = BalanceAndAdmit(config.admission_config)
        self.sessions: dict[str, SessionState] = {}
        self._out = listener
        self._oneshot = itertools.count(1)
        self._oneshot_prefix = oneshot_prefix
        self._last_window: tuple | None = None
        self._last_window_at = -float("inf")
        self.admitted_total = 0
        self.steps = 0
        #: when the admitted sessions last made progress (see :meth:`wait_deadline`)
        self.last_progress = -float("inf")

    # ------------------------------------------------------------------ introspection
    @property
    def in_use(self) -> int:
        """Window occupancy: sessions holding a slot (admitted, not ended)."""
        return self.balance.in_use if self.admission else len(self.sessions)

    @property
    def queued(self) -> int:
        return self.balance.queued

    @property
    def inflight(self) -> int:
        return sum(s.inflight for s in self.sessions.values())

    def oneshot_id(self) -> str:
        return self._oneshot_prefix + str(next(self._oneshot))

    def wait_deadline(self, waiting_since: float, stall_s: float) -> float:
        """When a request waiting for admission since ``waiting_since`` gives up: ``stall_s``
        after the later of its arrival and the last progress (module docstring: admissions,
        ends, requests finished well, engine output, tool ends). Waiting while things move
        is queueing, which the window exists to do; waiting while nothing moves is a stall
        (a hung engine, sessions that hold their slots and do nothing), which the caller
        must hear about."""
        return max(waiting_since, self.last_progress) + stall_s

    # ------------------------------------------------------------------ requests
    def arrive(self, sid: str, now: float, *, one_shot: bool = False,
               prompt_tokens: int = 0) -> SessionState:
        """A request of session ``sid`` arrived: the session (created and queued, or admitted
        at once in pass-through mode, if new). Raises :class:`QueueFull` before recording
        anything. The caller waits while ``not s.is_admitted`` (counted in ``s.waiting``)."""
        s = self.sessions.get(sid)
        if s is not None:
            return s
        s = SessionState(sid, one_shot, now, now)
        if self.admission:
            self.balance.enqueue(sid, now, prompt_tokens=prompt_tokens,
                                 meta={"one_shot": one_shot})
            self.sessions[sid] = s
        else:
            s.admitted_at = now
            self.sessions[sid] = s
            self.admitted_total += 1
            self._out.admitted(s, 0.0)
            self._out.emit(make_event("session_admit", session_id=sid, ts=now, queued_s=0.0,
                                      est_blocks=0))
        return s

    def forward(self, s: SessionState, now: float, *, last_round: bool = False) -> None:
        """A request of the admitted session ``s`` goes to the engine."""
        s.inflight += 1
        s.requests += 1
        s.last_active = now
        self.balance.forwarded(s.id, +1, now)
        if last_round:
            s.end_reason = "last_round"

    def finish(self, s: SessionState, outcome: str, now: float) -> None:
        """A forwarded request is over: ``outcome`` is "ok", "error", "disconnect" or
        "refused" (the engine refused the caller: 401 / 403 -- a sidecar without keys in
        front of an engine with keys; such a session must not keep a slot until it idles
        out)."""
        s.inflight -= 1
        s.last_active = now
        self.balance.forwarded(s.id, -1, now)
        if outcome == "ok":
            self.last_progress = now
        if s.ended or s.inflight > 0 or s.waiting > 0:
            return
        if s.one_shot:
            self.end(s, "disconnect" if outcome == "disconnect" else "one_shot", now)
        elif s.end_reason is not None:
            self.end(s, s.end_reason, now)
        elif outcome == "disconnect":
            self.end(s, "disconnect", now)
        elif outcome == "refused":
            self.end(s, "error", now)

    def give_up(self, s: SessionState, reason: str, now: float) -> None:
        """A waiter stopped waiting (timeout: "error", client gone: "disconnect"); the last
        one withdraws the session from the queue (or releases its fresh slot)."""
        s.waiting -= 1
        if s.ended or s.waiting > 0 or s.inflight > 0:
            return
        if s.admitted_at is None:
            self.balance.cancel(s.id)
        self.end(s, reason, now)

    # ------------------------------------------------------------------ session ends
    def end(self, s: SessionState, reason: str, now: float) -> bool:
        """End a session (idempotent): free its slot or queue entry, tell the shell."""
        if s.ended:
            return False
        s.ended = True
        if s.admitted_at is not None:  # a slot came free (a queued one leaving is no progress)
            self.last_progress = now
        if self.sessions.get(s.id) is s:
            del self.sessions[s.id]
        self.balance.release(s.id, now)
        self._out.ended(s, reason)
        self._out.emit(make_event("session_end", session_id=s.id, reason=reason, ts=now))
        return True

    def end_session(self, sid: str, reason: str, now: float) -> bool:
        s = self.sessions.get(sid)
        return self.end(s, reason, now) if s is not None else False

    # ------------------------------------------------------------------ between engines
    def would_admit(self, est_blocks: int, now: float) -> bool:
        """Whether a step now would admit a new session of this first-prompt size here
        (:meth:`BalanceAndAdmit.would_admit`; never without admission)."""
        return self.admission and self.balance.would_admit(est_blocks, now)

    def queued_sessions(self) -> list[QueuedSession]:
        return self.balance.queued_sessions() if self.admission else []

    def transfer_out(self, sid: str, now: float) -> tuple[SessionState, QueuedSession] | None:
        """Take queued session ``sid`` out, for another engine's :meth:`transfer_in` (None
        if it is not queued here). A queued session holds nothing on its engine -- no KV, no
        request in flight -- so it can wait at any engine's door. Its ``session_end``
        (reason ``requeued``) says it left this one; its waiters are told through the
        listener, not failed."""
        s = self.sessions.get(sid)
        if s is None or s.ended or s.is_admitted:
            return None
        qs = self.balance.take_out(sid)
        if qs is None:
            return None
        del self.sessions[sid]
        self._out.requeued(s)
        self._out.emit(make_event("session_end", session_id=sid, reason="requeued", ts=now))
        return s, qs

    def transfer_in(self, s: SessionState, qs: QueuedSession) -> None:
        """Queue a session :meth:`transfer_out` took from another engine (its arrival time,
        first prompt and waiters kept)."""
        if s.id in self.sessions:
            raise ValueError(f"session {s.id!r} is already here")
        self.balance.put_in(qs)
        self.sessions[s.id] = s

    def reap_idle(self, now: float) -> int:
        """End admitted sessions idle for ``idle_timeout_s`` (no request, no open tool)."""
        cutoff = now - self.config.idle_timeout_s
        state = self.balance.state
        idle = [s for s in self.sessions.values()
                if s.admitted_at is not None and s.inflight == 0 and s.waiting == 0
                and s.last_active < cutoff and state.active_tools_of(s.id) == 0]
        for s in idle:
            self.end(s, "idle", now)
        return len(idle)

    # ------------------------------------------------------------------ events
    def observe(self, ev: dict[str, Any], now: float) -> bool:
        """Every event of the merged stream passes here once; True when a control step may
        now admit someone (the shell schedules one)."""
        kind = ev.get("kind")
        if kind in _TOOL_KINDS:
            s = self.sessions.get(ev.get("session_id"))  # type: ignore[arg-type]
            if s is not None:
                s.last_active = now
                if kind == "tool_end" and s.admitted_at is not None:
                    self.last_progress = now
        elif kind in PROGRESS_KINDS:
            self.last_progress = now
        if kind in OBSERVED_KINDS:
            self.balance.observe(ev, now)
            return kind in STEP_KINDS and self.balance.queued > 0
        return False

    # ------------------------------------------------------------------ control step
    def step(self, now: float) -> list[SessionState]:
        """BalanceAndAdmit once; returns the sessions it admitted (the shell wakes them)."""
        if not self.admission:
            return []
        self.steps += 1
        res = self.balance.step(now)
        stale: set[str] = set()
        admitted: list[SessionState] = []
        for sid, queued_s, _blocks in res.admissions:
            s = self.sessions.get(sid)
            if s is None or s.ended:  # not ours any more: give the slot straight back
                self.balance.release(sid, now)
                stale.add(sid)
                continue
            s.admitted_at = now
            s.last_active = self.last_progress = now
            self.admitted_total += 1
            admitted.append(s)
            self._out.admitted(s, queued_s)
        d = res.decision
        key = (round(d.window, 3), d.budget, round(d.cpu_cap, 3), round(d.kv_cap, 3),
               self.balance.in_use, self.balance.queued, d.mode)
        heartbeat = now - self._last_window_at >= self.config.window_heartbeat_s
        window_ev, *admit_evs = res.events(now)
        if key != self._last_window or heartbeat:
            self._last_window, self._last_window_at = key, now
            self._out.emit(window_ev)
        for ev in admit_evs:
            if ev["session_id"] not in stale:
                self._out.emit(ev)
        return admitted

    # ------------------------------------------------------------------ views
    def snapshot(self, now: float) -> dict[str, Any]:
        d = self.balance.last.decision if (self.admission and self.balance.last) else None
        sig = self.balance.state.signals(now)
        return {
            "admission": "on" if self.admission else "off",
            "window": d.window if d else None,
            "budget": d.budget if d else None,
            "cpu_cap": d.cpu_cap if d else None,
            "kv_cap": d.kv_cap if d else None,
            # which of the three bounds the admitted sessions (the smallest; ties: the first)
            "binding": min((("window", d.window), ("cpu", d.cpu_cap), ("kv", d.kv_cap)),
                           key=lambda kv: kv[1])[0] if d else None,
            "mode": d.mode if d else None,
            "reason": d.reason if d else None,
            # the window's demand-led start, on until its first decrease
            "slow_start": self.balance.controller.slow_start if self.admission else None,
            "admitted": self.in_use,
            "queued": self.queued,
            "inflight": self.inflight,
            "admitted_total": self.admitted_total,
            # the packing room's inputs: the admitted contexts it counts, the sessions it
            # does not (quiet past the longest recent gap between rounds)
            "projected_blocks": self.balance.projected_blocks(now),
            "quiet_sessions": len(self.balance.quiet_sessions(now)),
            "round_gap_longest_s": self.balance.gaps.longest(),
            # the growth forecast in it: how many ended sessions it is measured on (none
            # before 8: projected_blocks is then the latest contexts' sum)
            "growth_samples": len(self.balance.growth),
            # with a host tier under the engine (vLLM's KV offloading): its size in blocks,
            # and the engine share each admitted context is charged at (1: whole)
            "host_blocks": sig.host_blocks,
            "engine_share": (self.balance.engine_share_now(now)
                             if sig.host_blocks and self.balance.config.host_tier else None),
            # how the last step's packing room charged the admitted contexts ("share",
            # "whole": the batch cost held it to whole contexts; "": no host tier or queue)
            "charge": self.balance.last.charge if self.balance.last else "",
            "signals": {
                "active_tools": sig.active_tools, "cpu_load": sig.cpu_load,
                "other_tools": sig.other_tools, "other_demand": sig.other_demand,
                "queued_tools": self.balance.state.queued_tools,
                "tool_cores": sig.tool_cores, "tool_duration_ema_s": sig.tool_duration_ema,
                "tool_slowdown": sig.tool_slowdown, "total_blocks": sig.total_blocks,
                "free_blocks": sig.free_blocks, "used_blocks": sig.used_blocks,
                "pinned_blocks": sig.pinned_blocks, "kv_utilisation": sig.kv_utilisation,
                "engine_running": sig.engine_running, "engine_waiting": sig.engine_waiting,
                "engine_loading": sig.engine_loading, "batch_share": sig.batch_share,
                "preemptions": sig.preemptions, "launch_delay_ema_s": sig.launch_delay_ema,
                "llm_duration_ema_s": sig.llm_duration_ema, "block_size": sig.block_size,
            },
        }

    def load_view(self, now: float) -> dict[str, Any]:
        """What placement reads of this engine's control plane
        (:meth:`mars.policy.control.placement.EngineTracker.load_with`), in
        :meth:`snapshot`'s shape: the window's budget, the admitted sessions' projected
        blocks, the calls in flight and the blocks in use. The placement asks every engine
        for it at each new session and each late-binding pass; the full snapshot's other
        fields made that cost grow with the engines (8 engines: 18 % of the sidecar's CPU,
        experiments/bench_sidecar_engines.py)."""
        d = self.balance.last.decision if (self.admission and self.balance.last) else None
        return {"budget": d.budget if d else None,
                "projected_blocks": self.balance.projected_blocks(now),
                "inflight": self.inflight,
                "signals": {"used_blocks": self.balance.state.used_blocks(now)}}

    def sessions_view(self, now: float) -> list[dict[str, Any]]:
        quiet = set(self.balance.quiet_sessions(now))
        state = self.balance.state
        # tools: the session's tool calls running now (started, not ended), which a viewer
        # that joins the event stream late cannot learn from it
        return [{"session_id": s.id, "state": "admitted" if s.is_admitted else "queued",
                 "one_shot": s.one_shot, "inflight": s.inflight, "waiting": s.waiting,
                 "requests": s.requests, "age_s": now - s.created,
                 "idle_s": now - s.last_active, "ending": s.end_reason,
                 "quiet": s.id in quiet, "tools": state.active_tools_of(s.id)}
                for s in self.sessions.values()]
