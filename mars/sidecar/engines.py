"""The engines behind one sidecar, and which of them serves each session (issue #34).

One engine is the common case and costs nothing here: :class:`EngineSet` then holds a single
:class:`Engine` and every call goes to it, its events unchanged. Several engines of one model
come in two shapes: one server each (``mars sidecar --upstream URL1,URL2,...`` in front of
``mars-vllm serve --no-sidecar`` servers: vLLM's external load-balancing shape), or the ranks
of one ``mars-vllm serve --data-parallel-size N`` server (vLLM's own engines and DP
coordinator behind one API; the sidecar addresses rank r with vLLM's ``X-data-parallel-rank:
r`` header, and rank r publishes its events on its own endpoint,
:func:`mars.stream.publisher.rank_endpoint`). Either way each engine has what one has alone --
its own HTTP client, its own control plane (session window, packing room, KV state from its
own events) and a share of the tool cores -- and the placement policy
(:mod:`mars.policy.control.placement`) picks the engine of each new session from what each
engine's events show. A session's later rounds go to the same engine (their KV is there).

An engine that refuses connections is *down*: the call that found it so is sent to another
engine (nothing reached the client yet), its session moves and the move is counted; the
engine's other sessions move on their next call. A probe asks a down engine's ``/health``
every second and brings it back when it answers.

Events: with several engines, each engine event carries ``engine`` (its rank) and goes to
that engine's control plane; events of a session (tools, request ends) go to the control
plane of the engine that holds the session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

from mars.policy.control.placement import (LEAVING, Call, Decision, EngineTracker,
                                           NoEngineError, SessionRouter, Waiting,
                                           make_placer)
from mars.policy.control.pressure import NodeTools, split_tool_count
from mars.sidecar.config import SidecarConfig
from mars.sidecar.control import ControlPlane, Session, SessionRequeued
from mars.sidecar.metrics import SidecarMetrics
from mars.sidecar.upstream import Upstream, make_upstream
from mars.stream.engine_reader import EngineEventReader

log = logging.getLogger("mars.sidecar.engines")

#: vLLM's header that sends a request to one engine of a data-parallel server (lower case, as
#: ASGI gives header names)
RANK_HEADER = b"x-data-parallel-rank"
#: seconds between two health probes of a down engine
PROBE_INTERVAL_S = 1.0

__all__ = ["Engine", "EngineSet", "NoEngineError"]


@dataclasses.dataclass(eq=False)
class Engine:
    """One engine as the sidecar drives it."""

    rank: int
    upstream: Upstream
    control: ControlPlane
    events: str
    tracker: EngineTracker
    reader: EngineEventReader | None = None
    #: added to every generation request: vLLM's ``X-data-parallel-rank`` when the engines
    #: are the ranks of one ``--data-parallel-size`` server
    headers: tuple[tuple[bytes, bytes], ...] = ()
    alive: bool = True
    #: times this engine was found down
    failures: int = 0

    def view(self) -> dict[str, Any]:
        up = self.upstream
        return {"rank": self.rank, "url": up.base_url, "alive": self.alive,
                "failures": self.failures, "last_error": up.last_error,
                "engine_events": self.events or None,
                "engine_events_received": self.reader.received if self.reader else 0,
                "queued_prefill_tokens": self.tracker.queued_prefill_tokens,
                "cached_sessions": self.tracker.sessions_cached,
                **self.control.snapshot()}


#: events that change the host's running tools (with ``--cpu-budget node`` every engine's
#: control plane steps on them)
_HOST_KINDS = frozenset({"tool_start", "tool_end"})


class EngineSet:
    """The engines, their placement, and the dispatch of events to their control planes."""

    def __init__(self, config: SidecarConfig, emit: Callable[[dict[str, Any], str], None],
                 metrics: SidecarMetrics) -> None:
        self.config = config
        self.metrics = metrics
        urls = config.engine_urls
        n = len(urls)
        self.multi = n > 1
        self.router = SessionRouter(make_placer(config.placement))
        adm = config.admission_config.per_engine(n, config.cpu_budget)
        self.engines: list[Engine] = []
        for rank, (url, events) in enumerate(zip(urls, config.engines_events)):
            control = ControlPlane(
                config, partial(self._emit, emit, rank) if self.multi else emit, metrics,
                admission_config=adm, on_ended=partial(self._ended, rank),
                after_step=self._rebind if self.multi else None)
            upstream = make_upstream(config.upstream_client, url,
                                     connect_timeout_s=config.connect_timeout_s,
                                     read_timeout_s=config.read_timeout_s,
                                     max_connections=config.max_connections)
            headers = ((RANK_HEADER, str(rank).encode()),) \
                if config.data_parallel_size > 1 else ()
            self.engines.append(Engine(rank, upstream, control, events, EngineTracker(rank),
                                       headers=headers))
        self._probe: asyncio.Task | None = None
        self._rebinding = False
        #: the host's tool cores, shared by the engines' control planes (``cpu_budget``
        #: "node"; None: one engine, or an equal share each)
        self.node_tools: NodeTools | None = None
        if self.multi:
            for e in self.engines:
                e.control.owner_of = self._owner_of
            if config.cpu_budget == "node":
                self.node_tools = NodeTools()
                for e in self.engines:
                    e.control.core.balance.share_host(self.node_tools)

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, rank: int) -> Engine:
        return self.engines[rank]

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[..., None],
              on_malformed: Callable[[], None]) -> None:
        """Subscribe to each engine's events; ``deliver(events, source=...)`` publishes."""
        for e in self.engines:
            if e.events:
                cb = partial(self._deliver, deliver, e.rank) if self.multi else \
                    partial(deliver, source="engine")
                e.reader = EngineEventReader(e.events, cb, loop, on_malformed=on_malformed)
                e.reader.start()
        if self.multi:
            self._probe = loop.create_task(self._probe_down())

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            try:
                await self._probe
            except asyncio.CancelledError:
                pass
        for e in self.engines:
            if e.reader is not None:
                e.reader.stop()
            await e.upstream.aclose()

    @staticmethod
    def _emit(emit: Callable[[dict[str, Any], str], None], rank: int, ev: dict[str, Any],
              source: str) -> None:
        ev["engine"] = rank
        emit(ev, source)

    @staticmethod
    def _deliver(deliver: Callable[..., None], rank: int, events: list[dict[str, Any]]) -> None:
        for ev in events:
            ev["engine"] = rank
        deliver(events, source="engine")

    # ------------------------------------------------------------------ events
    def observe(self, ev: dict[str, Any]) -> None:
        """Hub observer: each event to the control plane it concerns."""
        if not self.multi:
            self.engines[0].control.observe(ev)
            return
        rank = ev.get("engine")
        if rank is not None:  # an engine's own event, or its control plane's
            if isinstance(rank, int) and 0 <= rank < len(self.engines):
                e = self.engines[rank]
                kind = ev.get("kind")
                if kind in _TRACKED:  # (engine kinds: no control plane emits them)
                    e.tracker.observe(ev)
                    if kind == "kv_snapshot":
                        self.router.placer.snapshot(rank)
                e.control.observe(ev)
            return
        kind = ev.get("kind")
        if kind == "tool_num":
            active = ev.get("active")
            if not isinstance(active, int) or isinstance(active, bool) or active < 0:
                for e in self.engines:  # malformed: each control plane counts it ignored
                    e.control.observe(ev)
                return
            if self.node_tools is not None:
                # the host's count of running tools: each engine keeps what it tracks of its
                # own sessions' as far as the count allows (their sum is the host's)
                shares = split_tool_count(
                    active, [e.control.core.balance.state.tracked_tools for e in self.engines])
            else:
                # each engine holds an equal share of the cores: an equal share of the tools
                n = len(self.engines)
                shares = [active // n + (e.rank < active % n) for e in self.engines]
            for e, share in zip(self.engines, shares):
                e.control.observe({**ev, "active": share})
            return  # (every engine stepped: each was told its count)
        sid = ev.get("session_id")
        rank = self.router.engine_of(sid) if sid else None
        if rank is None and sid:
            # a session no engine holds (ended, or not placed yet): its tools still use this
            # host's cores; counted once, on an engine its id picks
            rank = zlib.crc32(str(sid).encode()) % len(self.engines)
        host = rank is not None and self.node_tools is not None and (
            kind in _HOST_KINDS or (kind == "session_end" and sid and self.engines[rank]
                                    .control.core.balance.state.active_tools_of(str(sid))))
        for e in (self.engines if rank is None else (self.engines[rank],)):
            e.control.observe(ev)
        if host:
            # the host's tools changed (a tool started or ended, or a session ended with
            # tools still running, which its end drops): the other engines' caps read them
            # at once, not at their next timer step. Any other session end changes only
            # its own engine's expected tools, which the others read at their next step
            # (``step_interval_s``), as in ``mars sim``
            for e in self.engines:
                if e.rank != rank:
                    e.control.kick()

    def _ended(self, rank: int, s: Session, reason: str) -> None:
        """A session ended on engine ``rank``: forget where it was, unless it is leaving for
        another engine (a move ends it on the engine it leaves)."""
        if not self.multi:
            return
        if reason in LEAVING:
            self.engines[rank].tracker.forget(s.id)
        elif self.router.engine_of(s.id) == rank:
            self.router.end(s.id)
            self.engines[rank].tracker.forget(s.id)

    # ------------------------------------------------------------------ placement
    def place(self, sid: str, prompt_tokens: Callable[[], int]) -> tuple[Engine, Decision]:
        """The engine of session ``sid``'s call; raises :class:`NoEngineError`."""
        if not self.multi:
            return self.engines[0], Decision(0)
        known = self.router.engine_of(sid)
        if known is not None and self.router.placer.sticky and self.engines[known].alive:
            return self.engines[known], Decision(known)
        call = Call(sid, prompt_tokens(),
                    {e.rank: e.tracker.cached_tokens(sid) for e in self.engines})
        d = self.router.route(call, [self._load(e) for e in self.engines])
        if d.moved:
            self.metrics.session_moves.inc()
        if known is not None and known != d.rank:
            # the session left engine `known` (gone, or a per-call placer sent it away): it
            # gives back what it held there now, or when its calls still there are done
            old = self.engines[known].control
            s = old.sessions.get(sid)
            reason = "moved" if d.moved else "switched"
            if s is not None and s.inflight == 0 and s.waiting == 0:
                old.end(s, reason)
            elif s is not None:
                s.end_reason = reason
        return self.engines[d.rank], d

    async def acquire(self, e: Engine, sid: str, **kw: Any) -> tuple[Engine, Session]:
        """Session ``sid``'s call, placed on ``e``, waits for admission there
        (:meth:`ControlPlane.acquire`, ``kw`` its arguments); if the session is moved while
        it waits (late binding, or ``e`` found down) and admitted at another engine, the
        call follows it there (:meth:`follow`). Returns the engine and the session. A call
        refused before its session began (queue full, admission timeout, client gone) leaves
        no placement behind (:meth:`refused`)."""
        try:
            while True:
                try:
                    return e, await e.control.acquire(sid, **kw)
                except SessionRequeued as moved:
                    e = self.follow(sid, moved.owner, kw.get("prompt_tokens"))
        except BaseException:
            self.refused(e, sid)
            raise

    def follow(self, sid: str, owner: ControlPlane,
               prompt_tokens: Callable[[], int] | None) -> Engine:
        """The engine whose control plane ``owner`` admitted session ``sid`` after it moved
        there: the request follows the session record itself. Placement is not asked again
        (a per-call placer would choose anew, a third engine perhaps, and leave the slot
        the session was admitted to unused until it expired), nor the router (a concurrent
        call of the same session may have sent it elsewhere since). If that engine is down
        by now, the call is placed as any other."""
        e = next((x for x in self.engines if x.control is owner), None)
        if e is None or not e.alive:
            return self.place(sid, prompt_tokens or (lambda: 0))[0]
        return e

    def _rebind(self, now: float) -> None:
        """After a control step: queued sessions move to an engine that would admit them
        now (MARS placement's late binding, :meth:`SessionRouter.rebind`), with the future
        their waiting requests await; the engine that takes one steps at once, so that a
        session is admitted where it moved before any other engine can ask for it back."""
        if self._rebinding or not self.router.placer.rebinds_queued:
            return
        live = [e for e in self.engines if e.alive]
        waiting = [Waiting(qs.session_id, e.rank, qs.enqueued_at, qs.prompt_tokens,
                           qs.est_blocks)
                   for e in live for qs in e.control.core.queued_sessions()]
        if not waiting or not any(e.control.core.would_admit(0, now) for e in live):
            return
        engines = self.engines
        moves = self.router.rebind(
            waiting, [self._load(e) for e in engines],
            lambda rank, blocks: engines[rank].alive and
            engines[rank].control.core.would_admit(blocks, now))
        self._rebinding = True
        try:
            for mv in moves:
                dst = engines[mv.target].control
                if mv.session_id in dst.sessions:
                    continue  # (listed at two engines: left where it is)
                if not self._move_queued(engines[mv.source].control, dst, mv.session_id, now):
                    log.error("rebind: %s was not queued at engine %d", mv.session_id,
                              mv.source)
                    continue
                self.router.rebound(mv.session_id, mv.target)
                self.metrics.session_rebinds.inc()
                dst.step(now)
        finally:
            self._rebinding = False

    @staticmethod
    def _move_queued(src: ControlPlane, dst: ControlPlane, sid: str, now: float) -> bool:
        """Queued session ``sid`` from ``src``'s queue to ``dst``'s, with the admission future
        its waiting requests await (False: it was not queued at ``src``)."""
        got = src.core.transfer_out(sid, now)
        if got is None:
            return False
        dst.take_queued(*got, src.hand_over(sid))
        return True

    def _owner_of(self, s: Session) -> ControlPlane | None:
        """The control plane that holds session record ``s`` (not the router's engine of
        its id: a concurrent call of a per-call placer may have sent that elsewhere)."""
        return next((e.control for e in self.engines
                     if e.control.core.sessions.get(s.id) is s), None)

    def refused(self, e: Engine, sid: str) -> None:
        """The call placed on ``e`` was refused before its session began there (queue full,
        admission timeout): the session is not there, so the router must not say it is."""
        if self.multi and sid not in e.control.sessions and \
                self.router.engine_of(sid) == e.rank:
            self.router.end(sid)

    def _load(self, e: Engine):
        return e.tracker.load_with(e.control.core.load_view(time.time()), alive=e.alive,
                                   sessions=self.router.sessions_on(e.rank))

    def down(self, e: Engine) -> None:
        """``e`` refused a connection: place nothing there until it answers its health
        probe. (One engine: nowhere else to go; it is tried again with every call.)"""
        if self.multi and e.alive:
            e.alive = False
            e.failures += 1
            log.warning("engine %d (%s) is down: %s", e.rank, e.upstream.base_url,
                        e.upstream.last_error)
            self._evacuate(e, time.time())

    def _evacuate(self, e: Engine, now: float) -> None:
        """Engine ``e`` is down: the sessions queued at its door hold nothing there, and would
        wait for admissions that its control plane, seeing no progress, makes late or never
        (then fail at ``--admission-timeout``, minutes later). Each goes, with its arrival
        time and its waiting requests, to the engine placement picks among the alive ones,
        queued there (counted as a move, as an admitted session's is when its engine goes);
        the engines that took some step at once. Its woken request follows it there
        (:meth:`acquire`), whatever the placer. With no engine alive they stay: a session's
        next call fails at once, saying so."""
        live = [x for x in self.engines if x.alive]
        queued = e.control.core.queued_sessions()
        if not live or not queued:
            return
        took: set[int] = set()
        moved = 0
        self._rebinding = True  # (no late binding while the queue moves)
        try:
            for qs in queued:
                sid = qs.session_id
                if any(sid in x.control.sessions for x in live):
                    continue  # (still held where a call of it went: left where it is)
                call = Call(sid, qs.prompt_tokens, {x.rank: x.tracker.cached_tokens(sid)
                                                    for x in live})
                d = self.router.route(call, [self._load(x) for x in self.engines])
                if not self._move_queued(e.control, self.engines[d.rank].control, sid, now):
                    continue  # (it was queued there a moment ago)
                if d.moved:
                    self.metrics.session_moves.inc()
                took.add(d.rank)
                moved += 1
            for rank in sorted(took):
                self.engines[rank].control.step(now)
        finally:
            self._rebinding = False
        log.warning("engine %d is down: %d queued session(s) moved to engine(s) %s", e.rank,
                    moved, ", ".join(map(str, sorted(took))))

    async def _probe_down(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            for e in self.engines:
                if not e.alive:
                    try:
                        ok = await e.upstream.get_text("/health") is not None
                    except Exception:  # a probe must never end the loop
                        ok = False
                    if ok:
                        e.alive = True
                        log.warning("engine %d (%s) is back", e.rank, e.upstream.base_url)

    @staticmethod
    def headers_for(e: Engine, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """A generation request's headers for engine ``e``: its rank header replaces any the
        client sent (the session's engine is the sidecar's decision)."""
        if not e.headers:
            return headers
        return [h for h in headers if h[0] != RANK_HEADER] + list(e.headers)

    def any_alive(self) -> bool:
        return any(e.alive for e in self.engines)

    def first_alive(self) -> Engine:
        """For calls of no session (models, health, tokenize): any engine answers them."""
        return next((e for e in self.engines if e.alive), self.engines[0])

    # ------------------------------------------------------------------ views
    def find_session(self, sid: str) -> Engine | None:
        rank = self.router.engine_of(sid)
        if rank is not None:
            return self.engines[rank]
        for e in self.engines:
            if sid in e.control.sessions:
                return e
        return None

    def placement_view(self) -> dict[str, Any]:
        return {"placement": self.router.placer.name, "moves": self.router.moves,
                "switches": self.router.switches, "rebinds": self.router.rebinds,
                "engines": [{**e.view(), "placed": self.router.sessions_on(e.rank)}
                            for e in self.engines]}


#: engine events the placement tracker folds
_TRACKED = frozenset({"kv_snapshot", "scheduler_start", "gpu_submit", "gpu_1st_token",
                      "gpu_end"})
