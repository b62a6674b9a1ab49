"""Placement: which of several engines of one model serves an agent session (issue #34).

MARS's control plane (§4.2) decides *when* a session may enter one engine: the window
(:mod:`mars.policy.control.window`) bounds how many, the packer
(:mod:`mars.policy.control.packing`) picks which by their KV footprint. Past one GPU a third
decision comes first: *where*. The paper's reasoning carries over unchanged. A session's
rounds are cheap only where its context is already cached (§3: the KV a tool pause keeps is
what saves the re-prefill), so every later round goes to the engine that holds it; and a new
session costs least on the engine whose queue of prefill work is shortest and whose pool can
take its footprint without evicting contexts that other sessions will come back to.

Two roles, as in vLLM's ``v1/core/sched`` (policy separate from mechanism):

:class:`Placer`
    The policy: given a call and what is known of each engine (:class:`EngineLoad`), the
    engine to send it to. :class:`MarsPlacer` and the baselines of issue #34 —
    :class:`VllmDpPlacer` (vLLM 0.32's own data-parallel balancer, its score read from
    ``DPLBAsyncMPClient.get_core_engine_for_request``), :class:`RoundRobinPlacer`,
    :class:`SessionHashPlacer` (session affinity as Dynamo's and llm-d's routers give it),
    :class:`KvOverlapPlacer` (Dynamo's KV router cost).
:class:`SessionRouter`
    The mechanism: remembers where each session went, sends its later rounds there while
    that engine is alive (for placers that keep sessions; the per-call baselines re-place every
    call, as they do in their own systems), moves an admitted session only when its engine
    is gone, and counts the moves; a session still queued may move to an engine that admits
    it at once (MARS's late binding, :meth:`SessionRouter.rebind`), counted apart.

Framework-free: no vLLM, no HTTP; the sidecar and the simulator fill :class:`EngineLoad`
from each engine's own events.
"""

from __future__ import annotations

import abc
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine as its own events (and the router's own bookkeeping) show it.

    Token quantities are in tokens, block quantities in the engine's KV blocks; the prefill
    rate is measured (the step-time model's, or the engine's own steps): it converts the
    token counts every cost below is made of into seconds.
    """

    rank: int
    alive: bool = True
    block_size: int = 16
    total_blocks: int = 0
    free_blocks: int = 0
    #: blocks held for sessions in a tool (pinned); neither free nor reclaimable at no cost
    pinned_blocks: int = 0
    #: requests the engine has waiting and running (its last snapshot)
    waiting: int = 0
    running: int = 0
    #: calls the router sent there that have not finished (exact, unlike the snapshot)
    inflight: int = 0
    #: prompt tokens of calls sent there whose prefill has not started
    queued_prefill_tokens: int = 0
    #: sessions placed there and not ended, and the engine's session window (0: no window)
    sessions: int = 0
    window: int = 0
    #: blocks the engine's admitted sessions are projected to need beyond what they hold
    #: (the growth forecast the packer charges, :mod:`mars.policy.control.growth`)
    committed_blocks: int = 0
    #: measured prefill throughput, tokens per second (> 0)
    prefill_tokens_per_s: float = 10_000.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"engine {self.rank}: block_size must be >= 1")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"engine {self.rank}: prefill_tokens_per_s must be > 0")

    @property
    def has_kv_stats(self) -> bool:
        """Whether the engine has reported its pool yet (its first snapshot)."""
        return self.total_blocks > 0

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool not free (vLLM's ``kv_cache_usage``)."""
        return 1.0 - self.free_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def wait_line(self) -> float:
        """How far back in its engine's queue a new session would wait, in windows: the
        sessions already waiting for a slot, plus itself, over the slots that free as
        sessions end (0 where the window has room or there is none)."""
        if self.window <= 0 or self.sessions < self.window:
            return 0.0
        return (self.sessions - self.window + 1) / self.window


@dataclass(frozen=True, slots=True)
class Call:
    """The call to place: its session, its prompt, and how much of the prompt each engine
    already caches (``cached_tokens[rank]``, from prefix-hit events; absent: none)."""

    session_id: str
    prompt_tokens: int
    cached_tokens: Mapping[int, int] = field(default_factory=dict)


#: session_end reasons that mean "on to another engine", not "over"
LEAVING = frozenset({"moved", "switched", "requeued"})


class NoEngineError(RuntimeError):
    """Every engine is gone: nothing can serve the call (the sidecar answers 503)."""


class Placer(abc.ABC):
    """Choose the engine for a call. ``sticky``: whether the router keeps a session's later
    rounds on the engine its first round went to (MARS, session hashing), or asks again for
    every call (vLLM's balancer, round robin, the KV-overlap router: their own systems route
    each request on its own)."""

    name: str = ""
    sticky: bool = True
    #: whether a session still queued at its engine's door moves to another engine that
    #: would admit it now (:meth:`SessionRouter.rebind`): MARS's late binding
    rebinds_queued: bool = False

    def keys(self, call: Call, engines: Sequence[EngineLoad]) -> dict[int, tuple]:
        """Each alive engine's key for ``call``, lower better: what late binding compares
        (a queued session moves only to an engine strictly better than its own). Placers
        that set ``rebinds_queued`` provide it."""
        raise NotImplementedError(f"{self.name} does not rebind queued sessions")

    @abc.abstractmethod
    def choose(self, call: Call, engines: Sequence[EngineLoad]) -> int:
        """The rank to send ``call`` to, among the alive ``engines`` (never empty)."""

    def snapshot(self, rank: int | None = None) -> None:
        """New counts from engine ``rank`` (None: from every engine). Placers that keep
        their own additions between snapshots (vLLM's) drop them here."""


def _alive(engines: Sequence[EngineLoad]) -> list[EngineLoad]:
    live = [e for e in engines if e.alive]
    if not live:
        raise NoEngineError("no engine is alive")
    return live


class MarsPlacer(Placer):
    """Where a new session costs least, in seconds of the engine's prefill time.

    For each engine: the prefill work already queued there, plus the part of this prompt it
    does not cache, plus the recompute its admission would force when the footprint does not
    fit the room left (free blocks less what admitted sessions are projected to grow into:
    taking that room evicts contexts their owners come back to, and each evicted token is
    prefilled again), all divided by the engine's measured prefill rate. An engine whose
    window is full ranks after every engine with room: the session would wait there for a
    slot while another admits it now; among full engines the shortest line for a slot, in
    windows (:attr:`EngineLoad.wait_line`), goes first, since a slot frees each time one of
    the admitted sessions ends. Ties go to the engine with the most room left (a session's
    context grows round by round: where the pool is nearly full its later rounds are the
    ones that force evictions, though its first prompt fits), then to the one with fewer
    sessions, then the lower rank. An engine that has not reported its pool yet is charged
    no recompute (nothing is known to be evicted there) and counts as having as much room as
    the roomiest engine that has: engines report their pool as they step, so one that has
    not is most likely one that has run nothing yet.

    Nothing here is a tuned weight: the terms are token counts the events give and the
    prefill rate the step-time model measures, so they add up in one unit.

    The choice binds a session to an engine only once it is admitted there. Until then it
    holds nothing at that engine (no KV, no call in flight), so where it waits is no
    commitment: when another engine would admit it now and this placer, choosing among its
    own engine and those, prefers another, it moves (:meth:`SessionRouter.rebind`). Without that, N engines are N separate queues: a session
    waits behind its engine's window while another engine has a free slot and room, the
    pooling loss of N single-server queues against one N-server queue. (``mars sim``, ILR-3
    at a fixed load per engine, before this: on eight engines one had sessions queued while
    another had window room for 183 of the 244 s in which any queue was non-empty, and the
    mean wait at the door grew from 2.3 s on one engine to 7-27 s per engine.)
    """

    name = "mars"
    sticky = True
    rebinds_queued = True

    def cost_s(self, call: Call, e: EngineLoad) -> float:
        cached = min(call.prompt_tokens, max(0, call.cached_tokens.get(e.rank, 0)))
        uncached = call.prompt_tokens - cached
        need = math.ceil(uncached / e.block_size)
        room = e.free_blocks - e.committed_blocks if e.has_kv_stats else need
        shortfall_tokens = max(0, need - max(0, room)) * e.block_size
        work = e.queued_prefill_tokens + uncached + shortfall_tokens
        return work / e.prefill_tokens_per_s

    @staticmethod
    def room_blocks(e: EngineLoad) -> int | None:
        """Free blocks less what the admitted sessions are projected to grow into (None for
        an engine that has not reported its pool)."""
        return max(0, e.free_blocks - e.committed_blocks) if e.has_kv_stats else None

    def keys(self, call: Call, engines: Sequence[EngineLoad]) -> dict[int, tuple]:
        """Each alive engine's rank key (lower is better; the lower rank breaks a tie)."""
        live = _alive(engines)
        rooms = {e.rank: self.room_blocks(e) for e in live}
        top = max((r for r in rooms.values() if r is not None), default=0)
        return {e.rank: (e.wait_line, self.cost_s(call, e),
                         -(top if rooms[e.rank] is None else rooms[e.rank]), e.sessions)
                for e in live}

    def choose(self, call: Call, engines: Sequence[EngineLoad]) -> int:
        keys = self.keys(call, engines)
        return min(keys, key=lambda r: (keys[r], r))


class VllmDpPlacer(Placer):
    """vLLM 0.32's data-parallel load balancer, per request (``DPLBAsyncMPClient``): the
    score of an engine is the larger of its ``waiting + running`` snapshot and this client's
    own in-flight count, plus ``waiting x 6 x max(0, kv_usage - 0.5)`` (waiting requests
    weigh more as the pool fills); the lowest score wins, the scan starting one engine later
    at every call so that ties rotate, in rank order. Between two snapshots of the engines'
    counts (vLLM's coordinator publishes one every 100 ms) it adds each call it sends to the
    chosen engine's ``waiting``, as vLLM does, and forgets those additions when the caller
    says a new snapshot arrived (:meth:`snapshot`); the caller counts the call in
    ``inflight`` at once (vLLM's exact floor). One client (the sidecar), so the in-flight
    count is not scaled: a ``--data-parallel-size N`` server runs N API servers, each
    scaling its own by N. It knows no sessions: each round is placed on its own."""

    name = "vllm_dp"
    sticky = False

    def __init__(self) -> None:
        self._start = 0
        self._sent: dict[int, int] = {}  # rank -> calls sent since the last snapshot

    def snapshot(self, rank: int | None = None) -> None:
        """New counts from the engines (or engine ``rank``): the local additions are in
        them now."""
        if rank is None:
            self._sent.clear()
        else:
            self._sent.pop(rank, None)

    def score(self, e: EngineLoad) -> float:
        waiting = e.waiting + self._sent.get(e.rank, 0)
        s = float(max(e.inflight, waiting + e.running))
        if waiting:
            s += waiting * 6.0 * max(0.0, e.kv_usage - 0.5)
        return s

    def choose(self, call: Call, engines: Sequence[EngineLoad]) -> int:
        live = sorted(_alive(engines), key=lambda e: e.rank)
        n = len(live)
        best = min(range(n), key=lambda i: (self.score(live[(self._start + i) % n]), i))
        chosen = live[(self._start + best) % n]
        self._start = (self._start + 1) % n
        self._sent[chosen.rank] = self._sent.get(chosen.rank, 0) + 1
        return chosen.rank


class RoundRobinPlacer(Placer):
    """Each call to the next alive engine in rank order (a plain HTTP balancer)."""

    name = "round_robin"
    sticky = False

    def __init__(self) -> None:
        self._next = 0

    def choose(self, call: Call, engines: Sequence[EngineLoad]) -> int:
        live = sorted(_alive(engines), key=lambda e: e.rank)
        chosen = live[self._next % len(live)]
        self._next += 1
        return chosen.rank


class SessionHashPlacer(Placer):
    """Session affinity by consistent hashing: rendezvous (highest-random-weight) hashing of
    the session id over the alive engines, so a session always lands on the same engine and,
    when one is gone, only its sessions move. Load is not looked at. (Dynamo's and llm-d's
    session affinity places a session's first request by their load or KV cost and then
    sticks to it: :class:`KvOverlapPlacer` with ``sticky`` set is that one.)"""

    name = "session_hash"
    sticky = True

    @staticmethod
    def weight(session_id: str, rank: int) -> int:
        h = hashlib.blake2b(f"{session_id}\0{rank}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "big")

    def choose(self, call: Call, engines: Sequence[EngineLoad]) -> int:
        return max(_alive(engines), key=lambda e: (self.weight(call.session_id, e.rank),
                                                   -e.rank)).rank


class KvOverlapPlacer(Placer):
    """Dynamo's KV router cost, per request: ``overlap_weight x prefill blocks + decode
    blocks``. The prefill blocks are the engine's prefill work in flight (queued prompt
    tokens) plus the prompt's tokens it does not cache, in blocks; the decode blocks are
    those active there (in use by requests: the pool less its free blocks and less the
    blocks pinned for sessions in a tool, which Dynamo's router would not count) plus the
    prompt's own. The lowest cost wins (Dynamo's default temperature 0 and weight 1.0). The
    cache overlap keeps a session's rounds together while its blocks stay cached;
    ``sticky=True`` makes it Dynamo's session affinity (first call by cost, then stay)."""

    name = "kv_overlap"
    sticky = False

    def __init__(self, overlap_weight: float = 1.0, sticky: bool = False) -> None:
        if overlap_weight < 0:
            raise ValueError("overlap_weight must be >= 0")
        self.overlap_weight = overlap_weight
        self.sticky = sticky

    def cost(self, call: Call, e: EngineLoad) -> float:
        prompt_blocks = math.ceil(call.prompt_tokens / e.block_size)
        overlap = min(prompt_blocks, max(0, call.cached_tokens.get(e.rank, 0)) // e.block_size)
        prefill = e.queued_prefill_tokens / e.block_size + prompt_blocks - overlap
        active = max(0, e.total_blocks - e.free_blocks - e.pinned_blocks)
        return self.overlap_weight * prefill + active + prompt_blocks

    def choose(self, call: Call, engines: Sequence[EngineLoad]) -> int:
        return min(_alive(engines), key=lambda e: (self.cost(call, e), e.rank)).rank


PLACERS: dict[str, type[Placer]] = {p.name: p for p in (
    MarsPlacer, VllmDpPlacer, RoundRobinPlacer, SessionHashPlacer, KvOverlapPlacer)}


def make_placer(name: str) -> Placer:
    """The placer registered as ``name``; a clear error naming the choices otherwise."""
    try:
        return PLACERS[name]()
    except KeyError:
        raise ValueError(f"unknown placement {name!r}; choose one of "
                         f"{', '.join(sorted(PLACERS))}") from None


@dataclass(frozen=True, slots=True)
class Waiting:
    """A session queued at engine ``rank``'s door: not admitted, so it holds nothing there."""

    session_id: str
    rank: int
    #: when it arrived (the order across engines: the longest-waiting moves first)
    since: float
    prompt_tokens: int
    #: KV blocks of its first prompt (what an engine's packer would charge it at least)
    est_blocks: int


@dataclass(frozen=True, slots=True)
class Rebind:
    """Move queued session ``session_id`` from engine ``source``'s queue to ``target``'s."""

    session_id: str
    source: int
    target: int


@dataclass(frozen=True, slots=True)
class Decision:
    rank: int
    #: the session was on another engine, now gone, and changed engine
    moved: bool = False
    #: the session's previous call went to another engine, still alive (a per-call placer
    #: sent it away from its cached context)
    switched: bool = False


class SessionRouter:
    """Where each session's calls go: the placer's choice for its first call, the same
    engine for its later calls while that engine is alive (sticky placers), a new choice
    when it is gone (counted in :attr:`moves`). A per-call placer may send a session's call
    away from the engine of its previous call while that one is alive: counted in
    :attr:`switches` (each such call prefills its context again). Sessions end with
    :meth:`end`.

    Pure bookkeeping, no clock: the caller ends every session it placed (:meth:`end`) when
    it ends there, its expiry included, and when the call that placed it was refused before
    the session began there (queue full)."""

    def __init__(self, placer: Placer) -> None:
        self.placer = placer
        self._where: dict[str, int] = {}
        self.moves = 0
        self.switches = 0
        self.rebinds = 0

    def route(self, call: Call, engines: Sequence[EngineLoad]) -> Decision:
        alive = {e.rank for e in engines if e.alive}
        if not alive:
            raise NoEngineError("no engine is alive")
        known = self._where.get(call.session_id)
        if self.placer.sticky and known is not None and known in alive:
            return Decision(known)
        rank = self.placer.choose(call, engines)
        if rank not in alive:
            raise AssertionError(f"{self.placer.name} chose engine {rank}, which is not alive")
        moved = known is not None and known not in alive
        switched = known is not None and known in alive and rank != known
        self.moves += moved
        self.switches += switched
        self._where[call.session_id] = rank
        return Decision(rank, moved, switched)

    def rebind(self, waiting: Sequence[Waiting], engines: Sequence[EngineLoad],
               admits: Callable[[int, int], bool]) -> list[Rebind]:
        """Queued sessions that another engine would admit now, and that engine (none unless
        the placer ``rebinds_queued``). ``admits(rank, est_blocks)``: whether engine
        ``rank``'s control plane would admit, at its next step, a new session needing
        ``est_blocks`` (it answers no while it has a queue of its own, so a moved session
        never overtakes the ones waiting there); asked as little as its monotony allows (an
        engine that refuses N blocks refuses more).

        The longest-waiting session goes first, across engines (arrival order, as one queue
        would serve them). It moves to the best of the engines that would admit it, by the
        placer's :meth:`Placer.keys`, only when that one is strictly better than its own
        engine (counted without the session itself, which is only waiting there; a tie
        stays, so two equal engines never trade a session back and forth); that engine
        takes no other in this call (it has a queue now). A session listed
        twice is left where it is. The caller moves each session and then records it
        (:meth:`rebound`); nothing here changes the router."""
        if not self.placer.rebinds_queued or not waiting:
            return []
        by_rank = {e.rank: e for e in engines}
        yes: dict[int, int] = {}  # rank -> most blocks it was seen to admit
        no: dict[int, int] = {}  # rank -> fewest blocks it was seen to refuse

        def ok(rank: int, blocks: int) -> bool:
            if blocks <= yes.get(rank, -1):
                return True
            if blocks >= no.get(rank, math.inf):
                return False
            if admits(rank, blocks):
                yes[rank] = blocks
                return True
            no[rank] = blocks
            return False

        open_ = {e.rank for e in engines if e.alive and ok(e.rank, 0)}
        counts: dict[str, int] = {}
        for w in waiting:
            counts[w.session_id] = counts.get(w.session_id, 0) + 1
        out: list[Rebind] = []
        for w in sorted(waiting, key=lambda w: (w.since, w.session_id)):
            if not open_:
                break
            if counts[w.session_id] > 1:
                continue
            takers = [by_rank[r] for r in sorted(open_)
                      if r != w.rank and ok(r, w.est_blocks)]
            if not takers:
                continue
            here = [replace(by_rank[w.rank], sessions=max(0, by_rank[w.rank].sessions - 1))
                    ] if w.rank in by_rank and by_rank[w.rank].alive else []
            keys = self.placer.keys(Call(w.session_id, w.prompt_tokens), here + takers)
            rank = min((t.rank for t in takers), key=lambda r: (keys[r], r))
            if w.rank in keys and not keys[rank] < keys[w.rank]:
                continue  # its own engine is as good: a tie never moves a session
            open_.discard(rank)
            out.append(Rebind(w.session_id, w.rank, rank))
        return out

    def rebound(self, session_id: str, rank: int) -> None:
        """A queued session moved to engine ``rank`` (a :meth:`rebind` the caller did)."""
        self._where[session_id] = rank
        self.rebinds += 1

    def engine_of(self, session_id: str) -> int | None:
        return self._where.get(session_id)

    def sessions_on(self, rank: int) -> int:
        return sum(1 for r in self._where.values() if r == rank)

    def end(self, session_id: str) -> None:
        self._where.pop(session_id, None)


class EngineTracker:
    """One engine's load as its own events show it, folded for :class:`EngineLoad`.

    * the pool and the engine's queue: its latest ``kv_snapshot`` (the block size from its
      ``scheduler_start``);
    * the prefill work it has accepted and not started: the prompt tokens of every call from
      its ``gpu_submit`` until its ``gpu_1st_token`` (or a ``gpu_end`` without one: aborted);
    * what a session left cached there: the prompt and output of the session's last call
      that ended on this engine (an upper bound: the engine may have evicted part of it since,
      which no event says until the next call's ``cached_tokens``).

    Framework-free; the sidecar feeds it one engine's events, the simulator can too."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.block_size = 16  # until the engine's scheduler_start says
        self.snapshot: dict = {}
        self._queued: dict[str, int] = {}  # request_id -> prompt tokens before its first token
        self.queued_prefill_tokens = 0
        self._prompt: dict[str, tuple[str, int]] = {}  # request_id -> (session, prompt tokens)
        self._cached: dict[str, int] = {}  # session -> tokens its last call left here

    def observe(self, ev: Mapping) -> None:
        kind = ev.get("kind")
        if kind == "kv_snapshot":
            self.snapshot = dict(ev)
        elif kind == "scheduler_start":  # (re)started: nothing queued, nothing cached
            self.block_size = max(1, int(ev.get("block_size") or 1))
            self._queued.clear()
            self._prompt.clear()
            self._cached.clear()
            self.queued_prefill_tokens = 0
        elif kind == "gpu_submit":
            rid = str(ev.get("request_id"))
            n = int(ev.get("prompt_tokens") or 0)
            self.queued_prefill_tokens += n - self._queued.get(rid, 0)
            self._queued[rid] = n
            sid = ev.get("session_id")
            if sid:
                self._prompt[rid] = (str(sid), n)
        elif kind in ("gpu_1st_token", "gpu_end"):
            rid = str(ev.get("request_id"))
            self.queued_prefill_tokens -= self._queued.pop(rid, 0)
            if kind == "gpu_end":
                got = self._prompt.pop(rid, None)
                if got is not None:
                    self._cached[got[0]] = got[1] + int(ev.get("output_tokens") or 0)

    @property
    def sessions_cached(self) -> int:
        """Sessions whose context this tracker remembers (bounded by the sessions placed
        here: each is forgotten when it ends or leaves)."""
        return len(self._cached)

    def cached_tokens(self, session_id: str) -> int:
        return self._cached.get(session_id, 0)

    def forget(self, session_id: str) -> None:
        """The session is over: its context is no reason to come back here."""
        self._cached.pop(session_id, None)

    def load_with(self, control: Mapping, *, alive: bool = True,
                  sessions: int = 0) -> EngineLoad:
        """The load with what the engine's control plane knows (its
        :meth:`~mars.policy.control.admission_core.AdmissionCore.load_view`, or the whole
        :meth:`~mars.policy.control.admission_core.AdmissionCore.snapshot`): the window (its
        budget; none without admission), the calls in flight, and the blocks its admitted
        sessions are projected to grow into beyond what they use now."""
        used = int((control.get("signals") or {}).get("used_blocks") or 0)
        return self.load(alive=alive, sessions=sessions, window=int(control.get("budget") or 0),
                         committed_blocks=int(control.get("projected_blocks") or 0) - used,
                         inflight=int(control.get("inflight") or 0))

    def load(self, *, alive: bool = True, sessions: int = 0, window: int = 0,
             committed_blocks: int = 0, inflight: int = 0,
             prefill_tokens_per_s: float = 10_000.0) -> EngineLoad:
        s = self.snapshot
        return EngineLoad(
            rank=self.rank, alive=alive, block_size=self.block_size,
            total_blocks=int(s.get("total_blocks") or 0),
            free_blocks=int(s.get("free_blocks") or 0),
            pinned_blocks=int(s.get("pinned_blocks") or 0),
            waiting=int(s.get("waiting") or 0), running=int(s.get("running") or 0),
            inflight=inflight, queued_prefill_tokens=max(0, self.queued_prefill_tokens),
            sessions=sessions, window=window, committed_blocks=max(0, committed_blocks),
            prefill_tokens_per_s=prefill_tokens_per_s)
