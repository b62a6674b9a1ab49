"""Session-granularity admission: the asyncio mechanism around ``BalanceAndAdmit``.

The policy (which sessions, how many) is :class:`mars.policy.admission.BalanceAndAdmit`; this
module only turns its decisions into waiting and waking HTTP requests:

* A request of an **admitted** session goes straight through (a dict lookup).
* The first request of a **new** session enqueues it and waits on a future shared by every
  request of that session that arrives while it is queued. ``step()`` resolves the futures
  of the sessions BalanceAndAdmit admits.
* A session **ends** (its window slot is released) on the explicit last-round marker once
  that request is done, on ``DELETE /v1/mars/sessions/{id}``, after ``idle_timeout_s``
  without requests, open tool calls or tool events, when its client disconnects with nothing
  else in flight, and, for one-round sessions (no identity), when the request ends.
* A waiter that gives up (timeout, disconnect) withdraws the session from the queue when it
  was the last one waiting for it, so nothing ever leaks a queue entry or a slot.

Steps run on a timer and, coalesced to one per loop iteration, after every event that can
change the decision (engine KV / completion events, tool events, session ends, enqueues).

In pass-through mode (``admission=False``) sessions are registered and ended the same way and
the dual-pressure state is still fed (metrics, events), but nothing ever waits.

All methods run on the event loop thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mars.policy.admission import BalanceAndAdmit, QueueFull
from mars.policy.events import TOOL_KINDS, make_event
from mars.sidecar.config import SidecarConfig
from mars.sidecar.metrics import SidecarMetrics

log = logging.getLogger("mars.sidecar.control")

#: events after which a control step may admit someone
STEP_KINDS = frozenset({"gpu_end", "gpu_1st_token", "kv_snapshot", "preempt", "scheduler_start",
                        "tool_start", "tool_end", "tool_num"})
#: events BalanceAndAdmit / DualPressureState read (the others would only cost a dispatch on
#: the hot path); our own session_end is not among them: end() already released the session
OBSERVED_KINDS = STEP_KINDS | {"request_end"}
_TOOL_KINDS = frozenset(TOOL_KINDS)
#: least time between two event-triggered control steps (seconds)
MIN_STEP_GAP_S = 0.002

__all__ = ["AdmissionTimeout", "ControlPlane", "QueueFull", "Session", "SessionClosed"]


class AdmissionTimeout(Exception):
    """The request waited ``admission_timeout_s`` without its session being admitted."""


class SessionClosed(Exception):
    """The session was ended (e.g. deleted) while this request waited for admission."""


@dataclass(slots=True, eq=False)
class Session:
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
    admitted: asyncio.Future | None = None
    ended: bool = False

    @property
    def is_admitted(self) -> bool:
        return self.admitted_at is not None


class ControlPlane:
    def __init__(self, config: SidecarConfig, emit: Callable[[dict[str, Any], str], None],
                 metrics: SidecarMetrics) -> None:
        self.config = config
        self.admission = config.admission
        self.bna = BalanceAndAdmit(config.admission_config)
        self.sessions: dict[str, Session] = {}
        self._emit = emit
        self.metrics = metrics
        self._kick: asyncio.Handle | None = None
        self._last_step = 0.0
        self._oneshot = itertools.count(1)
        self._oneshot_prefix = f"oneshot-{os.getpid():x}-"
        self._last_window: tuple | None = None
        self._last_window_at = 0.0
        self.admitted_total = 0
        self.steps = 0

    # ------------------------------------------------------------------ introspection
    @property
    def in_use(self) -> int:
        """Window occupancy: sessions holding a slot (admitted, not ended)."""
        return self.bna.in_use if self.admission else len(self.sessions)

    @property
    def queued(self) -> int:
        return self.bna.queued

    @property
    def inflight(self) -> int:
        return sum(s.inflight for s in self.sessions.values())

    def oneshot_id(self) -> str:
        return self._oneshot_prefix + str(next(self._oneshot))

    # ------------------------------------------------------------------ requests
    async def acquire(self, sid: str, *, one_shot: bool = False, last_round: bool = False,
                      prompt_tokens: Callable[[], int] | None = None) -> Session:
        """Hold the caller until session ``sid`` is admitted; count the request in flight.

        Raises :class:`QueueFull`, :class:`AdmissionTimeout`, :class:`SessionClosed`, or
        ``CancelledError`` (client gone), each after cleaning up after itself.
        """
        now = time.time()
        s = self.sessions.get(sid)
        if s is None:
            s = Session(sid, one_shot, now, now)
            if self.admission:
                # raises QueueFull before anything is recorded
                self.bna.enqueue(sid, now, prompt_tokens=prompt_tokens() if prompt_tokens else 0,
                                 meta={"one_shot": one_shot})
                s.admitted = asyncio.get_running_loop().create_future()
                self.sessions[sid] = s
                self.kick()
            else:
                s.admitted_at = now
                self.sessions[sid] = s
                self.admitted_total += 1
                self.metrics.sessions_admitted.inc()
                self._emit(make_event("session_admit", session_id=sid, ts=now, queued_s=0.0,
                                      est_blocks=0), "control")
        if s.admitted_at is None:
            s.waiting += 1
            try:
                remaining = self.config.admission_timeout_s - (time.time() - now)
                async with asyncio.timeout(max(0.0, remaining)):
                    await asyncio.shield(s.admitted)
            except TimeoutError:
                s.waiting -= 1
                self.metrics.admission_timeouts.inc()
                msg = (f"session {sid!r} was not admitted within "
                       f"{self.config.admission_timeout_s:g} s (window full: {self.in_use} "
                       f"sessions admitted, {self.queued} queued); retry later")
                self._abandon(s, "error")
                raise AdmissionTimeout(msg) from None
            except asyncio.CancelledError:
                s.waiting -= 1
                self._abandon(s, "disconnect")
                raise
            except SessionClosed:
                s.waiting -= 1
                raise
            s.waiting -= 1
        s.inflight += 1
        s.requests += 1
        s.last_active = time.time()
        if last_round:
            s.end_reason = "last_round"
        return s

    def finish(self, s: Session, outcome: str) -> None:
        """A forwarded request is over: ``outcome`` is "ok", "error" or "disconnect"."""
        s.inflight -= 1
        s.last_active = time.time()
        if s.ended or s.inflight > 0 or s.waiting > 0:
            return
        if s.one_shot:
            self.end(s, "disconnect" if outcome == "disconnect" else "one_shot")
        elif s.end_reason is not None:
            self.end(s, s.end_reason)
        elif outcome == "disconnect":
            self.end(s, "disconnect")

    def _abandon(self, s: Session, reason: str) -> None:
        """The last waiter of a session gave up: withdraw it (or release its fresh slot)."""
        if s.ended or s.waiting > 0 or s.inflight > 0:
            return
        if s.admitted_at is None:
            self.bna.cancel(s.id)
        self.end(s, reason)

    # ------------------------------------------------------------------ session ends
    def end(self, s: Session, reason: str) -> bool:
        """End a session (idempotent): free its slot or queue entry, wake its waiters."""
        if s.ended:
            return False
        s.ended = True
        if self.sessions.get(s.id) is s:
            del self.sessions[s.id]
        fut = s.admitted
        if fut is not None and not fut.done():
            fut.set_exception(SessionClosed(f"session {s.id!r} ended ({reason}) while queued"))
            fut.exception()  # retrieved: no "never retrieved" warning when nobody waits
        self.bna.release(s.id)
        self.metrics.session_ended(reason)
        self._emit(make_event("session_end", session_id=s.id, reason=reason), "control")
        self.kick()
        return True

    def end_session(self, sid: str, reason: str = "deleted") -> bool:
        s = self.sessions.get(sid)
        return self.end(s, reason) if s is not None else False

    def reap_idle(self, now: float) -> int:
        """End admitted sessions idle for ``idle_timeout_s`` (no request, no open tool)."""
        cutoff = now - self.config.idle_timeout_s
        state = self.bna.state
        idle = [s for s in self.sessions.values()
                if s.admitted_at is not None and s.inflight == 0 and s.waiting == 0
                and s.last_active < cutoff and state.active_tools_of(s.id) == 0]
        for s in idle:
            self.end(s, "idle")
        return len(idle)

    # ------------------------------------------------------------------ events
    def observe(self, ev: dict[str, Any]) -> None:
        """Hub observer: every event of the merged stream passes here once."""
        kind = ev.get("kind")
        if kind in _TOOL_KINDS:
            s = self.sessions.get(ev.get("session_id"))  # type: ignore[arg-type]
            if s is not None:
                s.last_active = time.time()
        if kind in OBSERVED_KINDS:
            self.bna.observe(ev)
            if kind in STEP_KINDS and self.bna.queued:
                self.kick()

    # ------------------------------------------------------------------ control step
    def kick(self) -> None:
        """Run one control step soon: coalesced to one per loop iteration, and at most one
        per ``MIN_STEP_GAP_S`` so that a burst of engine events cannot turn the packer's
        sort over a long queue into a busy loop."""
        if self.admission and self._kick is None:
            loop = asyncio.get_running_loop()
            wait = self._last_step + MIN_STEP_GAP_S - time.monotonic()
            self._kick = (loop.call_soon(self._kicked) if wait <= 0
                          else loop.call_later(wait, self._kicked))

    def _kicked(self) -> None:
        self._kick = None
        self.step()

    def step(self, now: float | None = None) -> None:
        """BalanceAndAdmit once; wake the admitted sessions' waiters; emit what changed."""
        if not self.admission:
            return
        now = time.time() if now is None else now
        self.steps += 1
        self._last_step = time.monotonic()
        res = self.bna.step(now)
        stale: set[str] = set()
        for sid, queued_s, _blocks in res.admissions:
            s = self.sessions.get(sid)
            if s is None or s.ended:  # not ours any more: give the slot straight back
                self.bna.release(sid)
                stale.add(sid)
                continue
            s.admitted_at = now
            s.last_active = now
            self.admitted_total += 1
            self.metrics.sessions_admitted.inc()
            self.metrics.queue_wait.observe(queued_s)
            if s.admitted is not None and not s.admitted.done():
                s.admitted.set_result(None)
        d = res.decision
        key = (round(d.window, 3), d.budget, round(d.cpu_cap, 3), round(d.kv_cap, 3),
               self.bna.in_use, self.bna.queued, d.mode)
        heartbeat = now - self._last_window_at >= self.config.window_heartbeat_s
        window_ev, *admit_evs = res.events(now)
        if key != self._last_window or heartbeat:
            self._last_window, self._last_window_at = key, now
            self._emit(window_ev, "control")
        for ev in admit_evs:
            if ev["session_id"] not in stale:
                self._emit(ev, "control")

    async def run_timer(self, extra: Callable[[float], None] | None = None) -> None:
        """Periodic steps and idle reaping, until cancelled."""
        interval = self.config.step_interval_s
        next_reap = 0.0
        while True:
            await asyncio.sleep(interval)
            now = time.time()
            try:
                self.step(now)
                if now >= next_reap:
                    next_reap = now + min(1.0, self.config.idle_timeout_s / 4)
                    self.reap_idle(now)
                if extra is not None:
                    extra(now)
            except Exception:  # the timer must survive a bug in one tick
                log.exception("control timer tick failed")

    # ------------------------------------------------------------------ snapshot
    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        d = self.bna.last.decision if (self.admission and self.bna.last) else None
        sig = self.bna.state.signals(now)
        return {
            "admission": "on" if self.admission else "off",
            "window": d.window if d else None,
            "budget": d.budget if d else None,
            "cpu_cap": d.cpu_cap if d else None,
            "kv_cap": d.kv_cap if d else None,
            "mode": d.mode if d else None,
            "reason": d.reason if d else None,
            "admitted": self.in_use,
            "queued": self.queued,
            "inflight": self.inflight,
            "admitted_total": self.admitted_total,
            "signals": {
                "active_tools": sig.active_tools, "cpu_load": sig.cpu_load,
                "tool_cores": sig.tool_cores, "tool_duration_ema_s": sig.tool_duration_ema,
                "tool_slowdown": sig.tool_slowdown, "total_blocks": sig.total_blocks,
                "free_blocks": sig.free_blocks, "used_blocks": sig.used_blocks,
                "pinned_blocks": sig.pinned_blocks, "kv_utilisation": sig.kv_utilisation,
                "engine_running": sig.engine_running, "engine_waiting": sig.engine_waiting,
                "preemptions": sig.preemptions, "launch_delay_ema_s": sig.launch_delay_ema,
                "llm_duration_ema_s": sig.llm_duration_ema, "block_size": sig.block_size,
            },
        }

    def sessions_view(self, now: float | None = None) -> list[dict[str, Any]]:
        now = time.time() if now is None else now
        return [{"session_id": s.id, "state": "admitted" if s.is_admitted else "queued",
                 "one_shot": s.one_shot, "inflight": s.inflight, "waiting": s.waiting,
                 "requests": s.requests, "age_s": now - s.created,
                 "idle_s": now - s.last_active, "ending": s.end_reason}
                for s in self.sessions.values()]
