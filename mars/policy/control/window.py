"""UpdateWindow of Algorithm 1 (paper §4.2): the session window controller.

The controller answers one question per control step: *how many sessions may be admitted
(in total) right now?* It keeps a raw window ``W`` driven by AIMD on dual-pressure overload,
and clamps it with two capacity-derived caps::

    budget = clamp(floor(min(W, cpu_cap, kv_cap)), min_window, max_window)

Design choices, each aimed at one way such loops oscillate (see docs/control_plane.md for the
comparison with Netflix concurrency-limits and Envoy's adaptive-concurrency filter):

* **Hysteresis per signal** (one :class:`OverloadBand` each). A signal enters overload at
  ``enter`` and leaves only at ``leave`` (< enter). Between the two (the band) the window *holds*: it neither grows nor
  shrinks. Growth needs every signal at or below its leave threshold.
* **Persistence before entering.** A signal must stay above its enter threshold for
  ``persist_s`` before it counts as overload (CPU 5 s, engine queue 2 s; KV and preemptions
  at once), so one instantaneous reading (a burst of tool starts, a request that waits one
  engine step) does not cut the window.
* **Rate-limited, operating-point decrease.** At most one multiplicative decrease per
  ``decrease_cooldown_s``; the cut is taken from ``min(W, in_use)`` (a window that was never
  filled is no evidence of capacity); and no further cut is made while the admitted sessions
  still exceed the window (``in_use > W``): admission is already stopped and cutting again
  before the last cut took effect would only collapse the window. Admitted sessions are never
  evicted; the window bites as they end.
* **Demand-led start.** Until the first overload, an increase adds the sessions waiting
  beyond the window's free slots, at most doubling ``W`` (TCP's slow start, bounded by demand
  as RFC 7661 bounds a window by its use), and only while the window is what holds them (no
  cap binds) and the KV cache is known to be below its knee; the first overload ends it and
  growth is additive from then on. Without it the initial window and the paced ``+1``
  decided the first minutes of every run: short sessions at a high rate queued behind a
  window that took minutes to reach the load it could carry with every signal healthy
  (docs/control_plane.md, *Demand-led start*).
* **Sustained, used, paced increase.** ``+additive_increase`` only after ``healthy_ticks``
  consecutive healthy evaluations taken at most once per ``increase_interval_s`` (so the rate
  of growth does not depend on how often the sidecar calls :meth:`update`), and only if the
  window is actually used (:meth:`WindowController.used_threshold`: ``in_use >=
  increase_min_utilisation * W``, or every whole slot of ``W`` filled). The latter is also the
  anti-windup rule: when a cap binds, ``in_use`` stays below ``W`` and ``W`` stops growing.
* **Soft KV cap.** KV utilisation becomes a cap that tightens smoothly from the knee to full
  (:func:`kv_soft_cap`), so admission slows before memory runs out instead of flipping between
  admit and stop at a threshold.
* **CPU cap from Little's law, coupled to the KV cache.** Tool concurrency = admitted
  sessions x the running tools per session (time-averaged); the cap is the session count that
  keeps that at ``tool_cores * cpu_target_load`` (:func:`cpu_little_cap`), plus a backlog
  guard when tools already exceed the cores. The share part phases in as the KV cache fills
  (``cpu_cap_coupled``, along the KV soft cap's ramp): a host backlog costs the GPU only when
  it strands scarce GPU capacity, and with KV to spare a held session's GPU rounds would have
  overlapped the others' tools. For the same reason, with the KV cache below its knee the
  ``cpu`` band ignores busy cores that no tool waits for (``cpu_band_coupled``);
  oversubscription and tool slowdown count always.

Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mars.policy.control.pressure import DualPressureState, PressureSignals


@dataclass(frozen=True, slots=True)
class OverloadBand:
    """Hysteresis of one overload signal: it enters overload at ``enter`` (>=) once it has
    stayed there ``persist_s`` seconds, and leaves at ``leave`` (<=); between the two the
    window holds."""

    enter: float
    leave: float
    persist_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.enter) and math.isfinite(self.leave)):
            raise ValueError("enter and leave must be finite")
        if self.leave >= self.enter:
            raise ValueError(f"leave ({self.leave}) must be < enter ({self.enter}): "
                             "the hysteresis band")
        if not self.persist_s >= 0:
            raise ValueError("persist_s must be >= 0")

    @classmethod
    def of(cls, value: "OverloadBand | dict") -> "OverloadBand":
        """A band from itself or from a mapping (``--config`` JSON gives mappings)."""
        return value if isinstance(value, cls) else cls(**value)


_BANDS = ("kv", "preempt", "engine_queue", "cpu", "slowdown")


@dataclass(slots=True)
class AIMDConfig:
    """Every parameter of UpdateWindow. Defaults and rationale: docs/control_plane.md."""

    # --- window bounds and AIMD steps -------------------------------------------------
    #: Floor of the window and of the final budget; >= 1 so one session can always run.
    min_window: int = 1
    #: Ceiling of the window and of the final budget.
    max_window: int = 64
    #: Window at start-up (before any evidence).
    initial_window: float = 8.0
    #: Sessions added per increase (after the first overload, or whenever the demand-led
    #: step does not apply).
    additive_increase: float = 1.0
    #: Demand-led start: until the first overload an increase adds the sessions waiting
    #: beyond the window's free slots, at most W (doubling), while the window binds and the
    #: KV cache is below ``kv_knee``. False: every increase is ``additive_increase``.
    demand_increase: bool = True
    #: Multiplicative decrease factor: W <- max(floor, min(W - 1, base * backoff_ratio)).
    backoff_ratio: float = 0.75
    #: Minimum time between two decreases (seconds): roughly how long it takes for a change
    #: in admitted sessions to show in the signals (a few rounds of an agent session).
    decrease_cooldown_s: float = 10.0
    #: Healthy evaluations are taken at most once per this interval (seconds).
    increase_interval_s: float = 2.0
    #: Consecutive healthy evaluations needed before one additive increase.
    healthy_ticks: int = 3
    #: W grows only if in_use >= this fraction of W (no growth while the window is unused),
    #: or fills every whole slot of W (``floor(W)``; see ``used_threshold``).
    increase_min_utilisation: float = 0.75

    # --- overload hysteresis, one band per signal ---------------------------------------
    #: KV utilisation (0 s persistence: running out of memory costs recomputation at once).
    kv: OverloadBand = field(default_factory=lambda: OverloadBand(0.95, 0.85, 0.0))
    #: Preemptions within PressureConfig.preempt_window_s (any preemption is KV thrashing).
    preempt: OverloadBand = field(default_factory=lambda: OverloadBand(1, 0, 0.0))
    #: Engine (waiting - loading)/running ratio (GPU compute; a call whose KV is still on the
    #: host link waits for the link); a request waiting one step is not overload.
    engine_queue: OverloadBand = field(default_factory=lambda: OverloadBand(1.0, 0.25, 2.0))
    #: CPU load (active tools / tool cores); persistent contention only (paper §4.1).
    cpu: OverloadBand = field(default_factory=lambda: OverloadBand(1.25, 0.9, 5.0))
    #: Tool slowdown (mars.policy.control.slowdown: 1 unless tools run significantly slower than
    #: their type's baseline).
    slowdown: OverloadBand = field(default_factory=lambda: OverloadBand(2.0, 1.3, 0.0))

    # --- KV soft cap ---------------------------------------------------------------------
    #: Utilisation below which the KV cap does not bind.
    kv_knee: float = 0.70
    #: Shape p of the cap between knee and full: factor 1 - x**p, x = (u - knee)/(1 - knee).
    #: p = 2 joins the flat part without a kink and tightens fastest near full.
    kv_cap_exponent: float = 2.0
    #: EMA weight of the per-session KV footprint (used_blocks / in_use) that converts the
    #: pool into a session count for the top of the cap.
    kv_footprint_alpha: float = 0.3

    # --- CPU cap -------------------------------------------------------------------------
    #: Target tool concurrency as a multiple of tool_cores (1.0 = one tool per core).
    cpu_target_load: float = 1.0
    #: Time constant (seconds) of the time-averaged tool share (running tools per session).
    cpu_rate_tau_s: float = 60.0
    #: Admitted session-seconds needed before the share is trusted.
    cpu_rate_min_session_s: float = 30.0
    #: Coupled CPU cap (our departure from the paper's independent clamps): the Little's-law
    #: share phases in as the KV cache becomes scarce, along the KV soft cap's own ramp
    #: (nothing below ``kv_knee``, all of it at full or unknown utilisation). Requests stalled
    #: behind host tools cost the GPU the capacity they strand (paper §2), which matters only
    #: when that capacity is scarce; with KV to spare, a session held outside only delays GPU
    #: work that would overlap the other sessions' tools. The backlog guard (tools already
    #: beyond the cores) applies at any KV utilisation.
    cpu_cap_coupled: bool = True
    #: A coupling of the ``cpu`` load band (a step at the knee, not the share's ramp): with
    #: the KV cache below ``kv_knee``, busy cores that no tool waits for (``cpu_load <= 1``)
    #: neither hold the window's growth nor cut it. With KV to spare, a session held outside
    #: only delays GPU rounds that would overlap the other sessions' tools; in ``mars sim``
    #: that hold kept the window from following the load at ILR-2 (cores ~90 % busy, KV
    #: 15-25 % used). Oversubscription (``cpu_load > 1``), the ``slowdown`` band and the
    #: backlog guard count at any KV utilisation, as does everything past the knee or with
    #: no KV feed. Its cost: the hold was also a brake on sessions that grow into the KV
    #: cache after admission (H100 ILR-3 at 0.12 tasks/s: 1.6x slower with it on; docs).
    cpu_band_coupled: bool = True

    def __post_init__(self) -> None:
        if self.min_window < 1:
            raise ValueError("min_window must be >= 1 (the system must always make progress)")
        if self.max_window < self.min_window:
            raise ValueError("max_window must be >= min_window")
        if not self.min_window <= self.initial_window <= self.max_window:
            raise ValueError("initial_window must lie in [min_window, max_window]")
        if not 0.5 <= self.backoff_ratio < 1.0:
            raise ValueError("backoff_ratio must be in [0.5, 1)")
        if self.additive_increase <= 0 or self.healthy_ticks < 1:
            raise ValueError("additive_increase must be > 0 and healthy_ticks >= 1")
        if not 0.0 <= self.increase_min_utilisation <= 1.0:
            raise ValueError("increase_min_utilisation must be in [0, 1]")
        try:
            self.kv, self.preempt, self.engine_queue, self.cpu, self.slowdown = (
                OverloadBand.of(self.kv), OverloadBand.of(self.preempt),
                OverloadBand.of(self.engine_queue), OverloadBand.of(self.cpu),
                OverloadBand.of(self.slowdown))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"overload band ({', '.join(_BANDS)}): {exc}") from None
        if not 0.0 <= self.kv_knee < 1.0 or self.kv_cap_exponent <= 0:
            raise ValueError("kv_knee must be in [0, 1) and kv_cap_exponent > 0")
        if self.cpu_target_load <= 0 or self.cpu_rate_tau_s <= 0:
            raise ValueError("cpu_target_load and cpu_rate_tau_s must be > 0")


# ---------------------------------------------------------------------------- pure caps
def kv_soft_cap(utilisation: float | None, floor: float, ceiling: float, knee: float,
                exponent: float = 2.0) -> float:
    """Session cap from KV utilisation: ``ceiling`` up to the knee, ``floor`` at full.

    Between them the cap is ``floor + (ceiling - floor) * (1 - x**exponent)`` with
    ``x = (u - knee) / (1 - knee)``: continuous, monotone non-increasing in ``u``, strictly
    between floor and ceiling inside (knee, 1). Unknown utilisation -> ``ceiling`` (no cap).
    """
    if utilisation is None or utilisation <= knee:
        return float(max(ceiling, floor))
    if utilisation >= 1.0 or ceiling <= floor:
        return float(floor)
    return floor + (ceiling - floor) * (1.0 - kv_tightening(utilisation, knee, exponent))


def kv_tightening(utilisation: float, knee: float, exponent: float = 2.0) -> float:
    """The share of its headroom the KV soft cap has taken away, 0..1: ``x ** exponent``
    with ``x = (u - knee) / (1 - knee)``, 0 up to the knee, 1 at full."""
    if utilisation <= knee:
        return 0.0
    if utilisation >= 1.0:
        return 1.0
    return ((utilisation - knee) / (1.0 - knee)) ** exponent


def cpu_little_cap(tool_cores: float, target_load: float, tools_per_session: float | None,
                   floor: float, ceiling: float, active_tools: int = 0,
                   in_use: int = 0, other_tools: int = 0,
                   other_demand: float | None = None) -> float:
    """Session cap that keeps expected tool concurrency at ``tool_cores * target_load``.

    Little's law: concurrent tools = admitted sessions x ``tools_per_session`` (the tool-call
    rate per session times the mean tool duration, i.e. the running tools per session, which
    the controller measures directly). The cap is ``capacity / tools_per_session``. Backlog
    guard: when the tools already running exceed the capacity, the cap is also at most
    ``in_use * capacity / active_tools`` (< in_use), so no session is admitted until the
    backlog drains, however optimistic the long-run estimate is. Unknown share -> ceiling.

    On a host shared with other engines' control planes
    (:class:`~mars.policy.control.pressure.NodeTools`: ``other_tools`` running for their
    sessions, ``other_demand`` expected of their admitted sessions, default the running
    ones), the long-run cap counts the capacity their demand leaves, ``tool_cores *
    target_load - other_demand`` (at least 0), and the backlog guard reads the host's
    backlog, ``active_tools + other_tools`` over the capacity: it holds every engine of the
    host, tools of its own running or not (a session admitted anywhere while the host's
    tools wait for cores adds to their wait), at the same fraction of its admitted sessions.
    """
    capacity = tool_cores * target_load
    demand = float(other_tools) if other_demand is None else other_demand
    cap = float(ceiling)
    if tools_per_session is not None and tools_per_session > 0:
        cap = min(cap, max(0.0, capacity - demand) / tools_per_session)
    host = active_tools + other_tools
    if host > capacity and in_use > 0:
        cap = min(cap, in_use * capacity / host)
    return float(min(max(cap, floor), ceiling))


def _whole_sessions(x: float) -> int:
    """Sessions a fractional window or cap lets in (tolerant of float error: 2.9999999 is 3)."""
    return math.floor(x + 1e-9)


# ---------------------------------------------------------------------------- hysteresis
class Hysteresis:
    """Latched overload flag with separate enter (>=) and leave (<=) thresholds.

    Entering also needs the value to stay at or above ``enter`` for ``persist_s`` seconds
    without interruption (a debounce: one instantaneous reading is not overload). Leaving is
    immediate once the value is at or below ``leave``. An unknown value (None) releases the
    latch: no data is no evidence of overload.
    """

    __slots__ = ("name", "enter", "leave", "persist_s", "on", "value", "_since")

    def __init__(self, name: str, enter: float, leave: float, persist_s: float = 0.0) -> None:
        self.name, self.enter, self.leave, self.persist_s = name, enter, leave, persist_s
        self.on = False
        self.value: float | None = None
        self._since: float | None = None

    @classmethod
    def of(cls, name: str, band: OverloadBand) -> "Hysteresis":
        return cls(name, band.enter, band.leave, band.persist_s)

    def update(self, value: float | None, now: float = 0.0) -> bool:
        self.value = value
        if value is None:
            self.on, self._since = False, None
        elif value >= self.enter:
            if self._since is None:
                self._since = now
            if now - self._since >= self.persist_s:
                self.on = True
        else:
            self._since = None
            if value <= self.leave:
                self.on = False
        return self.on

    @property
    def hot(self) -> bool:
        """Latched and above the enter threshold now (not merely latched inside the band)."""
        return self.on and self.value is not None and self.value >= self.enter

    @property
    def healthy(self) -> bool:
        """At or below the leave threshold (or unknown) and not latched."""
        return not self.on and (self.value is None or self.value <= self.leave)


# ---------------------------------------------------------------------------- decision
@dataclass(slots=True)
class WindowDecision:
    """Outcome of one UpdateWindow call; what the sidecar logs as ``window_update``."""

    #: raw AIMD window W (float: additive steps may be fractional)
    window: float
    cpu_cap: float
    kv_cap: float
    #: admitted sessions allowed in total: clamp(floor(min(W, caps)), floor, ceiling)
    budget: int
    in_use: int
    kv_overloaded: bool = False
    compute_overloaded: bool = False
    cpu_overloaded: bool = False
    #: "increase" | "decrease" | "hold"
    mode: str = "hold"
    reason: str = ""
    #: budget or window differ from the previous decision
    changed: bool = False
    healthy_streak: int = 0

    @property
    def overloaded(self) -> bool:
        return self.kv_overloaded or self.compute_overloaded or self.cpu_overloaded

    @property
    def slots(self) -> int:
        """New sessions that may be admitted now."""
        return max(0, self.budget - self.in_use)


@dataclass(slots=True)
class _ToolShare:
    """Running CPU-bound tools per admitted session, time-averaged over ``tau_s`` (decayed
    integrals of both): Little's law's share measured directly. It replaced the tool-call
    rate times an EMA of the last few calls' durations, whose product swung with every long
    call (tool durations are heavy-tailed: one 100 s call in a type whose median is 1 s moved
    the duration EMA by 20 s and the cap with it) and mixed two time constants."""

    tau_s: float
    tools_w: float = 0.0
    session_s_w: float = 0.0
    last_t: float | None = None
    last_tools: int = 0
    last_in_use: int = 0

    def update(self, active_tools: int, in_use: int, now: float) -> None:
        if self.last_t is not None and now > self.last_t:
            dt = now - self.last_t
            decay = math.exp(-dt / self.tau_s)
            # what held during the interval is what was seen at its start
            self.tools_w = self.tools_w * decay + self.last_tools * dt
            self.session_s_w = self.session_s_w * decay + self.last_in_use * dt
        if self.last_t is None or now >= self.last_t:
            self.last_t = now
        self.last_tools, self.last_in_use = max(0, active_tools), max(0, in_use)

    def share(self, min_session_s: float) -> float | None:
        # The decayed weight saturates at in_use * tau, so compare against the smaller of the
        # warm-up requirement and what one session can ever accumulate.
        need = min(min_session_s, 0.9 * self.tau_s)
        if self.session_s_w < need or self.session_s_w <= 0:
            return None
        return self.tools_w / self.session_s_w


class WindowController:
    """UpdateWindow: AIMD on dual-pressure overload, clamped by the CPU and KV caps.

    Stateful (window, latches, streak, timers); call :meth:`update` on every control step with
    the current number of admitted sessions.
    """

    def __init__(self, config: AIMDConfig | None = None) -> None:
        self.config = c = config or AIMDConfig()
        self.window: float = float(c.initial_window)
        self._kv = Hysteresis.of("kv", c.kv)
        self._preempt = Hysteresis.of("preempt", c.preempt)
        self._queue = Hysteresis.of("engine_queue", c.engine_queue)
        self._cpu = Hysteresis.of("cpu", c.cpu)
        self._slow = Hysteresis.of("slowdown", c.slowdown)
        self._latches = (self._kv, self._preempt, self._queue, self._cpu, self._slow)
        self._streak = 0
        self._last_eval: float | None = None
        self._last_decrease: float = -math.inf
        self._slow_start: bool = c.demand_increase
        self._footprint: float | None = None
        self._share = _ToolShare(c.cpu_rate_tau_s)
        self._last: WindowDecision | None = None

    @property
    def last(self) -> WindowDecision | None:
        return self._last

    @property
    def slow_start(self) -> bool:
        """The demand-led start is on: no overload seen yet (TCP's slow start)."""
        return self._slow_start

    # ------------------------------------------------------------------ caps
    def kv_cap(self, sig: PressureSignals, in_use: int) -> float:
        """Soft KV cap; its top is the pool's capacity in sessions when that is estimable."""
        c = self.config
        if not sig.kv_known:
            return float(c.max_window)
        if in_use > 0 and sig.used_blocks and sig.used_blocks > 0:
            per_session = max(1.0, sig.used_blocks / in_use)
            self._footprint = per_session if self._footprint is None else \
                self._footprint + c.kv_footprint_alpha * (per_session - self._footprint)
        ceiling = float(c.max_window)
        if self._footprint is not None and sig.total_blocks:
            ceiling = min(ceiling, max(float(c.min_window), sig.total_blocks / self._footprint))
        return kv_soft_cap(sig.kv_utilisation, c.min_window, ceiling, c.kv_knee,
                           c.kv_cap_exponent)

    def tools_per_session(self, sig: PressureSignals | None = None) -> float | None:
        """Little's-law tool share: running tools per admitted session, time-averaged."""
        return self._share.share(self.config.cpu_rate_min_session_s)

    def cpu_cap(self, sig: PressureSignals, in_use: int) -> float:
        """Little's-law CPU cap with its backlog guard; with ``cpu_cap_coupled`` the share
        part is weighted by :meth:`kv_scarcity` (continuous: no admit/stop threshold)."""
        c = self.config
        args = (sig.tool_cores, c.cpu_target_load)
        tail = (c.min_window, c.max_window, sig.active_tools, in_use, sig.other_tools,
                sig.other_demand)
        cap = cpu_little_cap(*args, self.tools_per_session(sig), *tail)
        if not c.cpu_cap_coupled:
            return cap
        guard = cpu_little_cap(*args, None, *tail)  # the backlog guard alone (>= cap)
        return guard - self.kv_scarcity(sig) * (guard - cap)

    def kv_scarcity(self, sig: PressureSignals) -> float:
        """How scarce the KV cache is, 0..1: how far the KV soft cap has tightened
        (:func:`kv_tightening`). Unknown utilisation (no KV feed, e.g. in front of a plain
        vLLM) counts as scarce: without evidence of room, the CPU share binds as it always
        did."""
        c, u = self.config, sig.kv_utilisation
        return 1.0 if u is None else kv_tightening(u, c.kv_knee, c.kv_cap_exponent)

    def cpu_band_load(self, sig: PressureSignals) -> float | None:
        """What the ``cpu`` band reads: the CPU load, or None (no evidence of overload) while
        ``cpu_band_coupled``, the KV cache is not scarce and no tool waits for a core
        (``cpu_load <= 1``). Oversubscription is contention now and counts at any KV: it also
        holds the window while the backlog guard caps admission, so W does not wind up behind
        the guard."""
        if (self.config.cpu_band_coupled and self.kv_scarcity(sig) == 0.0
                and sig.cpu_load <= 1.0):
            return None
        return sig.cpu_load

    def used_threshold(self) -> float:
        """Admitted sessions at which the window counts as used (growth allowed):
        ``increase_min_utilisation * W``, but never more than ``floor(W)``, the sessions the
        window itself lets in. Without that bound a cut to a fractional window (1.5 from two
        sessions) could never be filled again (one session < 0.75 x 1.5) and the window
        stayed at one session for good: `mars_no_coord` in ``mars sim`` at ILR-4 0.034 tasks/s,
        where new sessions queued for ten minutes behind an idle GPU."""
        w = self.window
        return min(self.config.increase_min_utilisation * w, float(_whole_sessions(w)))

    # ------------------------------------------------------------------ UpdateWindow
    def demand_step(self, sig: PressureSignals, in_use: int, queued: int,
                    cap: float) -> float | None:
        """Sessions a demand-led increase adds, or None (the additive step applies).

        Only in slow start (:attr:`slow_start`), only the sessions waiting beyond the
        window's free slots (those slots admit them anyway), at most doubling W, and only
        when the evidence says the demand is the window's to serve: no cap (``cap``, the
        tighter of the CPU and KV caps) holds the budget below the window, else the waiting
        sessions would wind W up behind it; and the KV cache is known to be below its knee
        (:meth:`kv_scarcity` 0), so no demand step follows a restart or a stale KV feed,
        when the signals are healthy only for want of data. Never less than the additive
        step: more sessions waiting never means slower growth."""
        c = self.config
        if not self._slow_start or self.kv_scarcity(sig) > 0.0:
            return None
        whole = _whole_sessions(self.window)
        if cap < whole:
            return None
        beyond = int(queued) - max(0, whole - in_use)
        if beyond <= c.additive_increase:
            return None
        return max(c.additive_increase, min(float(beyond), self.window))

    def update(self, state: DualPressureState | PressureSignals, in_use: int,
               now: float, queued: int = 0) -> WindowDecision:
        """One control step. ``state`` may be a live state or a pre-taken snapshot;
        ``queued``: sessions waiting for a slot (the demand-led start's step)."""
        c = self.config
        sig = state if isinstance(state, PressureSignals) else state.signals(now)
        in_use = max(0, int(in_use))
        self._share.update(sig.active_tools, in_use, now)
        kv_cap = self.kv_cap(sig, in_use)
        cpu_cap = self.cpu_cap(sig, in_use)

        kv_over = self._kv.update(sig.kv_utilisation, now)
        kv_over = self._preempt.update(float(sig.preemptions), now) or kv_over
        compute_over = self._queue.update(sig.engine_queue_ratio, now)
        cpu_over = self._cpu.update(self.cpu_band_load(sig), now)
        # a slower tool call is evidence of contention only while the tools fill the cores
        # (load at or above the CPU band's leave threshold): with cores idle it is the tool's
        # own variance -- recorded agent tools of one type vary tenfold -- and, read as
        # overload, it cut the window to one session on an idle GPU (found in mars sim)
        slow = sig.tool_slowdown if sig.cpu_load >= c.cpu.leave else None
        cpu_over = self._slow.update(slow, now) or cpu_over
        overloaded = kv_over or compute_over or cpu_over

        if self._last_eval is None:
            self._last_eval = now
        evaluate = now - self._last_eval >= c.increase_interval_s
        if evaluate:
            self._last_eval = now

        mode = "hold"
        if overloaded:
            self._streak = 0
            hot = [h.name for h in self._latches if h.hot]
            if hot:
                # the first overload ends the demand-led start, cut or not (a cut may be
                # barred at the floor): from here growth is additive
                self._slow_start = False
            if not hot:
                reason = "overload latched, signals inside hysteresis band: hold"
            elif now - self._last_decrease < c.decrease_cooldown_s:
                reason = f"overload ({','.join(hot)}) within decrease cooldown: hold"
            elif in_use > self.window:
                reason = (f"overload ({','.join(hot)}) but in_use {in_use} > window "
                          f"{self.window:.2f}: previous decrease still draining")
            else:
                base = min(self.window, float(in_use)) if in_use > 0 else self.window
                new = max(float(c.min_window), min(self.window - 1.0, base * c.backoff_ratio))
                if new < self.window:
                    mode = "decrease"
                    reason = f"overload ({','.join(hot)}): {self.window:.2f} -> {new:.2f}"
                    self.window = new
                    self._last_decrease = now
                else:
                    reason = f"overload ({','.join(hot)}) at window floor"
        elif not all(h.healthy for h in self._latches):
            self._streak = 0
            band = [h.name for h in self._latches if not h.healthy]
            reason = f"above leave threshold, not (yet) overloaded ({','.join(band)}): hold"
        else:
            if evaluate:
                self._streak = min(self._streak + 1, c.healthy_ticks)
            if self._streak < c.healthy_ticks:
                reason = f"healthy {self._streak}/{c.healthy_ticks}"
            elif self.window >= c.max_window:
                reason = "healthy at ceiling"
            elif in_use < (used := self.used_threshold()):
                reason = (f"healthy but under-used (in_use {in_use} < "
                          f"{used:.2f} of window {self.window:.2f})")
            else:
                demand = self.demand_step(sig, in_use, queued, min(cpu_cap, kv_cap))
                step = c.additive_increase if demand is None else demand
                new = min(float(c.max_window), self.window + step)
                mode = "increase"
                reason = f"sustained health: {self.window:.2f} -> {new:.2f}"
                if demand is not None:
                    reason += f" (slow start: {max(0, int(queued))} waiting)"
                self.window = new
                self._streak = 0

        raw = min(self.window, cpu_cap, kv_cap)
        budget = min(max(_whole_sessions(raw), c.min_window), c.max_window)
        prev = self._last
        decision = WindowDecision(
            window=self.window, cpu_cap=cpu_cap, kv_cap=kv_cap, budget=budget, in_use=in_use,
            kv_overloaded=kv_over, compute_overloaded=compute_over, cpu_overloaded=cpu_over,
            mode=mode, reason=reason,
            changed=prev is None or prev.budget != budget or prev.window != self.window,
            healthy_streak=self._streak,
        )
        self._last = decision
        return decision
