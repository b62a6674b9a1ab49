"""Dual-pressure state: the control plane's view of the GPU and CPU planes (paper §4.1-§4.2).

:class:`DualPressureState` folds the unified event stream (:mod:`mars.protocol.events`) into a
handful of numbers the admission controller and the packer read. It is *mechanism*, not
policy: it never decides anything, it only keeps running counters and averages and turns them
into normalised signals (:class:`PressureSignals`) on request.

Why a separate object: the controller (:mod:`mars.policy.control.window`) and the packer
(:mod:`mars.policy.control.packing`) must see one consistent snapshot per control step, and both must
be testable on hand-made states. Feeding events here and reading :meth:`signals` gives both.

Robustness rules (the stream is best effort, producers restart, events get lost):

* Missing data is *unknown*, never zero: before the first ``kv_snapshot`` (or once it is older
  than ``kv_stale_s``) every KV signal is ``None`` and consumers must not cap by it.
* Counters never go negative: a ``tool_end`` whose ``tool_start`` we never saw is ignored.
* Open tool calls older than ``tool_stale_s`` are dropped, so a lost ``tool_end`` cannot pin
  the CPU signal high forever.
* Malformed events are counted in :attr:`DualPressureState.ignored_events` and dropped; they
  never raise.

Time: windows are evaluated against the ``now`` passed to :meth:`DualPressureState.signals`,
and event timestamps (``ts``) are used for when things happened. Nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from mars.policy.control.slowdown import ToolSlowdown


@dataclass(slots=True)
class PressureConfig:
    """Knobs of the signal extraction. Every default is documented in docs/control_plane.md."""

    #: CPU cores the host can give to tool executions at once. One running tool is assumed to
    #: want about one core, so ``cpu_load = active_tools / tool_cores`` (with other engines'
    #: control planes on the host, their tools count too: :class:`NodeTools`). Policies never read
    #: the machine: the sidecar passes its own count (e.g. ``os.cpu_count()`` minus the cores
    #: the engine's CPU threads use).
    tool_cores: float = 8.0
    #: EMA weight of a new tool duration in the overall and per-tool-type duration averages
    #: (0.2 ~ the last 5-10 calls dominate: follows shifts in the tool mix within a minute).
    tool_ema_alpha: float = 0.2
    #: EMA weight of the slow per-tool-type *baseline* (mean and variance of log duration)
    #: the slowdown is measured against (0.02 ~ the last 50 calls): slow enough that
    #: contention shows up as a shift before the baseline absorbs it.
    tool_baseline_alpha: float = 0.02
    #: EMA weight of the slowdown (the shift of log duration from the type's baseline).
    slowdown_ema_alpha: float = 0.2
    #: Calls of a tool type needed before its baseline (a mean and a variance) is trusted.
    slowdown_min_samples: int = 10
    #: A slowdown counts only when its average shift exceeds this many standard errors of
    #: the average, from the tool types' own variance (mars.policy.control.slowdown): below, 1.
    #: At 4 the tools' own variance alone raises it about once in 30,000 calls (3: once in
    #: 1,000, a false overload every run of 100 ILR-1 tasks).
    slowdown_significance: float = 4.0
    #: Tool types whose baseline duration is below this (seconds) give no slowdown samples:
    #: at that scale the host's scheduling jitter and the event path, not CPU contention,
    #: set the ratio (a 1 ms tool that takes 3 ms is not a 3x overloaded CPU).
    slowdown_min_duration_s: float = 0.05
    #: EMA weight of LLM call durations (``request_end``) and prefill launch delays.
    llm_ema_alpha: float = 0.2
    #: Preemptions are counted over this trailing window (seconds).
    preempt_window_s: float = 10.0
    #: A KV snapshot older than this is treated as unknown (None disables staleness).
    kv_stale_s: float | None = 30.0
    #: Share of pinned blocks counted as free: 0 treats pinned KV (held across a tool call)
    #: as used, which is conservative; 1 treats it as reclaimable because the retention
    #: policy unpins under pressure.
    pinned_reclaimable: float = 0.0
    #: Open tool calls older than this are presumed lost (their ``tool_end`` never came)
    #: and dropped from the active count (None disables).
    tool_stale_s: float | None = 900.0

    def __post_init__(self) -> None:
        if self.tool_cores <= 0:
            raise ValueError("tool_cores must be > 0")
        for name in ("tool_ema_alpha", "tool_baseline_alpha", "slowdown_ema_alpha",
                     "llm_ema_alpha"):
            a = getattr(self, name)
            if not 0.0 < a <= 1.0:
                raise ValueError(f"{name} must be in (0, 1]")
        if not (self.slowdown_min_samples >= 2 and self.slowdown_significance >= 0
                and math.isfinite(self.slowdown_significance)):
            raise ValueError("slowdown_min_samples must be >= 2 (a variance) and "
                             "slowdown_significance a finite number >= 0")
        if not 0.0 <= self.pinned_reclaimable <= 1.0:
            raise ValueError("pinned_reclaimable must be in [0, 1]")
        if self.preempt_window_s <= 0:
            raise ValueError("preempt_window_s must be > 0")


class Ema:
    """Exponential moving average that knows whether it has seen anything (None until then)."""

    __slots__ = ("alpha", "value", "count")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.count = 0

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.count += 1
        return self.value


@dataclass(slots=True, frozen=True)
class PressureSignals:
    """One consistent snapshot of both planes, as policies read it.

    ``None`` means *unknown* (no data yet, or stale); consumers must treat it as "no evidence
    of pressure", never as zero or full.
    """

    now: float
    # --- GPU plane: KV pool -----------------------------------------------------------
    total_blocks: int | None
    free_blocks: int | None
    used_blocks: int | None
    pinned_blocks: int | None
    #: 1 - effective_free / total, where effective_free counts ``pinned_reclaimable`` of
    #: the pinned blocks as free.
    kv_utilisation: float | None
    #: 1 - kv_utilisation.
    kv_headroom: float | None
    block_size: int | None
    # --- GPU plane: compute ------------------------------------------------------------
    engine_running: int | None
    engine_waiting: int | None
    #: of ``engine_waiting``, the calls whose KV is being loaded from the host tier
    engine_loading: int | None
    #: (waiting - loading) / max(1, running): calls the engine holds but cannot batch. A
    #: call whose KV is still on the link waits for the transfer, not for compute: counted,
    #: a burst of loads (tool returns over a host tier) read as GPU-compute overload.
    engine_queue_ratio: float | None
    preemptions: int
    launch_delay_ema: float | None
    llm_duration_ema: float | None
    # --- CPU plane ------------------------------------------------------------------------
    #: CPU-bound tool calls of this control plane's sessions running now
    active_tools: int
    #: the host's tool cores (all of them: with several engines on one host, shared)
    tool_cores: float
    #: the host's load: (active_tools + other_tools) / tool_cores (1.0 = one tool per core)
    cpu_load: float
    tool_duration_ema: float | None
    #: EMA of (duration / per-type baseline): ~1 when healthy, >1 when tools are slowed by
    #: contention. None while no tool is running (no running tool, no CPU contention).
    tool_slowdown: float | None
    #: monotone count of tool_start events (for rate estimation by the controller)
    tool_starts_total: int
    #: the engine's KV pool size in blocks as last reported (``scheduler_start`` or any
    #: ``kv_snapshot``): a fixed fact about the engine, so it never goes stale, unlike
    #: ``total_blocks``, which is None whenever the snapshot is (None: never reported)
    pool_blocks: int | None = None
    #: the engine's host tier (vLLM's KV offloading) in blocks of context it holds, as its
    #: ``scheduler_start`` announced (None: none)
    host_blocks: int | None = None
    #: the share of the engine's decode step that grows with its batch, as its latest
    #: ``kv_snapshot`` reports it (:class:`~mars.policy.engine.step_stats.DecodeCost`: at its
    #: recent decode steps' mean batch; None: not fitted yet, an engine that does not report
    #: it, or the snapshot stale)
    batch_share: float | None = None
    #: CPU-bound tool calls running on the same host for the sessions of other engines'
    #: control planes (:class:`NodeTools`; 0 with one engine)
    other_tools: int = 0
    #: what the other engines' admitted sessions are expected to run there: per engine the
    #: larger of its running tools and its admitted sessions x its tools per session (a
    #: session between two tools is not running one, but will); 0 with one engine
    other_demand: float = 0.0

    @property
    def kv_known(self) -> bool:
        return self.kv_utilisation is not None


def _get(ev: Any, key: str, default: Any = None) -> Any:
    if isinstance(ev, Mapping):
        return ev.get(key, default)
    return getattr(ev, key, default)


def _drop_stale(calls: dict[str, dict[str, float]], cutoff: float) -> dict[str, set[str]]:
    """Drop the calls (per session: key -> ts) older than ``cutoff`` in place; return the
    keys kept for each session that lost one (open and queued calls share the rule)."""
    touched: dict[str, set[str]] = {}
    for sid in [s for s, c in calls.items() if any(t < cutoff for t in c.values())]:
        kept = {k: t for k, t in calls[sid].items() if t >= cutoff}
        touched[sid] = set(kept)
        if kept:
            calls[sid] = kept
        else:
            del calls[sid]
    return touched


class DualPressureState:
    """Folds engine and tool events into dual-pressure signals.

    Feed every event with :meth:`observe`; read a snapshot with :meth:`signals`. Per-session
    bookkeeping (open tool calls) is dropped with :meth:`forget_session` or a ``session_end``
    event, so sessions that vanish do not leak activity.
    """

    def __init__(self, config: PressureConfig | None = None) -> None:
        self.config = config or PressureConfig()
        c = self.config
        # KV snapshot
        self._kv: dict[str, int] | None = None
        self._kv_ts: float | None = None
        self._batch_share: float | None = None
        self.pool_blocks: int | None = None
        self.host_blocks: int | None = None
        self.block_size: int | None = None
        # compute
        self._preempt_ts: deque[float] = deque()
        self.launch_delay = Ema(c.llm_ema_alpha)
        self.llm_duration = Ema(c.llm_ema_alpha)
        # tools: session -> {call_key: start_ts}
        self._open: dict[str, dict[str, float]] = {}
        #: keys of open calls that declared ``cpu_bound: false``, per session
        self._light: dict[str, set[str]] = {}
        #: tool calls queued for a core and not started, per session (key -> enqueue ts):
        #: not CPU load, but the session is busy (admission's quiet sessions)
        self._queued: dict[str, dict[str, float]] = {}
        self._anon_seq = 0
        self._tool_num_offset = 0
        self.tool_starts_total = 0
        self.tool_duration = Ema(c.tool_ema_alpha)
        self.tool_duration_by_type: dict[str, Ema] = {}
        self._slowdown = ToolSlowdown(c.tool_baseline_alpha, c.slowdown_ema_alpha,
                                      c.slowdown_min_samples, c.slowdown_min_duration_s,
                                      c.slowdown_significance)
        self.ignored_events = 0
        self._last_ts: float | None = None
        #: the other control planes on this host: their running tools and their expected
        #: demand (:meth:`attach_host`; None: this control plane has the host alone)
        self._host: tuple[Callable[[], int], Callable[[], float]] | None = None
        #: the open CPU-bound tool calls, counted once per change (None: to count)
        self._count: int | None = None

    # ------------------------------------------------------------------ event intake
    def observe(self, event: Any) -> bool:
        """Fold one event (dict or pydantic model) in; returns False if it was ignored."""
        if not isinstance(event, Mapping) and hasattr(event, "model_dump"):
            event = event.model_dump()
        try:
            kind = _get(event, "kind")
            handler = self._HANDLERS.get(kind)
            if handler is None:
                return False
            ts = _get(event, "ts")
            ts = float(ts) if ts is not None else (self._last_ts or 0.0)
            self._last_ts = ts if self._last_ts is None else max(self._last_ts, ts)
            self._count = None  # (what the handler changes: the running tools' count too)
            handler(self, event, ts)
            return True
        except (KeyError, TypeError, ValueError, AttributeError):
            self.ignored_events += 1
            return False

    def observe_many(self, events: Any) -> None:
        for ev in events:
            self.observe(ev)

    def _on_kv_snapshot(self, ev: Any, ts: float) -> None:
        snap = {k: int(_get(ev, k, 0) or 0) for k in
                ("total_blocks", "free_blocks", "used_blocks", "pinned_blocks",
                 "running", "waiting", "loading")}
        if min(snap.values()) < 0:
            raise ValueError("negative count in kv_snapshot")
        snap["loading"] = min(snap["loading"], snap["waiting"])
        share = _get(ev, "batch_share", None)
        share = float(share) if share is not None else None
        if share is not None and not 0.0 <= share <= 1.0:
            raise ValueError("batch_share out of [0, 1] in kv_snapshot")
        # Out-of-order delivery: keep the newest snapshot.
        if self._kv_ts is not None and ts < self._kv_ts:
            return
        self._kv, self._kv_ts = snap, ts
        self._batch_share = share
        if snap["total_blocks"] > 0:
            self.pool_blocks = snap["total_blocks"]

    def _on_scheduler_start(self, ev: Any, ts: float) -> None:
        bs = int(_get(ev, "block_size"))
        if bs >= 1:
            self.block_size = bs
        # An engine restart invalidates everything the old engine reported.
        self._kv, self._kv_ts = None, None
        self._preempt_ts.clear()
        total = _get(ev, "total_blocks")
        self.pool_blocks = int(total) if total is not None and int(total) > 0 else None
        host = _get(ev, "host_blocks")
        self.host_blocks = int(host) if host is not None and int(host) > 0 else None

    def _on_preempt(self, ev: Any, ts: float) -> None:
        self._preempt_ts.append(ts)

    def _on_first_token(self, ev: Any, ts: float) -> None:
        self.launch_delay.update(max(0.0, float(_get(ev, "launch_delay_s"))))

    def _on_request_end(self, ev: Any, ts: float) -> None:
        status = int(_get(ev, "status", 200))
        if status < 400:
            self.llm_duration.update(max(0.0, float(_get(ev, "duration_s"))))

    def _on_tool_enqueue(self, ev: Any, ts: float) -> None:
        call_id = _get(ev, "call_id")
        if call_id is None:
            self._anon_seq += 1
        key = f"id:{call_id}" if call_id is not None else f"anon:{self._anon_seq}"
        self._queued.setdefault(str(_get(ev, "session_id")), {}).setdefault(key, ts)

    def _unqueue(self, sid: str, call_id: Any) -> None:
        """A call started or ended: it no longer waits for a core (by id, else the oldest
        anonymous one)."""
        queued = self._queued.get(sid)
        if not queued:
            return
        key = f"id:{call_id}" if call_id is not None else None
        if key not in queued:
            key = next((k for k in queued if k.startswith("anon:")), None)
        if key is not None:
            del queued[key]
            if not queued:
                del self._queued[sid]

    def _on_tool_start(self, ev: Any, ts: float) -> None:
        sid = str(_get(ev, "session_id"))
        self._unqueue(sid, _get(ev, "call_id"))
        calls = self._open.setdefault(sid, {})
        call_id = _get(ev, "call_id")
        if call_id is not None:
            key = f"id:{call_id}"
            if key in calls:  # duplicate delivery
                return
        else:
            self._anon_seq += 1
            key = f"anon:{self._anon_seq}"
        calls[key] = ts
        if _get(ev, "cpu_bound", True) is not False:
            # calls that want a core (a count for metrics; the CPU cap reads running tools)
            self.tool_starts_total += 1
        else:
            # a tool that waits (network, sleep) occupies no core: tracked for the session's
            # liveness, not counted as CPU load
            self._light.setdefault(sid, set()).add(key)

    def _on_tool_end(self, ev: Any, ts: float) -> None:
        sid = str(_get(ev, "session_id"))
        tool = str(_get(ev, "tool"))
        duration = float(_get(ev, "duration_s"))
        status = _get(ev, "status", "ok")
        calls = self._open.get(sid)
        call_id = _get(ev, "call_id")
        self._unqueue(sid, call_id)
        light = False
        if calls:
            key = f"id:{call_id}" if call_id is not None else None
            closed = None
            if key is not None and key in calls:
                closed = key
            elif key is None:
                # No id: close the oldest anonymous call, else the oldest call.
                anon = [k for k in calls if k.startswith("anon:")]
                closed = (anon or list(calls))[0]
            if closed is not None:
                del calls[closed]
                lights = self._light.get(sid)
                if lights is not None and closed in lights:
                    light = True
                    lights.discard(closed)
                    if not lights:
                        del self._light[sid]
            if not calls:
                del self._open[sid]
        # Interrupted calls were cut short by the agent dying: not a service-time sample. A
        # light tool occupies no core: its duration says nothing about CPU contention.
        if status != "interrupted" and duration >= 0 and not light:
            self._observe_duration(tool, duration)

    def _observe_duration(self, tool: str, duration: float) -> None:
        c = self.config
        self.tool_duration.update(duration)
        self.tool_duration_by_type.setdefault(tool, Ema(c.tool_ema_alpha)).update(duration)
        self._slowdown.observe(tool, duration)

    def _on_tool_num(self, ev: Any, ts: float) -> None:
        active = int(_get(ev, "active"))
        if active < 0:
            raise ValueError("negative tool_num")
        # Absolute resync: start/end events are deltas, tool_num is the truth at ``ts``.
        self._tool_num_offset = active - self._tracked_tools()

    def _on_session_end(self, ev: Any, ts: float) -> None:
        self.forget_session(str(_get(ev, "session_id")))

    _HANDLERS = {
        "kv_snapshot": _on_kv_snapshot,
        "scheduler_start": _on_scheduler_start,
        "preempt": _on_preempt,
        "gpu_1st_token": _on_first_token,
        "request_end": _on_request_end,
        "tool_enqueue": _on_tool_enqueue,
        "tool_start": _on_tool_start,
        "tool_end": _on_tool_end,
        "tool_num": _on_tool_num,
        "session_end": _on_session_end,
    }

    # ------------------------------------------------------------------ bookkeeping
    def forget_session(self, session_id: str) -> None:
        """Drop a session's open tool calls (it ended, disconnected or was released)."""
        self._count = None
        self._open.pop(session_id, None)
        self._light.pop(session_id, None)
        self._queued.pop(session_id, None)

    def _tracked_tools(self) -> int:
        """Open CPU-bound tool calls (light ones excluded), from start and end events. Kept
        between the changes to them: with several engines on one host every engine's
        control plane reads every other's count at each step and placement (NodeTools)."""
        if self._count is None:
            self._count = sum(len(v) for v in self._open.values()) - sum(
                len(v) for v in self._light.values())
        return self._count

    def _prune(self, now: float) -> None:
        c = self.config
        horizon = now - c.preempt_window_s
        while self._preempt_ts and self._preempt_ts[0] < horizon:
            self._preempt_ts.popleft()
        if c.tool_stale_s is not None:
            cutoff = now - c.tool_stale_s
            dropped = _drop_stale(self._open, cutoff)
            if dropped:
                self._count = None
            for sid, kept in dropped.items():
                light = self._light.get(sid)
                if light is not None:
                    light &= kept
                    if not light:
                        del self._light[sid]
            _drop_stale(self._queued, cutoff)

    # ------------------------------------------------------------------ plain readers
    @property
    def tracked_tools(self) -> int:
        """Running CPU-bound tool calls from start and end events alone (no resync)."""
        return max(0, self._tracked_tools())

    @property
    def active_tools(self) -> int:
        """Running tool calls: tracked start/end pairs plus the last ``tool_num`` resync."""
        return max(0, self._tracked_tools() + self._tool_num_offset)

    def active_tools_of(self, session_id: str) -> int:
        return len(self._open.get(session_id, ()))

    def queued_tools_of(self, session_id: str) -> int:
        """Tool calls of the session queued for a core and not started."""
        return len(self._queued.get(session_id, ()))

    @property
    def queued_tools(self) -> int:
        """Tool calls queued for a core and not started, over every session."""
        return sum(len(q) for q in self._queued.values())

    def attach_host(self, running: Callable[[], int], demand: Callable[[], float]) -> None:
        """Share the host's tool cores with other control planes: ``running()`` is the
        CPU-bound tools their sessions run now, ``demand()`` what their admitted sessions
        are expected to run (:class:`NodeTools`)."""
        self._host = (running, demand)

    @property
    def shares_host(self) -> bool:
        return self._host is not None

    def _others(self) -> tuple[int, float]:
        if self._host is None:
            return 0, 0.0
        running, demand = self._host
        return running(), demand()

    @property
    def cpu_load(self) -> float:
        """The host's load (this control plane's tools and, on a shared host, the others')."""
        others = self._host[0]() if self._host is not None else 0
        return (self.active_tools + others) / self.config.tool_cores

    @property
    def kv_utilisation(self) -> float | None:
        """Latest KV utilisation ignoring staleness (use :meth:`signals` in policies)."""
        return self._kv_util(self._kv)

    @property
    def kv_headroom(self) -> float | None:
        u = self.kv_utilisation
        return None if u is None else 1.0 - u

    def _kv_util(self, kv: dict[str, int] | None) -> float | None:
        if not kv or kv["total_blocks"] <= 0:
            return None
        free = kv["free_blocks"] + self.config.pinned_reclaimable * kv["pinned_blocks"]
        return min(1.0, max(0.0, 1.0 - free / kv["total_blocks"]))

    def tool_duration_of(self, tool: str) -> float | None:
        e = self.tool_duration_by_type.get(tool)
        return None if e is None else e.value

    # ------------------------------------------------------------------ snapshot
    def _fresh_kv(self, now: float) -> dict[str, int] | None:
        """The engine's latest KV snapshot, None once it is older than ``kv_stale_s``."""
        kv, stale = self._kv, self.config.kv_stale_s
        if kv is not None and stale is not None and self._kv_ts is not None \
                and now - self._kv_ts > stale:
            return None
        return kv

    def used_blocks(self, now: float) -> int | None:
        """:meth:`signals`' ``used_blocks`` alone. Placement reads it of every engine at
        each new session; the whole snapshot would also sum the other engines' tool demand
        (:class:`NodeTools`), making each placement quadratic in the engines."""
        kv = self._fresh_kv(now)
        return kv["used_blocks"] if self._kv_util(kv) is not None else None

    def signals(self, now: float) -> PressureSignals:
        """A consistent snapshot of every signal at ``now`` (prunes expired windows)."""
        c = self.config
        self._prune(now)
        kv = self._fresh_kv(now)
        util = self._kv_util(kv)
        known = util is not None
        eff_free = None
        if known:
            eff_free = int(kv["free_blocks"]
                           + math.floor(c.pinned_reclaimable * kv["pinned_blocks"]))
        running = kv["running"] if kv is not None else None
        waiting = kv["waiting"] if kv is not None else None
        loading = kv["loading"] if kv is not None else None
        active = self.active_tools
        others, demand = self._others()
        return PressureSignals(
            now=now,
            total_blocks=kv["total_blocks"] if known else None,
            free_blocks=eff_free,
            used_blocks=kv["used_blocks"] if known else None,
            pinned_blocks=kv["pinned_blocks"] if known else None,
            kv_utilisation=util,
            kv_headroom=None if util is None else 1.0 - util,
            block_size=self.block_size,
            engine_running=running,
            engine_waiting=waiting,
            engine_loading=loading,
            engine_queue_ratio=(None if kv is None else (waiting - loading) / max(1, running)),
            preemptions=len(self._preempt_ts),
            launch_delay_ema=self.launch_delay.value,
            llm_duration_ema=self.llm_duration.value,
            active_tools=active,
            tool_cores=c.tool_cores,
            cpu_load=(active + others) / c.tool_cores,
            tool_duration_ema=self.tool_duration.value,
            tool_slowdown=self._slowdown.value if active > 0 else None,
            tool_starts_total=self.tool_starts_total,
            pool_blocks=self.pool_blocks,
            host_blocks=self.host_blocks,
            batch_share=self._batch_share if kv is not None else None,
            other_tools=others,
            other_demand=demand,
        )


#: how several engines' control planes on one host count its tool cores: ``node``, shared
#: (:class:`NodeTools`); ``split``, an equal share each
CPU_BUDGETS = ("node", "split")


class NodeTools:
    """The tool cores of one host, shared by the control planes of the engines it serves.

    Why: the tools of every engine's sessions run on the same CPUs (paper §4.1 couples the
    GPU's pressure with the *host's*), so each engine's CPU signals must read the host. An
    equal split of the cores (each engine capped at ``cores / N``) throttles the engine whose
    sessions happen to be tool-heavy while the others' cores sit idle, and lets no engine see
    the contention the others cause. Shared, each control plane keeps its own sessions' tools
    and its own Little's-law share (tools per admitted session of its own), and reads two
    things of the others: their running tools (the host's load and backlog, now) and their
    expected demand, per engine the larger of its running tools and its admitted sessions x
    its tools per session. Its long-run cap counts the capacity that demand leaves
    (:func:`mars.policy.control.window.cpu_little_cap`). A snapshot of the others' running
    tools would not do there: agent sessions alternate between model calls and tools, and
    while the other engines' sessions were in model calls every engine would see the whole
    host free and admit for it, N times over.

    Mechanism only: it sums what the joined members report; nothing here reads a clock."""

    def __init__(self) -> None:
        self._members: list[tuple[DualPressureState, Callable[[], float]]] = []

    def join(self, state: DualPressureState,
             demand: Callable[[], float] = lambda: 0.0) -> None:
        """Share the host with ``state``, whose admitted sessions are expected to run
        ``demand()`` tools (its control plane's in-use sessions x tools per session)."""
        if any(st is state for st, _ in self._members):
            raise ValueError("this state already shares the host")
        self._members.append((state, demand))
        state.attach_host(lambda: self.others(state), lambda: self.others_demand(state))

    def others(self, state: DualPressureState) -> int:
        """CPU-bound tools running for the sessions of every member but ``state``."""
        return sum(st.active_tools for st, _ in self._members if st is not state)

    def others_demand(self, state: DualPressureState) -> float:
        """Tools every member but ``state`` is expected to run: per member, the larger of
        its running tools and its forecast."""
        return sum(max(float(st.active_tools), d()) for st, d in self._members
                   if st is not state)

    @property
    def active(self) -> int:
        """CPU-bound tools running on the host, over every member."""
        return sum(st.active_tools for st, _ in self._members)


def split_tool_count(active: int, tracked: list[int]) -> list[int]:
    """The host's count of running tools (a ``tool_num`` event: the truth at its time)
    shared out over control planes that track ``tracked`` of them each. More than tracked:
    the rest spread equally (the
    remainder to the planes tracking fewest). Fewer: taken one at a time from the
    plane tracking most (the first among equals), so no share goes below 0. Each plane keeps
    its own sessions' count as far as the truth allows: a resync does not move tools between
    engines (an equal split did, and each engine's tools per session with them)."""
    if active < 0:
        raise ValueError("negative tool count")
    n = len(tracked)
    if n == 0:
        return []
    diff = active - sum(tracked)
    if diff >= 0:
        # the remainder to the planes tracking fewest (the first among equals): always to
        # the first planes, engine 0 read a tool more than the others at every resync
        rest = set(sorted(range(n), key=lambda i: (tracked[i], i))[:diff % n])
        return [t + diff // n + (i in rest) for i, t in enumerate(tracked)]
    out = list(tracked)
    for _ in range(-diff):
        i = max(range(n), key=lambda i: (out[i], -i))
        out[i] -= 1
    return out
