"""The sidecar's control plane in virtual time: the same :class:`AdmissionCore`, a plain shell.

The served shell (:mod:`mars.sidecar.control`) turns the core's decisions into awaited
futures and runs its steps on an asyncio timer; this one calls back the simulator. What it
keeps identical is *when* the core is asked: a step on the sidecar's periodic timer
(``step_interval_s``), one after any event the core says may change its decision (coalesced
until the simulator's current instant is processed, as the served shell coalesces to one per
loop iteration), idle reaping, and each request's admission timeout. Every event -- the
engine's, the core's, the tools', request start/end -- passes through :meth:`publish`, which
records it and shows it to the core, as the sidecar's hub does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Mapping

from mars.policy.control.admission import QueueFull
from mars.policy.control.packing import QueuedSession
from mars.protocol.events import make_event
from mars.policy.control.admission_core import AdmissionCore, CoreConfig, Listener, SessionState
from mars.sidecar.config import SidecarConfig, admission_config
from mars.sim.clock import Timeline, VirtualClock

__all__ = ["QueueFull", "SimControl", "sidecar_config"]


def sidecar_config(admission: bool, tool_cores: int, block_size: int,
                   overrides: Mapping[str, Any] | None = None) -> SidecarConfig:
    """The sidecar's configuration as ``mars-vllm serve --tool-cores N`` starts it: defaults
    but the admission switch, the tool cores and the engine's KV block size, and
    ``overrides`` (``--admission-config``'s object). A test holds every field but the
    served-only ones (upstream, engine events, API keys) equal to what ``mars sidecar``'s
    parser makes of the same flags."""
    raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in (overrides or {}).items()}
    raw["packing"] = {"block_size": block_size, **(raw.get("packing") or {})}
    return SidecarConfig(
        upstream="http://sim", admission=admission,
        admission_config=admission_config(raw, tool_cores=tool_cores))


class SimControl:
    """``admitted(session, now)`` / ``failed(session, reason, now)``: the simulator's hooks
    for the requests a session had waiting."""

    def __init__(self, sidecar: SidecarConfig, clock: VirtualClock, timeline: Timeline, *,
                 admitted: Callable[[SessionState, float], None],
                 failed: Callable[[SessionState, str, float], None],
                 record: Callable[[dict[str, Any]], None],
                 running: Callable[[], bool] = lambda: True,
                 engine: int | None = None,
                 on_ended: Callable[[str, str], None] | None = None) -> None:
        """``engine``: this control plane's engine among several (its own events carry it,
        as the served sidecar's do); None with one engine. ``on_ended(session_id, reason)``:
        told of every session that ends here."""
        sc = self.sidecar = sidecar
        self.engine = engine
        self._on_ended_hook = on_ended
        self.clock = clock
        self.timeline = timeline
        self._record = record
        self._admitted, self._failed = admitted, failed
        self.core = AdmissionCore(
            CoreConfig(admission=sc.admission, admission_config=sc.admission_config,
                       idle_timeout_s=sc.idle_timeout_s, window_heartbeat_s=sc.window_heartbeat_s),
            Listener(emit=self._own_event, admitted=self._on_admitted, ended=self._on_ended,
                     requeued=self._on_requeued),
            oneshot_prefix="oneshot-sim-")
        self._kicked = False
        self._next_reap = 0.0
        self._timer_on = False
        self._running = running
        #: sessions the core admitted during a step: forwarded once the step has emitted its
        #: window_update / session_admit (the served waiters wake on a later loop iteration)
        self._newly_admitted: list[SessionState] = []
        #: each queued session's current stay here: a session moved away and back (late
        #: binding) starts a new one, and the timers of an earlier stay are void
        self._stay: dict[str, object] = {}

    # ------------------------------------------------------------------ hub
    def publish(self, ev: dict[str, Any]) -> None:
        """One event of the unified stream: recorded, then shown to the core."""
        self._record(ev)
        if self.core.observe(ev, self.clock()):
            self._kicked = True

    def _own_event(self, ev: dict[str, Any]) -> None:
        if self.engine is not None:
            ev["engine"] = self.engine
        self.publish(ev)

    def emit(self, kind: str, *, session_id: str | None = None, ts: float | None = None,
             **fields: Any) -> None:
        self.publish(make_event(kind, session_id=session_id,
                                ts=self.clock() if ts is None else ts, **fields))

    # ------------------------------------------------------------------ requests
    def arrive(self, sid: str, now: float, prompt_tokens: int) -> SessionState:
        """May raise :class:`QueueFull` (the sidecar's 429)."""
        new = sid not in self.core.sessions
        s = self.core.arrive(sid, now, prompt_tokens=prompt_tokens if new else 0)
        self._start_timer(now)
        if not s.is_admitted:
            s.waiting += 1
            self._kicked = True
            self._wait(s, now, self._stay.setdefault(sid, object()))
        return s

    def _wait(self, s: SessionState, since: float, stay: object) -> None:
        deadline = self.core.wait_deadline(since, self.sidecar.admission_timeout_s)
        self.timeline.at(deadline, lambda t, s=s, since=since, stay=stay:
                         self._timeout(s, since, t, stay))

    def _timeout(self, s: SessionState, since: float, t: float, stay: object) -> None:
        if s.is_admitted or s.ended or s.waiting <= 0 or self._stay.get(s.id) is not stay:
            return  # (admitted, over, or waiting elsewhere or anew: its timer there)
        stall_s = self.sidecar.admission_timeout_s
        if self.core.wait_deadline(since, stall_s) > t:  # things progressed meanwhile
            self._wait(s, since, stay)
            return
        waiting = s.waiting
        for _ in range(waiting):
            self.core.give_up(s, "error", t)
        self._failed(s, f"session {s.id!r} was not admitted: nothing progressed for "
                        f"{stall_s:g} s", t)

    def forward(self, s: SessionState, now: float, last_round: bool) -> None:
        self.core.forward(s, now, last_round=last_round)

    def finish(self, s: SessionState, outcome: str, now: float) -> None:
        self.core.finish(s, outcome, now)

    def end_session(self, sid: str, reason: str, now: float) -> None:
        self.core.end_session(sid, reason, now)

    def _on_requeued(self, s: SessionState) -> None:
        self._stay.pop(s.id, None)
        self._kicked = True  # (a step may admit whoever was behind it)

    def take_queued(self, s: SessionState, qs: QueuedSession, now: float) -> None:
        """A session queued at another engine, moved here (``SessionRouter.rebind``): its
        requests wait here, on this control plane's admission timeout."""
        self.core.transfer_in(s, qs)
        self._start_timer(now)
        self._kicked = True
        stay = self._stay[s.id] = object()
        if s.waiting:
            self._wait(s, now, stay)

    def _on_admitted(self, s: SessionState, queued_s: float) -> None:
        self._stay.pop(s.id, None)
        if s.waiting:
            s.waiting = 0
            self._newly_admitted.append(s)

    def _step(self, now: float) -> None:
        self.core.step(now)
        admitted, self._newly_admitted = self._newly_admitted, []
        for s in admitted:
            self._admitted(s, now)

    def _on_ended(self, s: SessionState, reason: str) -> None:
        self._stay.pop(s.id, None)
        if self._on_ended_hook is not None:
            self._on_ended_hook(s.id, reason)
        if s.waiting and not s.is_admitted:
            s.waiting = 0
            self._failed(s, f"session {s.id!r} ended ({reason}) while queued", self.clock())
        self._kicked = True

    # ------------------------------------------------------------------ steps
    def _start_timer(self, now: float) -> None:
        """The sidecar's periodic step and idle reaping (with admission off too, as served);
        runs while the simulator has work (``running``)."""
        if self._timer_on:
            return
        self._timer_on = True
        self.timeline.at(now + self.sidecar.step_interval_s, self._tick)

    def _tick(self, t: float) -> None:
        if self.sidecar.admission:
            self._step(t)
        if t >= self._next_reap:
            self._next_reap = t + min(1.0, self.sidecar.idle_timeout_s / 4)
            self.core.reap_idle(t)
        if self._running():
            self.timeline.at(t + self.sidecar.step_interval_s, self._tick)
        else:
            self._timer_on = False

    def kick(self) -> None:
        """Step at the next settle (another engine's event changed what this one reads)."""
        self._kicked = True

    def settle(self, now: float) -> None:
        """The event-triggered step, once everything due at ``now`` has been seen."""
        if self._kicked:
            self._kicked = False
            if self.sidecar.admission:
                self._step(now)
