"""BalanceAndAdmit of Algorithm 1: the control plane's single control step (paper §4.2).

:class:`BalanceAndAdmit` is a pure state machine that owns the waiting queue and the set of
admitted sessions and composes the two policies:

1. ``UpdateWindow`` (:class:`~mars.policy.control.window.WindowController`) turns the dual-pressure
   state into a budget of admitted sessions;
2. ``PackQueue`` (:class:`~mars.policy.control.packing.PackQueue`) picks which queued sessions fill
   ``budget - in_use`` free slots under the free-block budget.

It knows nothing of HTTP or asyncio: the sidecar calls :meth:`observe` for every event of the
unified stream, :meth:`enqueue` when a new session's first request arrives (``QueueFull`` ->
HTTP 429), :meth:`step` on a timer and after relevant events, wakes the waiters whose ids
:meth:`step` returns, and calls :meth:`release` when a session ends.

Blocks promised but not yet visible: a session admitted in this step has not reached the
engine, so the next ``kv_snapshot`` still shows its blocks as free. Its estimate is kept as a
*pending reservation*, subtracted from the free blocks handed to the packer, until the engine
reports its first token (its prompt is then resident), a ``gpu_end``/``preempt`` for it, its
release, or ``pending_ttl_s``. Without this, a burst of steps between two snapshots would admit
the same free blocks several times.

Quiet sessions: an admitted session's projected context counts in the packing room until it
ends. A client that never says it is done (no last-round marker, no ``DELETE``) would hold its
share of the pool until the idle reaper (``idle_timeout_s``, default 300 s) while sessions
queue and, with every admitted context idle, nothing runs. So a session with nothing in
flight (no call in the engine, no request forwarded by the sidecar and unfinished, no tool
call open or queued for a core) stops counting once it has shown no sign of life (those
events, its tool calls queued, started or ended) for longer than every gap between two
rounds of a session recently observed (:class:`RoundGaps`: a session's last sign of life
to its next request, as the sidecar forwards it or else as the engine submits it); it counts
again with its next call. The yardstick is measured, not set: agents who pause minutes
between rounds wait minutes.

Past 600 lines on purpose: :class:`BalanceAndAdmit` is one transaction over the queue, the window
and the packing room, and its dry run (``would_admit``) and transfers must read that state as a
step does; the window (:mod:`.window`), the packer (:mod:`.packing`) and the pressure signals
(:mod:`.pressure`) are modules of their own.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

from mars.policy.control.window import WindowController, AIMDConfig, WindowDecision
from mars.protocol.events import make_event
from mars.policy.control.growth import ContextGrowth, Projection
from mars.policy.control.packing import (PackConfig, PackQueue, PackResult, QueuedSession,
                                 estimate_blocks)
from mars.policy.control.pressure import (CPU_BUDGETS, DualPressureState, NodeTools,
                                         PressureConfig, PressureSignals)
from mars.policy.control.batch_cost import worth_admitting_more
from mars.policy.control.residency import EngineShare, ResidentShare


class QueueFull(Exception):
    """The admission queue is at ``max_queue``: the sidecar answers 429 (Retry-After)."""


class AlreadyAdmitted(ValueError):
    """``enqueue`` for a session that is already admitted: forward it, do not queue it."""


@dataclass(slots=True)
class AdmissionConfig:
    """Top-level control-plane config: the queue's own knobs plus the three policies'."""

    #: Sessions that may wait at once; the next enqueue raises :class:`QueueFull`.
    max_queue: int = 1024
    #: Seconds a just-admitted session's block estimate stays reserved at most.
    pending_ttl_s: float = 30.0
    #: Share of the KV pool the admitted sessions' projected contexts (each one's latest
    #: prompt, from ``gpu_submit``) may fill; a new session is packed only into what is left
    #: (``None``: off, only the free blocks bound packing). See :meth:`BalanceAndAdmit.room`.
    projected_fill: float | None = 1.0
    #: Count the admitted contexts in the packing room at the expected peak of their sum
    #: over the coming rounds, from the rounds and growth of the sessions that ended
    #: (:mod:`mars.policy.control.growth`), and charge a queued session what it raises that by; False:
    #: each context at its latest size, a queued one at its estimate (the behaviour before).
    growth_forecast: bool = True
    #: With a host tier under the engine (vLLM's KV offloading: the engine announces its
    #: size), charge each admitted context its measured engine share: only the sessions with
    #: a call in the engine need theirs resident, a paused one's comes back over the host
    #: link, not by recompute (:mod:`mars.policy.control.residency`). False: every admitted
    #: context counts whole, as without a host tier (the ablation).
    host_tier: bool = True
    #: With the share charge (``host_tier``), admit past the whole-context room only while
    #: the queue is long enough that the door wait saved outweighs the slowdown more
    #: sessions bring to every decode step (:mod:`mars.policy.control.batch_cost`, from the
    #: engine share and the engine's fitted ``batch_share``). Off by default: it removed
    #: three-place's losses to two-place at ILR-3 and cost 5-6 % on the long-session
    #: held-out workloads (docs/results.md, *The batch cost*). False: the share charge alone.
    batch_cost: bool = False
    aimd: AIMDConfig = field(default_factory=AIMDConfig)
    packing: PackConfig = field(default_factory=PackConfig)
    pressure: PressureConfig = field(default_factory=PressureConfig)

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        for name in ("host_tier", "batch_cost"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        fill = self.projected_fill
        if fill is not None and not (isinstance(fill, (int, float)) and math.isfinite(fill)
                                     and fill > 0):
            raise ValueError("projected_fill must be a finite number > 0 (or None: off)")

    def per_engine(self, engines: int, cpu_budget: str) -> "AdmissionConfig":
        """This configuration for one of ``engines`` engines on one host (the rest is per
        engine already: each has its own window and pool). The tools of every engine's
        sessions run on the same cores: with ``cpu_budget="split"`` each engine's CPU cap
        counts an equal share of them; with ``"node"`` every engine counts them all, and its
        control plane reads the others' tools: the caller joins them in one
        :class:`~mars.policy.control.pressure.NodeTools` (:meth:`BalanceAndAdmit.share_host`)."""
        if cpu_budget not in CPU_BUDGETS:
            raise ValueError(f"unknown cpu budget {cpu_budget!r}; choose one of "
                             f"{', '.join(CPU_BUDGETS)}")
        if engines <= 1 or cpu_budget == "node":
            return self
        return replace(self, pressure=replace(
            self.pressure, tool_cores=self.pressure.tool_cores / engines))


@dataclass(slots=True)
class AdmittedSession:
    session_id: str
    admitted_at: float
    enqueued_at: float
    est_blocks: int
    #: KV blocks of its latest request's whole prompt (``gpu_submit``); None until one
    #: reaches the engine
    latest_blocks: int | None = None
    #: request id -> KV blocks, for its requests in the engine (``gpu_submit`` to ``gpu_end``)
    inflight: dict[str, int] = field(default_factory=dict)
    #: its last sign of life since its last call ended (that end, a tool call of its queued,
    #: started or ended, a request of its that the sidecar saw finish); None while a call is
    #: in flight or before one ended
    idle_since: float | None = None
    #: requests the sidecar forwarded and has not seen finish (not in the engine yet, maybe)
    forwarded: int = 0
    #: KV blocks of its first round's prompt in the engine (the largest call of that round:
    #: a title or summary side call does not pass for it), and of its largest: how far its
    #: context has grown (None until its first ``gpu_submit``)
    first_blocks: int | None = None
    peak_blocks: int = 0
    #: calls submitted so far; the first and latest round numbers the events carried
    calls: int = 0
    first_round: int | None = None
    last_round: int | None = None
    #: its engine share's accounts (:class:`~mars.policy.control.residency.EngineShare`),
    #: up to ``acc_t``: block-seconds of its context while a call of its was in the engine,
    #: and while it was admitted and not quiet
    busy_bs: float = 0.0
    life_bs: float = 0.0
    acc_t: float | None = None

    def accounts(self, now: float, longest: float | None,
                 tools: int = 0) -> tuple[float, float]:
        """(busy, admitted) block-seconds up to ``now``, ``tools`` of its tool calls open
        or queued since the last account; a pause with nothing of it anywhere counts until
        it has lasted ``longest`` (the longest recent gap between rounds: past it the
        session is quiet, :meth:`quiet`, and the room does not count it either)."""
        t0 = self.admitted_at if self.acc_t is None else self.acc_t
        end = now
        if longest is not None and self.pausing(tools):
            end = min(end, max(t0, self.idle_since + longest))
        amount = self.projected_blocks * max(0.0, end - t0)
        return self.busy_bs + (amount if self.inflight else 0.0), self.life_bs + amount

    def account(self, now: float | None, longest: float | None, tools: int = 0) -> None:
        """Bring the accounts to ``now``: called before its calls, its context, its tools
        or its signs of life change (so each span has one state)."""
        if now is None or not math.isfinite(now):
            return
        self.busy_bs, self.life_bs = self.accounts(now, longest, tools)
        self.acc_t = now if self.acc_t is None else max(self.acc_t, now)

    @property
    def rounds(self) -> int:
        """Rounds it has sent: by the rounds its calls carried (side calls share their
        round), else by its calls."""
        if self.first_round is not None:  # (last_round is set with it)
            return self.last_round - self.first_round + 1
        return self.calls

    def submitted(self, blocks: int, rnd: Any) -> None:
        """One of its calls reached the engine with a prompt of ``blocks``."""
        self.calls += 1
        self.peak_blocks = max(self.peak_blocks, blocks)
        if isinstance(rnd, int) and not isinstance(rnd, bool) and rnd >= 0:
            if self.first_round is None:
                self.first_round = self.last_round = rnd
            self.last_round = max(self.last_round, rnd)
            if rnd == self.first_round:
                self.first_blocks = max(self.first_blocks or 0, blocks)
        if self.first_blocks is None:
            self.first_blocks = blocks

    @property
    def grown(self) -> int:
        """Blocks its context has grown since its first prompt reached the engine."""
        return 0 if self.first_blocks is None else max(0, self.peak_blocks - self.first_blocks)

    def pausing(self, tools: int) -> bool:
        """Nothing of it in the engine, at the sidecar or at a core (``tools``: its tool
        calls open or queued): it is between rounds with no sign of life since
        ``idle_since``."""
        return (self.idle_since is not None and not self.inflight and self.forwarded == 0
                and tools == 0)

    def quiet(self, now: float, longest: float, tools: int) -> bool:
        """Pausing (:meth:`pausing`) for longer than ``longest`` (module docstring)."""
        return self.pausing(tools) and now - self.idle_since > longest

    @property
    def projected_blocks(self) -> int:
        """KV blocks the session's context needs resident when its next round comes: the
        largest prompt it has in the engine, else its latest one (a session's latest prompt
        is its whole context: it replaces, never adds), else the admission estimate. The
        largest in flight, so a small side call (a title, a summary) submitted while the
        main call runs does not hide the main context."""
        if self.inflight:
            return max(self.inflight.values())
        return self.est_blocks if self.latest_blocks is None else self.latest_blocks


class RoundGaps:
    """The recent gaps between two rounds of a session: how long a session with nothing in
    the engine may still be between rounds (a tool, the client's own work) rather than gone.

    Bounded: the last ``max_samples`` gaps over all sessions. Below ``min_samples`` it claims
    nothing (:meth:`longest` is None) and no session is judged quiet. Why these sizes: a
    fresh gap from the same distribution outlasts the longest of ``n`` earlier ones with
    probability ``1 / (n + 1)`` -- the rate at which a session still between rounds is judged
    quiet (its next round then finds its context counted again, as before the packing room
    existed). 32 samples keep that under 3 % from the start, 512 at 0.2 %; the window is the
    retention policy's tool-duration window (:mod:`mars.policy.engine.retention`). The first gaps to
    finish are the short ones, so early on the rate is higher than the formula says."""

    def __init__(self, max_samples: int = 512, min_samples: int = 32) -> None:
        if max_samples < 1 or min_samples < 1:
            raise ValueError("max_samples and min_samples must be >= 1")
        self.min_samples = min_samples
        self._gaps: deque[float] = deque(maxlen=max_samples)
        self._longest: float | None = None  # cache, None = recompute

    def observe(self, gap: float) -> None:
        if not math.isfinite(gap) or gap < 0:
            return
        full = len(self._gaps) == self._gaps.maxlen
        self._gaps.append(gap)
        if full or self._longest is None:
            self._longest = None  # the oldest may have been the longest
        else:
            self._longest = max(self._longest, gap)

    def __len__(self) -> int:
        return len(self._gaps)

    def longest(self) -> float | None:
        """The longest recent gap, or None with fewer than ``min_samples`` gaps."""
        if len(self._gaps) < self.min_samples:
            return None
        if self._longest is None:
            self._longest = max(self._gaps)
        return self._longest


@dataclass(slots=True)
class StepResult:
    """What one control step did. Unpacks as ``admitted, decision = step(now)``."""

    admitted: list[str]
    decision: WindowDecision
    pack: PackResult | None
    in_use: int
    queued: int
    #: (session_id, queued_s, est_blocks) of each admission, for session_admit events
    admissions: list[tuple[str, float, int]] = field(default_factory=list)
    #: with a host tier, how the packing room charged the admitted contexts: "share", or
    #: "whole" where the batch cost said more sessions were not worth it ("": no host tier
    #: in play, or nothing queued)
    charge: str = ""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.admitted, self.decision))

    def events(self, now: float) -> list[dict[str, Any]]:
        """``window_update`` + one ``session_admit`` per admission (schema-valid dicts)."""
        d = self.decision
        reason = d.reason + (f"; pack={self.pack.mode.value}: {self.pack.reason}"
                             if self.pack else "") + (f"; charge={self.charge}"
                                                      if self.charge else "")
        evs = [make_event("window_update", ts=now, window=d.window, cpu_cap=d.cpu_cap,
                          kv_cap=d.kv_cap, budget=d.budget, admitted=self.in_use,
                          queued=self.queued, mode=d.mode, reason=reason)]
        for sid, queued_s, blocks in self.admissions:
            evs.append(make_event("session_admit", session_id=sid, ts=now,
                                  queued_s=queued_s, est_blocks=blocks))
        return evs


class BalanceAndAdmit:
    """Waiting queue + admitted set + UpdateWindow + PackQueue, stepped explicitly."""

    def __init__(self, config: AdmissionConfig | None = None) -> None:
        self.config = cfg = config or AdmissionConfig()
        self.state = DualPressureState(cfg.pressure)
        self.controller = WindowController(cfg.aimd)
        self.packer = PackQueue(cfg.packing)
        self._queue: dict[str, QueuedSession] = {}
        self._admitted: dict[str, AdmittedSession] = {}
        #: session -> (blocks, expires_at)
        self._pending: dict[str, tuple[int, float]] = {}
        self._seq = itertools.count()
        self.last: StepResult | None = None
        self.gaps = RoundGaps()
        self.growth = ContextGrowth()
        self.engine_share = EngineShare()
        #: the latest time seen (a step's or an event's): when a session ends, for its share
        self._now: float | None = None
        #: never ready: the projection without a forecast (``growth_forecast`` off)
        self._no_growth = ContextGrowth(max_samples=1, min_samples=2)

    def share_host(self, node: NodeTools) -> None:
        """Share the host's tool cores with the other engines' control planes in ``node``:
        they read this one's running tools and its expected ones (admitted sessions x its
        measured tools per session)."""
        node.join(self.state,
                  lambda: self.in_use * (self.controller.tools_per_session() or 0.0))

    # ------------------------------------------------------------------ introspection
    @property
    def in_use(self) -> int:
        return len(self._admitted)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def is_admitted(self, session_id: str) -> bool:
        return session_id in self._admitted

    def is_queued(self, session_id: str) -> bool:
        return session_id in self._queue

    def queued_sessions(self) -> list[QueuedSession]:
        return list(self._queue.values())

    def admitted_sessions(self) -> list[AdmittedSession]:
        return list(self._admitted.values())

    @property
    def block_size(self) -> int:
        return self.state.block_size or self.config.packing.block_size

    def pending_blocks(self, now: float) -> int:
        self._expire_pending(now)
        return sum(b for b, _ in self._pending.values())

    def projected_blocks(self, now: float | None = None) -> int:
        """KV blocks the admitted sessions' contexts are expected to need resident at once:
        the expected peak, over their coming rounds, of their summed contexts
        (:class:`~mars.policy.control.growth.ContextGrowth`; with ``growth_forecast`` off or too few
        ended sessions, the sum of each one's latest prompt); with ``now``, quiet sessions
        (module docstring) are left out."""
        return self.projection(now).peak

    def projection(self, now: float | None = None) -> Projection:
        """The admitted sessions' projected contexts (:meth:`projected_blocks`), to which
        the packer adds the sessions it picks."""
        quiet = set(self.quiet_sessions(now)) if now is not None else ()
        counted = [(a.projected_blocks, a.rounds) for a in self._admitted.values()
                   if a.session_id not in quiet]
        return self._forecaster.project(counted)

    def engine_share_now(self, now: float) -> float:
        """The measured fraction of an admitted session's time with a call in the engine,
        over recent ended sessions and the admitted ones that have finished a call (1 until
        enough count; :class:`~mars.policy.control.residency.EngineShare`)."""
        longest = self.gaps.longest()
        live = [a.accounts(now, longest, self._tools(a.session_id))
                for a in self._admitted.values() if a.calls]
        return self.engine_share.share(live)

    def footprint(self, sig: PressureSignals, now: float) -> Projection | ResidentShare:
        """What the packer charges new sessions against: the admitted sessions' projected
        contexts, each at its engine share when the engine has a host tier
        (:mod:`mars.policy.control.residency`; ``host_tier`` off or no host tier: whole)."""
        projection = self.projection(now)
        if not (self.config.host_tier and sig.host_blocks):
            return projection
        share = self.engine_share_now(now)
        return ResidentShare(projection, share, sig.host_blocks)

    def charged_footprint(self, sig: PressureSignals, now: float,
                          queued: int) -> tuple[Projection | ResidentShare, str]:
        """The :meth:`footprint` a step packs ``queued`` sessions against, and how it
        charges ("share", "whole": the share charge would admit past the whole-context room
        and the batch cost says it is not worth it now, :mod:`~mars.policy.control.batch_cost`;
        "": no host tier in play)."""
        projection = self.footprint(sig, now)
        if not isinstance(projection, ResidentShare):
            return projection, ""
        if self.config.batch_cost and not worth_admitting_more(
                queued, self.in_use, projection.share, sig.batch_share):
            return projection.whole, "whole"
        return projection, "share"

    def session_peak(self, est_blocks: int) -> int:
        """A queued session's expected peak context, from its first prompt's estimate (the
        estimate itself with ``growth_forecast`` off or too few ended sessions)."""
        return self._forecaster.session_peak(est_blocks)

    @property
    def _forecaster(self) -> ContextGrowth:
        return self.growth if self.config.growth_forecast else self._no_growth

    def _fill_blocks(self, sig: PressureSignals) -> int | None:
        """``projected_fill`` of the pool in blocks (None: off, or the pool not known)."""
        fill, pool = self.config.projected_fill, sig.pool_blocks or sig.total_blocks
        return int(fill * pool) if fill is not None and pool else None

    def quiet_sessions(self, now: float) -> list[str]:
        """Admitted sessions the packing room does not count now (module docstring)."""
        longest = self.gaps.longest()
        if longest is None or not math.isfinite(now):
            return []
        return [a.session_id for a in self._admitted.values()
                if a.quiet(now, longest, self._tools(a.session_id))]

    def forwarded(self, session_id: str, delta: int, now: float) -> None:
        """The sidecar forwarded (+1) or saw finish (-1) a request of the session: until the
        engine's ``gpu_submit`` for it arrives it is in flight only here."""
        adm = self._admitted.get(session_id)
        if adm is None or not math.isfinite(now):
            return
        adm.account(now, self.gaps.longest(), self._tools(session_id))
        if delta > 0:
            if adm.idle_since is not None and not adm.inflight and adm.forwarded == 0:
                # its next round starts: the pause since its last sign of life is a gap
                self.gaps.observe(now - adm.idle_since)
            adm.idle_since = None
        adm.forwarded = max(0, adm.forwarded + delta)
        if delta < 0 and adm.forwarded == 0 and not adm.inflight:
            adm.idle_since = now if adm.idle_since is None else max(adm.idle_since, now)

    def room(self, sig: PressureSignals, now: float,
             projection: Projection | ResidentShare | None = None) -> int | None:
        """The KV budget PackQueue packs new sessions into (None: unknown, no bound).

        The free blocks, less the estimates of sessions admitted but not yet resident
        (pending), and at most what the admitted sessions' projected contexts leave of
        ``projected_fill`` of the pool. The second bound is the paper's "projected footprint
        ... against current free capacity" (§4.1) applied to sessions, not just rounds:
        between rounds an agent's KV is freed (or pinned) while a tool runs, so the free
        blocks overstate the room, and a session admitted into them makes the returning
        rounds recompute their contexts or preempt each other (``mars sim``, H100 x
        Qwen3-Coder, ILR-3: admitted contexts summing to 1.5-2.2 pools, 7-15 preemptions of
        100K-185K-token prefills per run). The pool's size is the last one the engine
        reported (it does not go stale): the bound holds while the KV snapshot is stale
        (every session in a long tool call, the engine idle) or not yet in. The progress
        rule still admits one session when none is admitted.

        With a host tier (``projection`` a :class:`ResidentShare`, :meth:`footprint`) the
        projected contexts count at the engine share (the host pool's bound is on each
        pick: :class:`~mars.policy.control.residency.ResidentShare`)."""
        free = sig.free_blocks
        if free is not None:
            free = max(0, free - self.pending_blocks(now))
        fp = projection if projection is not None else self.footprint(sig, now)
        limit = self._fill_blocks(sig)
        if limit is not None:
            left = max(0, limit - fp.peak)
            free = left if free is None else min(free, left)
        return free

    # ------------------------------------------------------------------ inputs
    def observe(self, event: Any, now: float | None = None) -> bool:
        """Feed one event of the unified stream (dict or pydantic model). ``now``: when it
        arrived on the caller's clock (the one :meth:`step` gets); default its ``ts``."""
        if not isinstance(event, Mapping) and hasattr(event, "model_dump"):
            event = event.model_dump()
        # a session's tool calls as they were until this event (its accounts' last span)
        tools = self._tools(str(event["session_id"])) if (
            isinstance(event, Mapping) and event.get("session_id") is not None) else 0
        ok = self.state.observe(event)
        if not isinstance(event, Mapping):
            return ok
        self._tick(_when(event, now))
        if event.get("kind") == "scheduler_start":
            # a (re)started engine: the calls the old one had will send no gpu_end
            t = _when(event, now)
            longest = self.gaps.longest()
            for a in self._admitted.values():
                if a.inflight:
                    a.account(t, longest)
                    a.inflight.clear()
                    a.idle_since = t
        if event.get("session_id") is None:
            return ok
        kind, sid = event.get("kind"), str(event["session_id"])
        adm = self._admitted.get(sid)
        if kind == "gpu_submit":
            blocks = event.get("projected_blocks")
            if adm is not None and isinstance(blocks, (int, float)) and blocks >= 0:
                if adm.idle_since is not None and not adm.inflight:
                    # a round that did not come through the sidecar's forward (a direct
                    # engine feed): its pause ends here
                    t = _when(event, now)
                    if t is not None:
                        self.gaps.observe(t - adm.idle_since)
                adm.account(_when(event, now), self.gaps.longest(), tools)
                adm.idle_since = None
                adm.latest_blocks = int(blocks)
                adm.submitted(int(blocks), event.get("round"))
                adm.inflight[str(event.get("request_id"))] = int(blocks)
                ok = True
        elif kind in ("gpu_1st_token", "gpu_end", "preempt"):
            self._pending.pop(sid, None)
            if kind == "gpu_end" and adm is not None:
                rid = str(event.get("request_id"))
                if rid in adm.inflight:  # (an unknown id ends no round of ours)
                    adm.account(_when(event, now), self.gaps.longest(), tools)
                    del adm.inflight[rid]
                    if not adm.inflight:
                        adm.idle_since = _when(event, now)
        elif kind in _TOOL_LIFE and adm is not None:
            # (the pressure state keeps its open and queued calls)
            t = _when(event, now)
            if t is not None and adm.idle_since is not None:
                adm.account(t, self.gaps.longest(), tools)
                adm.idle_since = max(adm.idle_since, t)
        elif kind == "session_end":
            self.release(sid, _when(event, now), _tools=tools)
        return ok

    def _tools(self, session_id: str) -> int:
        """Its tool calls open or queued for a core (a session between rounds in a tool is
        not quiet)."""
        st = self.state
        return st.active_tools_of(session_id) + st.queued_tools_of(session_id)

    def _tick(self, t: float | None) -> None:
        if t is not None and math.isfinite(t):
            self._now = t if self._now is None else max(self._now, t)

    def enqueue(self, session_id: str, now: float, *, prompt_tokens: int = 0,
                est_blocks: int | None = None, tool_share: float | None = None,
                meta: dict[str, Any] | None = None) -> QueuedSession:
        """Queue a new session (idempotent while queued).

        Raises :class:`QueueFull` at ``max_queue`` and :class:`AlreadyAdmitted` if the session
        is already admitted (its requests should be forwarded directly).
        """
        if session_id in self._admitted:
            raise AlreadyAdmitted(session_id)
        existing = self._queue.get(session_id)
        if existing is not None:
            return existing
        if len(self._queue) >= self.config.max_queue:
            raise QueueFull(f"admission queue full ({self.config.max_queue} sessions)")
        if est_blocks is None:
            est_blocks = estimate_blocks(prompt_tokens, self.block_size)
        qs = QueuedSession(session_id=session_id, enqueued_at=now,
                           prompt_tokens=max(0, int(prompt_tokens)),
                           est_blocks=max(0, int(est_blocks)),
                           tool_share=tool_share, seq=next(self._seq), meta=dict(meta or {}))
        self._queue[session_id] = qs
        return qs

    def cancel(self, session_id: str) -> bool:
        """Withdraw a queued session (client gave up); True if it was queued."""
        return self._queue.pop(session_id, None) is not None

    def take_out(self, session_id: str) -> QueuedSession | None:
        """Remove a queued session to queue it at another engine (:meth:`put_in` there);
        None if it is not queued here."""
        return self._queue.pop(session_id, None)

    def put_in(self, qs: QueuedSession) -> None:
        """Queue a session another engine's :meth:`take_out` gave, keeping when it arrived
        (its wait counts towards ageing here as it did there)."""
        if qs.session_id in self._admitted or qs.session_id in self._queue:
            raise ValueError(f"session {qs.session_id!r} is already here")
        if len(self._queue) >= self.config.max_queue:
            raise QueueFull(f"admission queue full ({self.config.max_queue} sessions)")
        self._queue[qs.session_id] = replace(qs, seq=next(self._seq))

    def would_admit(self, est_blocks: int, now: float) -> bool:
        """Whether a control step now would admit a session whose first prompt needs
        ``est_blocks``, were it queued here (a dry run: nothing changes). Only an engine
        with no queue of its own is asked (a session moved there must not overtake the
        ones already waiting): a free slot in the window's last budget, and the packer's
        KV room (the same :meth:`room` and growth charge a step would use) or its progress
        rule (nothing admitted)."""
        if self._queue or self.last is None or self.config.max_queue < 1:
            return False  # (a queue of none could not take the session in)
        slots = self.last.decision.budget - self.in_use
        if slots <= 0:
            return False
        sig = self.state.signals(now)
        projection, _ = self.charged_footprint(sig, now, 1)  # (fresh: the packer adds to it)
        free = self.room(sig, now, projection)
        probe = QueuedSession("(probe)", now, est_blocks=max(0, int(est_blocks)))
        pack = self.packer.pack([probe], sig, slots, free, now, in_use=self.in_use,
                                footprint=projection, charge_cap=self._fill_blocks(sig))
        return bool(pack.sessions)

    def release(self, session_id: str, now: float | None = None, *,
                _tools: int | None = None) -> bool:
        """A session ended (at ``now``, default the latest time seen): free its slot
        (idempotent). Also drops it from the queue."""
        self._pending.pop(session_id, None)
        tools = self._tools(session_id) if _tools is None else _tools
        self.state.forget_session(session_id)
        adm = self._admitted.pop(session_id, None)
        was_admitted = adm is not None
        if adm is not None and adm.first_blocks is not None:
            self.growth.observe(adm.rounds, adm.grown)
        self._tick(now)
        t = now if now is not None and math.isfinite(now) else self._now
        if adm is not None and adm.calls and t is not None:
            self.engine_share.observe(*adm.accounts(t, self.gaps.longest(), tools))
        was_queued = self._queue.pop(session_id, None) is not None
        return was_admitted or was_queued

    # ------------------------------------------------------------------ control step
    def _expire_pending(self, now: float) -> None:
        for sid in [s for s, (_, exp) in self._pending.items() if exp <= now]:
            del self._pending[sid]

    def step(self, now: float) -> StepResult:
        """BalanceAndAdmit: UpdateWindow, then PackQueue over the free slots."""
        self._tick(now)
        sig = self.state.signals(now)
        in_use = self.in_use
        decision = self.controller.update(sig, in_use, now, queued=self.queued)
        slots = max(0, decision.budget - in_use)
        pack: PackResult | None = None
        admitted: list[str] = []
        admissions: list[tuple[str, float, int]] = []
        charge = ""
        if self._queue:
            projection, charge = self.charged_footprint(sig, now, self.queued)
            free = self.room(sig, now, projection)
            pack = self.packer.pack(self._queue.values(), sig, slots, free, now, in_use=in_use,
                                    footprint=projection, charge_cap=self._fill_blocks(sig))
            ttl = self.config.pending_ttl_s
            for qs in pack.sessions:
                del self._queue[qs.session_id]
                self._admitted[qs.session_id] = AdmittedSession(
                    qs.session_id, now, qs.enqueued_at, qs.est_blocks)
                if qs.est_blocks > 0:
                    self._pending[qs.session_id] = (qs.est_blocks, now + ttl)
                admitted.append(qs.session_id)
                admissions.append((qs.session_id, qs.waited(now), qs.est_blocks))
        result = StepResult(admitted, decision, pack, self.in_use, self.queued, admissions,
                            charge)
        self.last = result
        return result


#: a session's tool calls: signs of life between its rounds
_TOOL_LIFE = frozenset({"tool_enqueue", "tool_start", "tool_end"})


def _when(event: Mapping, now: float | None) -> float | None:
    if now is not None:
        return now
    ts = event.get("ts")
    return float(ts) if isinstance(ts, (int, float)) and math.isfinite(ts) else None
