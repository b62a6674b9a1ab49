"""Session admission on the event loop: the asyncio shell around the sans-IO core.

Every decision and all session bookkeeping live in
:class:`mars.policy.control.admission_core.AdmissionCore` (which drives ``BalanceAndAdmit``); this
module only turns them into waiting and waking HTTP requests, metrics and timers:

* A request of an **admitted** session goes straight through (a dict lookup).
* The first request of a **new** session enqueues it and waits on a future shared by every
  request of that session that arrives while it is queued; the core's ``admitted`` callback
  resolves it, its ``ended`` callback fails it (``SessionClosed``).
* A waiter that gives up (timeout, disconnect) tells the core, which withdraws the session
  when it was the last one waiting for it.

Steps run on a timer and, coalesced to one per loop iteration, after every event that can
change the decision (the core's ``observe`` says which).

All methods run on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from mars.policy.control.admission import AdmissionConfig, QueueFull
from mars.policy.control.packing import QueuedSession
from mars.policy.control.admission_core import (OBSERVED_KINDS, STEP_KINDS, AdmissionCore,
                                         CoreConfig, Listener, SessionState)
from mars.sidecar.config import SidecarConfig
from mars.sidecar.metrics import SidecarMetrics

log = logging.getLogger("mars.sidecar.control")

#: least time between two event-triggered control steps (seconds)
MIN_STEP_GAP_S = 0.002

__all__ = ["AdmissionTimeout", "ControlPlane", "OBSERVED_KINDS", "QueueFull", "STEP_KINDS",
           "Session", "SessionClosed", "SessionRequeued"]

#: the core's session record is what the app holds while a request is in flight
Session = SessionState


class AdmissionTimeout(Exception):
    """The request's session was not admitted and nothing progressed for
    ``admission_timeout_s`` (:meth:`AdmissionCore.wait_deadline`)."""


class SessionClosed(Exception):
    """The session was ended (e.g. deleted) while this request waited for admission."""


class SessionRequeued(Exception):
    """The session moved, while queued, to another engine's queue (MARS placement's late
    binding, ``EngineSet._rebind``; its engine found down, ``EngineSet._evacuate``) and was
    admitted there: the request goes on at :attr:`owner`, the control plane that holds it
    (``EngineSet.acquire`` follows it there and acquires again, admitted at once)."""

    def __init__(self, message: str, owner: "ControlPlane") -> None:
        super().__init__(message)
        self.owner = owner


class ControlPlane:
    def __init__(self, config: SidecarConfig, emit: Callable[[dict[str, Any], str], None],
                 metrics: SidecarMetrics, *, admission_config: AdmissionConfig | None = None,
                 on_ended: Callable[[Session, str], None] | None = None,
                 after_step: Callable[[float], None] | None = None) -> None:
        """``admission_config``: this engine's own (one of several engines: its share of
        the tool cores); ``on_ended``: told of every session that ends here;
        ``after_step(now)``: called after each control step (the engine set's rebinding)."""
        self.config = config
        self.admission = config.admission
        self.metrics = metrics
        self._emit = emit
        self._on_ended_hook = on_ended
        self._after_step = after_step
        #: the control plane that holds this session record now (several engines: a queued
        #: session may move to another engine's while its requests wait here); None: this
        self.owner_of: Callable[[Session], "ControlPlane | None"] = lambda s: None
        self.core = AdmissionCore(
            CoreConfig(admission=config.admission,
                       admission_config=admission_config or config.admission_config,
                       idle_timeout_s=config.idle_timeout_s,
                       window_heartbeat_s=config.window_heartbeat_s),
            Listener(emit=lambda ev: emit(ev, "control"), admitted=self._on_admitted,
                     ended=self._on_ended, requeued=self._on_requeued),
            oneshot_prefix=f"oneshot-{os.getpid():x}-")
        #: admission futures of queued sessions
        self._futures: dict[str, asyncio.Future] = {}
        self._kick: asyncio.Handle | None = None
        self._last_step = 0.0

    # ------------------------------------------------------------------ introspection
    @property
    def sessions(self) -> dict[str, Session]:
        return self.core.sessions

    @property
    def in_use(self) -> int:
        return self.core.in_use

    @property
    def queued(self) -> int:
        return self.core.queued

    @property
    def inflight(self) -> int:
        return self.core.inflight

    @property
    def admitted_total(self) -> int:
        return self.core.admitted_total

    @property
    def steps(self) -> int:
        return self.core.steps

    def oneshot_id(self) -> str:
        return self.core.oneshot_id()

    # ------------------------------------------------------------------ core callbacks
    def _on_admitted(self, s: Session, queued_s: float) -> None:
        self.metrics.sessions_admitted.inc()
        if self.admission:
            self.metrics.queue_wait.observe(queued_s)
        fut = self._futures.pop(s.id, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _on_ended(self, s: Session, reason: str) -> None:
        fut = self._futures.pop(s.id, None)
        if fut is not None and not fut.done():
            fut.set_exception(SessionClosed(f"session {s.id!r} ended ({reason}) while queued"))
            fut.exception()  # retrieved: no "never retrieved" warning when nobody waits
        self.metrics.session_ended(reason)
        if self._on_ended_hook is not None:
            self._on_ended_hook(s, reason)
        self.kick()

    def _on_requeued(self, s: Session) -> None:
        self.kick()  # (whoever queued behind it may fit now)

    def hand_over(self, sid: str) -> asyncio.Future | None:
        """The admission future of a session that left this engine's queue (its waiters
        await it; :meth:`take_queued` gives it to the engine that took the session)."""
        return self._futures.pop(sid, None)

    def take_queued(self, s: Session, qs: QueuedSession,
                    future: asyncio.Future | None = None) -> None:
        """A session queued at another engine, moved here with the future its waiters
        await: this engine's admission (or end) settles it, as for its own sessions."""
        self.core.transfer_in(s, qs)
        if future is not None and not future.done():
            self._futures[s.id] = future
        self.kick()

    def _owner(self, s: Session) -> "ControlPlane":
        cp = self.owner_of(s)
        return cp if cp is not None and cp.core.sessions.get(s.id) is s else self

    # ------------------------------------------------------------------ requests
    async def acquire(self, sid: str, *, one_shot: bool = False, last_round: bool = False,
                      prompt_tokens: Callable[[], int] | None = None) -> Session:
        """Hold the caller until session ``sid`` is admitted; count the request in flight.

        Raises :class:`QueueFull`, :class:`AdmissionTimeout`, :class:`SessionClosed`,
        :class:`SessionRequeued` (admitted at the engine it moved to: acquire there), or
        ``CancelledError`` (client gone), each after cleaning up after itself -- at the
        engine that holds the session by then.
        """
        core = self.core
        start = time.time()
        new = sid not in core.sessions
        s = core.arrive(sid, start, one_shot=one_shot,
                        prompt_tokens=prompt_tokens() if (new and prompt_tokens) else 0)
        if not s.is_admitted:
            fut = self._futures.get(sid)
            if fut is None:
                fut = self._futures[sid] = asyncio.get_running_loop().create_future()
                self.kick()
            s.waiting += 1
            stall_s = self.config.admission_timeout_s
            try:
                while True:  # the deadline moves on while the admitted sessions progress
                    remaining = self._owner(s).core.wait_deadline(start, stall_s) - time.time()
                    if remaining <= 0 and not fut.done():  # (admitted as the time ran out)
                        raise TimeoutError
                    try:
                        async with asyncio.timeout(max(remaining, 0.0)):
                            await asyncio.shield(fut)
                        break
                    except TimeoutError:
                        continue
            except TimeoutError:
                self.metrics.admission_timeouts.inc()
                msg = (f"session {sid!r} was not admitted: nothing progressed (no admission, "
                       f"session end, finished request, engine output or tool end) for "
                       f"{stall_s:g} s (--admission-timeout; {self.in_use} sessions admitted, "
                       f"{self.queued} queued); retry later")
                self._owner(s).core.give_up(s, "error", time.time())
                raise AdmissionTimeout(msg) from None
            except asyncio.CancelledError:
                self._owner(s).core.give_up(s, "disconnect", time.time())
                raise
            except SessionClosed:
                s.waiting -= 1
                raise
            s.waiting -= 1
            owner = self._owner(s)
            if owner is not self:
                raise SessionRequeued(f"session {sid!r} was admitted at another engine", owner)
        core.forward(s, time.time(), last_round=last_round)
        return s

    def finish(self, s: Session, outcome: str) -> None:
        """A forwarded request is over: ``outcome`` is "ok", "error" or "disconnect"."""
        self.core.finish(s, outcome, time.time())

    def end(self, s: Session, reason: str) -> bool:
        return self.core.end(s, reason, time.time())

    def end_session(self, sid: str, reason: str = "deleted") -> bool:
        return self.core.end_session(sid, reason, time.time())

    def reap_idle(self, now: float) -> int:
        return self.core.reap_idle(now)

    # ------------------------------------------------------------------ events
    def observe(self, ev: dict[str, Any]) -> None:
        """Hub observer: every event of the merged stream passes here once."""
        if self.core.observe(ev, time.time()):
            self.kick()

    # ------------------------------------------------------------------ control step
    def kick(self) -> None:
        """Run one control step soon: coalesced to one per loop iteration, and at most one
        per ``MIN_STEP_GAP_S`` so that a burst of engine events cannot turn the packer's
        sort over a long queue into a busy loop."""
        if self.admission and self._kick is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop (a core call outside the server): the timer steps
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
        self._last_step = time.monotonic()
        now = time.time() if now is None else now
        self.core.step(now)
        if self._after_step is not None:
            self._after_step(now)

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

    # ------------------------------------------------------------------ views
    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        return self.core.snapshot(time.time() if now is None else now)

    def sessions_view(self, now: float | None = None) -> list[dict[str, Any]]:
        return self.core.sessions_view(time.time() if now is None else now)
